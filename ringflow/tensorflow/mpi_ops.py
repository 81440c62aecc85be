"""TensorFlow ops over the ringflow core: collectives that run eagerly and inside ``tf.function``.

Each collective is a ``tf.py_function`` (graph mode) or a direct call (eager mode) into the
numpy core, wrapped in ``tf.custom_gradient`` so that it is differentiable. Op resolution,
compression dispatch and the gradient rule of every collective are the adapter kit's
(:mod:`ringflow._adapter`), shared with ``ringflow.torch``; :class:`_TFOps` is how the kit's
rules run on TensorFlow tensors. Host tensors reach the core without a copy (``np.asarray``), and
aligned results the core allocated become tensors without one (DLPack).

Naming. Ranks match operations by name, so every op instance needs a name that is the same on
every rank and distinct from every other op in flight. Eagerly, a given ``name`` travels as
``"<kind>.<name>"`` (the kit's rule, as in ``ringflow.torch``) and an unnamed op gets the core's
call-order name. In a graph, the name is fixed at trace time: ``name`` or
``Horovod<Op>_<tensor name>``, under the current name scope and made unique within the graph,
exactly as TensorFlow names the op itself. Gradient ops take the forward name plus ``.grad``.

Errors. A failed collective raises the ``tf.errors`` class Horovod's op raises for that failure
(a mismatch between ranks: ``FailedPreconditionError``; a bad argument: ``InvalidArgumentError``;
a shutdown, stall or lost peer: ``UnknownError``), eagerly and in a graph, with ringflow's text;
eagerly the exception is ringflow's error class too (:mod:`ringflow.tensorflow.status`).

Ordering. A graph op blocks its executor thread until every rank has submitted it (there is no
asynchronous kernel in pure Python). Two independent collectives of one graph could therefore run
in different orders on different ranks and deadlock, so every collective op gets a control
dependency on the previous collective op of the same graph: graphs execute them in trace order,
which is the same on every rank.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import ProcessSet, ReduceOp, Sum, global_process_set
from ringflow import _adapter as kit
from ringflow.compression import Compressor
from ringflow.errors import RingflowError, TensorError

from . import status
from .compression import Compression

__all__ = [
    "_allreduce",
    "_grouped_allreduce",
    "_grouped_reducescatter",
    "allgather",
    "alltoall",
    "barrier",
    "broadcast",
    "gather",
    "grouped_allgather",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reduce",
    "scatter",
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
        return kit.op_name(kind.lower(), name)
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


_plain = tf.autograph.experimental.do_not_convert


def _arrays(tensors: Sequence[tf.Tensor]) -> list[np.ndarray]:
    """Eager tensors as numpy arrays: those on the host share their memory (the core only reads
    its inputs); a GPU tensor is copied to the host by TensorFlow."""
    return [np.asarray(x) for x in tensors]


def _owned(array: np.ndarray) -> bool:
    """Whether ``array`` is (a view of) memory numpy allocated, as the core allocates results."""
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base.flags.owndata


# TensorFlow's kernels read tensors through aligned Eigen maps and abort ("Check failed:
# IsAligned()") on a buffer that is not: EIGEN_MAX_ALIGN_BYTES is 64 with AVX-512.
_ALIGN = 64


def _tensor(array: Any, dtype: tf.DType) -> tf.Tensor:
    """A core result as an eager tensor of ``dtype``. A buffer the core allocated is handed to
    TensorFlow through DLPack when it is aligned as TensorFlow needs, instead of copied; anything
    else (a view of an input, bfloat16, a read-only or unaligned array) is copied, as
    ``tf.numpy_function`` copies an unaligned result."""
    array = np.asarray(array, dtype=dtype.as_numpy_dtype)
    if (array.dtype.kind in "biufc" and array.flags.c_contiguous and array.flags.writeable
            and array.ctypes.data % _ALIGN == 0 and _owned(array)):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array, dtype=dtype)


def _call(fn: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
          touts: Sequence[tf.DType], name: str | None) -> list[tf.Tensor]:
    """Run ``fn`` (numpy in, list of numpy out) now (eager) or as a graph op in trace order.

    A ringflow error surfaces as the ``tf.errors`` class Horovod's op raises (:mod:`.status`).
    """
    if tf.executing_eagerly():
        # A GPU tensor is staged through host memory with TensorFlow's own copies (here, and
        # the py_function's host placement in a graph); eagerly the results go back to the
        # first input's device, as Horovod's GPU ops return them.
        try:
            results = fn(*_arrays(inputs))
        except RingflowError as exc:
            raise status.typed(exc) from exc
        outs = [_tensor(out, t) for out, t in zip(results, touts, strict=True)]
        device = getattr(inputs[0], "device", "") if inputs else ""
        if "GPU" not in device.upper():
            return outs
        with tf.device(device):
            return [tf.identity(o) for o in outs]

    def body(*xs: tf.Tensor) -> list[Any]:
        try:
            results = fn(*_arrays(xs))
        except RingflowError as exc:
            if status.tf_class(exc) is tf.errors.FailedPreconditionError:
                return status.carriers(exc, len(touts))
            raise  # TensorFlow's class follows the builtin base (see status)
        return [_tensor(o, t) for o, t in zip(results, touts, strict=True)]

    graph = tf.compat.v1.get_default_graph()
    previous = _LAST_OP.get(graph)
    with tf.control_dependencies([] if previous is None else [previous]):
        outs = tf.py_function(body, list(inputs), list(touts),
                              name=None if name is None else _normalize_name(name)[-200:])
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    _LAST_OP[graph] = outs[0].op
    return outs


# gradients -----------------------------------------------------------------------------------
class _TFOps:
    """The kit's :class:`~ringflow._adapter.Ops` on TensorFlow tensors (the collectives below,
    themselves differentiable, so that second derivatives work too)."""

    def allreduce(self, xs: list[tf.Tensor], op: ReduceOp, prescale: float, postscale: float,
                  process_set: ProcessSet, name: str | None) -> list[tf.Tensor]:
        return _grouped_allreduce(xs, name, op, prescale, postscale, True, process_set,
                                  _kind="Allreduce" if len(xs) == 1 else "GroupedAllreduce")

    def allgather(self, xs: list[tf.Tensor], process_set: ProcessSet,
                  name: str | None) -> list[tf.Tensor]:
        # One op per tensor, as Horovod: TensorFlow may hand float32 zeros for float64 outputs.
        return [allgather(x, None if name is None else f"{name}.{i}", True, process_set)
                for i, x in enumerate(xs)]

    def alltoall(self, x: tf.Tensor, splits: Any, process_set: ProcessSet,
                 name: str | None) -> tf.Tensor:
        return alltoall(x, splits, name, True, process_set)[0]

    def scale(self, x: tf.Tensor, factor: float) -> tf.Tensor:
        return x * tf.constant(factor, x.dtype)  # tf.cast of a float goes through float32

    def zeros_like(self, x: tf.Tensor) -> tf.Tensor:
        # Zeros that still read x (tf.zeros_like of a static shape is a constant): a broadcast's
        # gradient off the root must depend on its allreduce, or a TF1 session.run prunes that
        # collective on those ranks only and the root waits for them forever.
        return tf.raw_ops.ZerosLike(x=x)

    def own_rows(self, xs: list[tf.Tensor], rows: Any, process_set: ProcessSet,
                 name: str | None) -> list[tf.Tensor]:
        counts = allgather(tf.reshape(tf.cast(tf.stack(rows), tf.int64), [1, len(xs)]), name,
                           True, process_set)
        starts = tf.reduce_sum(counts[:process_set.rank()], axis=0)
        return [x[starts[i]:starts[i] + tf.cast(n, tf.int64)]
                for i, (x, n) in enumerate(zip(xs, rows, strict=True))]


_OPS = _TFOps()


def _differentiable(name: str | None, spec: kit.Spec | Callable[[list[tf.Tensor]], kit.Spec],
                    run: Callable[..., list[np.ndarray]], xs: list[tf.Tensor],
                    touts: list[tf.DType], shape: Callable[[tf.Tensor, tf.Tensor], None],
                    extra: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """``run`` over ``xs`` (and non-differentiable ``extra`` inputs) as one collective op
    ``name`` whose gradient is the kit's rule for the spec's kind; ``shape(out, x)`` sets the
    static shapes.
    ``spec`` may be a function of the op's outputs (alltoall's gradient needs them)."""
    n = len(xs)

    @tf.custom_gradient
    def forward(*inputs: tf.Tensor) -> Any:
        outs = _call(run, [*inputs, *extra], touts, name)
        for out, x in zip(outs, inputs, strict=False):
            shape(out, x)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys = [tf.zeros_like(o) if dy is None else dy
                   for dy, o in zip(dys[:n], outs, strict=False)]
            rule = spec if isinstance(spec, kit.Spec) else spec(outs)
            dxs = kit.GRADIENTS[rule.kind](_OPS, dys, rule)
            return [tf.reshape(dx, tf.shape(x)) for dx, x in zip(dxs, inputs, strict=True)]

        return outs, grad

    return list(forward(*xs))


def _same_shape(out: tf.Tensor, x: tf.Tensor) -> None:
    out.set_shape(x.shape)


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
    reduce_op = kit.resolve_op(op, None)
    op_name = _op_name(_kind, tensors, name, ignore_name_scope)
    kwargs = {"op": reduce_op, "prescale_factor": prescale_factor,
              "postscale_factor": postscale_factor, "process_set": process_set,
              "compression": compression or Compression.none}

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            outs = [_core.allreduce(arrays[0], name=op_name, **kwargs)]
        else:
            outs = _core.grouped_allreduce(list(arrays), name=op_name, **kwargs)
        # The core returns 0-d inputs as shape (1,) (np.ascontiguousarray): restore the shape.
        return [np.reshape(o, a.shape) for o, a in zip(outs, arrays, strict=True)]

    spec = kit.Spec("allreduce", op_name, process_set, reduce_op, prescale_factor,
                    postscale_factor)
    return _differentiable(op_name, spec, run, tensors, [x.dtype for x in tensors], _same_shape)


# allgather -----------------------------------------------------------------------------------
@_plain
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set, _kind="Allgather")[0]


def _gathered_shape(out: tf.Tensor, x: tf.Tensor) -> None:
    out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank
                  else tf.TensorShape([None]))


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

    rows = [tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else tf.constant(1, tf.int64)
            for x in tensors]
    spec = kit.Spec("allgather", op_name, process_set, rows=rows)
    return _differentiable(op_name, spec, run, tensors, [x.dtype for x in tensors], _gathered_shape)


# broadcast -----------------------------------------------------------------------------------
@_plain
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank of ``process_set`` gets ``root_rank``'s value of ``tensor``.

    ``root_rank`` is a global rank (as in Horovod 0.28) and must be a member of the set.
    """
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Broadcast", [tensor], name, ignore_name_scope)
    root = int(root_rank)

    def run(array: np.ndarray) -> list[np.ndarray]:
        out = _core.broadcast(array, root, name=op_name, process_set=process_set)
        return [np.reshape(out, array.shape)]

    spec = kit.Spec("broadcast", op_name, process_set, root=root)
    return _differentiable(op_name, spec, run, [tensor], [tensor.dtype], _same_shape)[0]


