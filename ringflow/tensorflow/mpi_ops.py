"""TensorFlow ops over the ringflow core: collectives that run eagerly and inside ``tf.function``.

Each collective is a ``tf.numpy_function`` (graph mode) or a direct call (eager mode) into the
numpy core, wrapped in ``tf.custom_gradient`` so that it is differentiable. Names and gradients
follow Horovod 0.28's ``horovod.tensorflow.mpi_ops``:

==================  ==========================================================================
op                  gradient
==================  ==========================================================================
allreduce(op)       allreduce of the upstream gradient with the same op and scale factors
allgather           Average-allreduce of the upstream gradient, then this rank's rows
broadcast(root)     Average-allreduce of the upstream gradient on the root, zeros elsewhere
alltoall(splits)    alltoall of the upstream gradient with the received splits
reducescatter(op)   allgather of the upstream gradient (times the set size for Sum)
==================  ==========================================================================

Naming. Ranks match operations by name, so every op instance needs a name that is the same on
every rank and distinct from every other op in flight. Eagerly, a given ``name`` is used as is and
an unnamed op gets the core's call-order name (with a dtype/shape fingerprint, so a misordering is
a mismatch error, never a silent wrong pairing). In a graph, the name is fixed at trace time:
``name`` or ``Horovod<Op>_<tensor name>``, under the current name scope and made unique within the
graph, exactly as TensorFlow names the op itself. Gradient ops take the forward name plus
``_grad``.

Ordering. A graph op blocks its executor thread until every rank has submitted it (there is no
asynchronous kernel in pure Python). Two independent collectives of one graph could therefore run
in different orders on different ranks and deadlock, so every collective op gets a control
dependency on the previous collective op of the same graph: graphs execute them in trace order,
which is the same on every rank.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import Average, ProcessSet, ReduceOp, Sum, global_process_set
from ringflow.compression import Compressor
from ringflow.errors import TensorError

__all__ = [
    "_allreduce",
    "_grouped_allreduce",
    "_grouped_reducescatter",
    "_reducescatter",
    "allgather",
    "alltoall",
    "barrier",
    "broadcast",
    "grouped_allgather",
    "join",
    "local_rank_op",
    "local_size_op",
    "rank_op",
    "size_op",
]

# graph -> the last collective op traced into it (see "Ordering" above).
_LAST_OP: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _normalize_name(name: str) -> str:
    """A string usable as a TensorFlow op name (Horovod's rule: non-word characters become _)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _tensor_name(tensor: Any) -> str:
    try:
        return str(tensor.name)
    except (AttributeError, ValueError):
        return "tensor"


def _op_name(kind: str, tensors: Sequence[Any], name: str | None,
             ignore_name_scope: bool = False) -> str | None:
    """The name ranks match this op instance by; None eagerly without ``name`` (call order)."""
    if tf.executing_eagerly():
        return name
    if name is None:
        label = _tensor_name(tensors[0])
        if len(tensors) > 1:
            label = f"{label}_{_tensor_name(tensors[-1])}"
        name = f"Horovod{kind}_{label}"
    name = _normalize_name(name)
    graph = tf.compat.v1.get_default_graph()
    if ignore_name_scope:
        with graph.name_scope(None):
            return graph.unique_name(name)
    return graph.unique_name(name)


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}_grad"


_plain = tf.autograph.experimental.do_not_convert


def _call(fn: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
          touts: Sequence[tf.DType], name: str | None) -> list[tf.Tensor]:
    """Run ``fn`` (numpy in, list of numpy out) now (eager) or as a graph op in trace order."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(out, dtype=t)
                for out, t in zip(fn(*[x.numpy() for x in inputs]), touts, strict=True)]
    graph = tf.compat.v1.get_default_graph()
    previous = _LAST_OP.get(graph)
    with tf.control_dependencies([] if previous is None else [previous]):
        outs = tf.numpy_function(
            lambda *xs: [np.asarray(o, dtype=t.as_numpy_dtype)
                         for o, t in zip(fn(*xs), touts, strict=True)],
            list(inputs), list(touts), stateful=True,
            name=None if name is None else _normalize_name(name)[-200:],
        )
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    _LAST_OP[graph] = outs[0].op
    return outs


def _op(op: ReduceOp | int | None) -> ReduceOp:
    return ReduceOp.AVERAGE if op is None else ReduceOp(op)


# allreduce -----------------------------------------------------------------------------------
@_plain
def _allreduce(tensor: Any, name: str | None = None, op: ReduceOp | int = Sum,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
               compression: Compressor | None = None) -> tf.Tensor:
    """Allreduce one dense tensor with the core's ``op`` (no framework-side averaging).

    ``compression`` (a core compressor) is applied by the engine while fusing.
    """
    tensor = tf.convert_to_tensor(tensor)
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor,
                              ignore_name_scope, process_set, compression, _kind="Allreduce")[0]


@_plain
def _grouped_allreduce(tensors: Sequence[Any], name: str | None = None,
                       op: ReduceOp | int = Sum, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set,
                       compression: Compressor | None = None,
                       _kind: str = "GroupedAllreduce") -> list[tf.Tensor]:
    """Allreduce several dense tensors as one negotiated group (one graph op)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    reduce_op = _op(op)
    op_name = _op_name(_kind, tensors, name, ignore_name_scope)
    kwargs = {"op": reduce_op, "prescale_factor": prescale_factor,
              "postscale_factor": postscale_factor, "process_set": process_set,
              "compression": compression or _core.Compression.none}

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            outs = [_core.allreduce(arrays[0], name=op_name, **kwargs)]
        else:
            outs = _core.grouped_allreduce(list(arrays), name=op_name, **kwargs)
        # The core returns 0-d inputs as shape (1,) (np.ascontiguousarray): restore the shape.
        return [np.reshape(o, a.shape) for o, a in zip(outs, arrays, strict=True)]

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        outs = _call(run, xs, [x.dtype for x in xs], op_name)
        for out, x in zip(outs, xs, strict=True):
            out.set_shape(x.shape)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys = [tf.zeros_like(x) if dy is None else dy for dy, x in zip(dys, xs, strict=True)]
            return _grouped_allreduce(dys, _grad_name(op_name), reduce_op, prescale_factor,
                                      postscale_factor, True, process_set, compression,
                                      _kind=_kind)

        return outs, grad

    return list(forward(*tensors))


# allgather -----------------------------------------------------------------------------------
@_plain
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set, _kind="Allgather")[0]


@_plain
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set,
                      _kind: str = "GroupedAllgather") -> list[tf.Tensor]:
    """Allgather several tensors as one negotiated group."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    op_name = _op_name(_kind, tensors, name, ignore_name_scope)

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [_core.allgather(arrays[0], name=op_name, process_set=process_set)]
        return _core.grouped_allgather(list(arrays), name=op_name, process_set=process_set)

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        outs = _call(run, xs, [x.dtype for x in xs], op_name)
        for out, x in zip(outs, xs, strict=True):
            out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:])
                          if x.shape.rank else tf.TensorShape([None]))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys = [tf.zeros_like(o) if dy is None else dy for dy, o in zip(dys, outs, strict=True)]
            reduced = _grouped_allreduce(dys, _grad_name(op_name), Average, 1.0, 1.0, True,
                                         process_set)
            counts = grouped_allgather(
                [tf.reshape(tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else
                            tf.constant(1, tf.int64), [1]) for x in xs],
                _grad_name(_grad_name(op_name)), True, process_set)
            me, members = process_set.rank(), process_set.size()
            counts = [tf.reshape(c, [members]) for c in counts]
            return [tf.reshape(tf.split(g, tf.cast(c, tf.int32), axis=0)[me], tf.shape(x))
                    for g, c, x in zip(reduced, counts, xs, strict=True)]

        return outs, grad

    return list(forward(*tensors))


# broadcast -----------------------------------------------------------------------------------
@_plain
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank gets ``root_rank``'s value of ``tensor``."""
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Broadcast", [tensor], name, ignore_name_scope)
    root = int(root_rank)

    def run(array: np.ndarray) -> list[np.ndarray]:
        out = _core.broadcast(array, root, name=op_name, process_set=process_set)
        return [np.reshape(out, array.shape)]

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        out = _call(run, [x], [x.dtype], op_name)[0]
        out.set_shape(x.shape)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = _allreduce(dy, _grad_name(op_name), Average, ignore_name_scope=True,
                                 process_set=process_set)
            return reduced if process_set.rank() == root else reduced * 0

        return out, grad

    return forward(tensor)