# reduce, gather, scatter (to and from a root; not differentiable) ---------------------------
# Off the root these return a tensor with no elements (a graph op must return a tensor; the core
# returns None), as ringflow.torch does.
def _off_root(result: Any, rest: tuple[int, ...], dtype: tf.DType) -> np.ndarray:
    if result is None:
        return np.empty((0, *rest), dtype.as_numpy_dtype)
    return np.asarray(result)


@_plain
def reduce(tensor: Any, root_rank: int, op: ReduceOp | int | None = None,
           name: str | None = None, ignore_name_scope: bool = False,
           process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
           postscale_factor: float = 1.0) -> tf.Tensor:
    """The reduction of ``tensor`` over the set on ``root_rank`` (a global rank; default op
    Average); a tensor with no elements on the other ranks."""
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Reduce", [tensor], name, ignore_name_scope)
    reduce_op = kit.resolve_op(op, None)

    def run(array: np.ndarray) -> list[np.ndarray]:
        out = _core.reduce(array, int(root_rank), reduce_op, op_name, process_set,
                           prescale_factor, postscale_factor)
        return [_off_root(None if out is None else np.reshape(out, array.shape), (),
                          tensor.dtype)]

    return _call(run, [tensor], [tensor.dtype], op_name)[0]


@_plain
def gather(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
           process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (first dimensions may differ) on
    ``root_rank``; a tensor of no rows on the other ranks."""
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Gather", [tensor], name, ignore_name_scope)

    def run(array: np.ndarray) -> list[np.ndarray]:
        out = _core.gather(array, int(root_rank), op_name, process_set)
        return [_off_root(out, tuple(array.shape[1:]), tensor.dtype)]

    out = _call(run, [tensor], [tensor.dtype], op_name)[0]
    _gathered_shape(out, tensor)
    return out


@_plain
def scatter(tensors: Sequence[Any] | None, root_rank: int, name: str | None = None,
            ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
            dtype: Any = None) -> tf.Tensor:
    """This rank's piece of the root's ``tensors`` (one per rank of the set, in set rank order;
    ignored elsewhere). Inside ``tf.function`` the other ranks pass ``dtype`` (only the root's
    tensors say what arrives)."""
    pieces = [] if tensors is None else [tf.convert_to_tensor(t) for t in tensors]
    if pieces:
        dtype = pieces[0].dtype
    elif dtype is None and not tf.executing_eagerly():
        raise TensorError("scatter inside tf.function: ranks other than the root must pass "
                          "dtype= (the dtype of the pieces they receive)")
    op_name = _op_name("Scatter", pieces or [tf.constant(0)], name, ignore_name_scope)

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        out = _core.scatter(list(arrays) or None, int(root_rank), op_name, process_set)
        if dtype is not None and out.dtype != tf.as_dtype(dtype).as_numpy_dtype:
            raise TensorError(f"scatter {op_name!r}: the root sent {out.dtype}, but this rank "
                              f"asked for dtype={tf.as_dtype(dtype).name}")
        return [out]

    if dtype is None:  # eagerly, off the root: whatever arrives
        try:
            return tf.convert_to_tensor(run()[0])
        except RingflowError as exc:
            raise status.typed(exc) from exc
    return _call(run, pieces, [tf.as_dtype(dtype)], op_name)[0]


# alltoall ------------------------------------------------------------------------------------
@_plain
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[d]`` rows to rank ``d`` of the set; receive rows from every rank.

    Returns the received rows, or (rows, received splits) when ``splits`` was given (Horovod's
    convention). Without ``splits`` every rank gets an equal share of the rows; a first dimension
    that is not a multiple of the set's size fails on every rank (Horovod's rule).
    """
    tensor = tf.convert_to_tensor(tensor)
    op_name = _op_name("Alltoall", [tensor], name, ignore_name_scope)
    n = process_set.size()
    # No splits travel as an empty tensor (as in Horovod's op); the core then divides evenly.
    splits_t = tf.cast(tf.reshape(tf.convert_to_tensor([] if splits is None else splits), [-1]),
                       tf.int32)

    def run(array: np.ndarray, split: np.ndarray) -> list[np.ndarray]:
        rows, received = _core.alltoall(
            array, None if splits is None else [int(s) for s in split], name=op_name,
            process_set=process_set)
        return [rows, np.asarray(received, np.int32)]

    def shape(out: tf.Tensor, x: tf.Tensor) -> None:
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

    def spec(outs: list[tf.Tensor]) -> kit.Spec:  # the gradient sends back what was received
        return kit.Spec("alltoall", op_name, process_set, received=outs[1])

    out, received = _differentiable(op_name, spec, run, [tensor], [tensor.dtype, tf.int32], shape,
                                    extra=[splits_t])
    received.set_shape([n])
    return out if splits is None else (out, received)


# reducescatter -------------------------------------------------------------------------------
@_plain
def _grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                           op: ReduceOp | int = Sum, ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           compression: Compressor | None = None,
                           _kind: str = "GroupedReducescatter") -> list[tf.Tensor]:
    """Reduce, then give each rank its share of rows (lower ranks take the remainder)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    reduce_op = kit.resolve_op(op, None)
    op_name = _op_name(_kind, tensors, name, ignore_name_scope)
    kwargs = {"op": reduce_op, "process_set": process_set, "prescale_factor": prescale_factor,
              "postscale_factor": postscale_factor,
              "compression": compression or Compression.none}

    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [_core.reducescatter(arrays[0], name=op_name, **kwargs)]
        return _core.grouped_reducescatter(list(arrays), name=op_name, **kwargs)

    n, me = process_set.size(), process_set.rank()

    def shape(out: tf.Tensor, x: tf.Tensor) -> None:
        rows = x.shape[0] if x.shape.rank else None
        mine = None if rows is None else rows // n + (1 if me < rows % n else 0)
        out.set_shape(tf.TensorShape([mine]).concatenate(x.shape[1:]))

    spec = kit.Spec("reducescatter", op_name, process_set, reduce_op, prescale_factor,
                    postscale_factor)
    return _differentiable(op_name, spec, run, tensors, [x.dtype for x in tensors], shape)


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
        try:
            _core.barrier(process_set=process_set)
        except RingflowError as exc:
            raise status.typed(exc) from exc
        return None

    def run() -> list[np.ndarray]:
        _core.barrier(process_set=process_set)
        return [np.asarray(0, np.int32)]

    return _call(run, [], [tf.int32], "HorovodBarrier")[0].op


def current(value: Callable[[], int], name: str | None = None) -> tf.Tensor:
    """``value()`` as an int32 tensor. In a graph of an elastic worker it is read each time the
    graph runs, not when it was traced: the world may have re-formed since (Horovod's ops read
    its size at run time under ``HOROVOD_ELASTIC``). Elsewhere a job never resizes: a
    constant."""
    if tf.executing_eagerly() or not os.environ.get("RINGFLOW_ELASTIC_ID"):
        return tf.constant(value(), tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, name=name)
    out.set_shape([])
    return out


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes (of the process set) as an int32 tensor."""
    return current(lambda: _set_by_id(process_set_id).size(), name)


def rank_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return current(lambda: _set_by_id(process_set_id).rank(), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 (int32) if this rank belongs to the process set, else 0."""
    return current(lambda: int(_set_by_id(process_set_id).included()), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return current(_core.local_size, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return current(_core.local_rank, name)


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