# alltoall ------------------------------------------------------------------------------------
@_plain
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[d]`` rows to rank ``d`` of the set; receive rows from every rank.

    Returns the received rows, or (rows, received splits) when ``splits`` was given (Horovod's
    convention). Without ``splits`` the rows are divided evenly, lower ranks taking the remainder.
    """
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Alltoall", [tensor], name, ignore_name_scope)
    n = process_set.size()
    if splits is None:
        rows = tf.shape(tensor, out_type=tf.int32)[0]
        splits_t = rows // n + tf.cast(tf.range(n) < rows % n, tf.int32)
    else:
        splits_t = tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int32)

    def run(array: np.ndarray, split: np.ndarray) -> list[np.ndarray]:
        rows, received = _core.alltoall(array, [int(s) for s in split], name=op_name,
                                        process_set=process_set)
        return [rows, np.asarray(received, np.int32)]

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        out, received = _call(run, [x, splits_t], [x.dtype, tf.int32], op_name)
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        received.set_shape([n])

        def grad(dy: tf.Tensor, _dsplits: Any = None) -> tf.Tensor:
            back, _ = alltoall(dy, received, _grad_name(op_name), True, process_set)
            return tf.reshape(back, tf.shape(x))

        return (out, received), grad

    out, received = forward(tensor)
    return out if splits is None else (out, received)


# reducescatter -------------------------------------------------------------------------------
@_plain
def _reducescatter(tensor: Any, name: str | None = None, op: ReduceOp | int = Sum,
                   ignore_name_scope: bool = False,
                   process_set: ProcessSet = global_process_set,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    return _grouped_reducescatter([tensor], name, op, ignore_name_scope, process_set,
                                  prescale_factor, postscale_factor, _kind="Reducescatter")[0]


@_plain
def _grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                           op: ReduceOp | int = Sum, ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           _kind: str = "GroupedReducescatter") -> list[tf.Tensor]:
    """Reduce, then give each rank its share of rows (lower ranks take the remainder)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    reduce_op = _op(op)
    op_name = _op_name(_kind, tensors, name, ignore_name_scope)
    kwargs = {"op": reduce_op, "process_set": process_set,
              "prescale_factor": prescale_factor, "postscale_factor": postscale_factor}

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [_core.reducescatter(arrays[0], name=op_name, **kwargs)]
        return _core.grouped_reducescatter(list(arrays), name=op_name, **kwargs)

    n, me = process_set.size(), process_set.rank()

    @tf.custom_gradient
    def forward(*xs: tf.Tensor) -> Any:
        outs = _call(run, xs, [x.dtype for x in xs], op_name)
        for out, x in zip(outs, xs, strict=True):
            rows = x.shape[0] if x.shape.rank else None
            mine = None if rows is None else rows // n + (1 if me < rows % n else 0)
            out.set_shape(tf.TensorShape([mine]).concatenate(x.shape[1:]))

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys = [tf.zeros_like(o) if dy is None else dy for dy, o in zip(dys, outs, strict=True)]
            if reduce_op == ReduceOp.SUM:
                dys = [dy * tf.cast(n, dy.dtype) for dy in dys]
            return grouped_allgather(dys, _grad_name(op_name), True, process_set)

        return outs, grad

    return list(forward(*tensors))


# control ops ---------------------------------------------------------------------------------
@_plain
def join() -> tf.Tensor:
    """Stop contributing data until every rank has joined; returns the last rank to join."""
    return _call(lambda: [np.asarray(_core.join(), np.int32)], [], [tf.int32], "HorovodJoin")[0]


@_plain
def barrier(process_set: ProcessSet = global_process_set) -> Any:
    """Return once every rank of ``process_set`` has called barrier().

    Eagerly it returns None; in a graph, the barrier op (to use as a control dependency).
    """
    if tf.executing_eagerly():
        _core.barrier(process_set=process_set)
        return None

    def run() -> list[np.ndarray]:
        _core.barrier(process_set=process_set)
        return [np.asarray(0, np.int32)]

    return _call(run, [], [tf.int32], "HorovodBarrier")[0].op


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes (of the process set) as an int32 tensor."""
    return tf.constant(_set_by_id(process_set_id).size(), tf.int32, name=name)


def rank_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return tf.constant(_set_by_id(process_set_id).rank(), tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(_core.local_size(), tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(_core.local_rank(), tf.int32, name=name)


_SETS: dict[int, ProcessSet] = {}


def _set_by_id(process_set_id: int) -> ProcessSet:
    if process_set_id == 0:
        return global_process_set
    try:
        return _SETS[process_set_id]
    except KeyError:  # a set added through ringflow.add_process_set is not in _SETS
        raise TensorError(
            f"process set id {process_set_id} is unknown to ringflow.tensorflow; register it "
            "with ringflow.tensorflow.add_process_set() first"
        ) from None
