"""The adapter kit: what ``ringflow.torch`` and ``ringflow.tensorflow`` share, written once.

An adapter converts its framework's tensors to numpy arrays and back and wires its autograd; all
the rest of Horovod's semantics lives here, so the two adapters cannot drift apart:

- :func:`resolve_op`: ``op=`` with Horovod's deprecated ``average=`` flag;
- :func:`op_name` / :func:`grad_name`: the names ranks match operations by;
- :func:`compressed`: a core compressor goes to the engine (it casts while fusing), any other
  object with Horovod's ``compress``/``decompress`` is applied around the collective;
- :func:`broadcast_object` / :func:`allgather_object`: Python objects (cloudpickle when
  installed), framework-free;
- :class:`Invalid`: a tensor that failed local validation, turned into a request that fails on
  every rank instead of an exception on one (which would leave the others waiting);
- :data:`GRADIENTS`: one gradient rule per differentiable collective, written over the small
  :class:`Ops` interface that each adapter implements with its own tensors; torch applies a rule
  in ``autograd.Function.backward``, TensorFlow in ``tf.custom_gradient``;
- :func:`sparse_scale`: Horovod's sparse allreduce (allgather of values and indices);
- :data:`P2P_GRADIENTS`: the gradient rules of point-to-point ``send`` / ``recv`` over the
  :class:`P2POps` interface (the contract each adapter documents: a send returns a token to
  backpropagate through; the receiver's backward sends the gradient back).

Gradient rules are Horovod 0.28's (``horovod/torch/mpi_ops.py``, ``horovod/tensorflow/mpi_ops.py``),
which take the loss to be averaged over ranks:

==============  ======================================================================
collective      gradient of the inputs, from the gradients of the outputs ``dy``
==============  ======================================================================
allreduce       allreduce of ``dy`` with the same op and scale factors
allgather       Average-allreduce of ``dy``, then the rows this rank contributed
broadcast       Average-allreduce of ``dy`` on the root (a global rank), zeros elsewhere
alltoall        alltoall of ``dy`` with the splits this rank received
reducescatter   allgather of ``dy``, times the set size for Sum, times prescale * postscale
==============  ======================================================================

Grouped collectives apply the same rule to every tensor of the group, as one grouped operation.

Point to point (MegEngine's ``remote_send`` / ``remote_recv``): the gradient of ``send(x, dst,
tag)`` is a receive from ``dst`` of a tensor like ``x``, and the gradient of ``recv(src, tag)`` is
a send of the output's gradient to ``src``, both on the gradient tag :func:`grad_tag` of the
forward message, so that backward passes pair exactly whatever order they run in.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from . import ProcessSet, global_process_set, rank
from .compression import Compression, Compressor, GradientCompression
from .errors import ConfigError, TensorError, UnsupportedError
from .ops import ReduceOp

try:  # cloudpickle handles lambdas and local classes, as in Horovod; pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle  # type: ignore[assignment]

__all__ = [
    "GRADIENTS", "Invalid", "Ops", "SparseOpError", "Spec", "allgather_object", "broadcast_object",
    "compressed", "grad_name", "op_name", "resolve_op",
    "sparse_scale",
]
# point to point
__all__ += ["P2P_GRADIENTS", "P2POps", "P2PSpec", "grad_tag"]

T = TypeVar("T")


# arguments ---------------------------------------------------------------------------------------
def resolve_op(op: ReduceOp | int | None, average: bool | None) -> ReduceOp:
    """The reduce op of a call that may use Horovod's deprecated ``average=`` flag.

    Raises:
        ValueError: both ``op`` and ``average`` were given (Horovod's text).
    """
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return ReduceOp(op)
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE


def op_name(kind: str, name: str | None) -> str | None:
    """The name a named operation travels under, ``"<kind>.<name>"`` (as Horovod's C++ layer
    prefixes names), so that a broadcast and an allreduce may share a user name; None stays None
    (the core then names the operation by call order)."""
    return None if name is None else f"{kind}.{name}"


def grad_name(name: str | None) -> str | None:
    """The name of the backward operation of a forward operation named ``name``."""
    return None if name is None else f"{name}.grad"


def compressed(compression: Any, tensors: Sequence[T],
               run: Callable[[Sequence[T], Compressor], Sequence[T]]) -> list[T]:
    """``run(tensors, core_compressor)`` with ``compression`` applied.

    A core :class:`~ringflow.compression.Compressor` (``Compression.fp16``, ...) is handed to the
    engine, which casts while it packs the fusion buffer; any other object with Horovod's
    ``compress(t) -> (t, ctx)`` / ``decompress(t, ctx)`` is applied around the collective.
    """
    if isinstance(compression, Compressor):
        return list(run(tensors, compression))
    if isinstance(compression, GradientCompression):
        raise ConfigError(
            f"compression {compression.spec()!r} keeps state per gradient (error feedback) and "
            "works in DistributedOptimizer / DistributedGradientTape / the Keras "
            "DistributedOptimizer only; collectives take Compression.none, fp16 or bf16")
    pairs = [compression.compress(t) for t in tensors]
    outs = run([t for t, _ in pairs], Compression.none)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


# objects -----------------------------------------------------------------------------------------
def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return np.frombuffer(buf.getbuffer(), np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of ``process_set``; the root gets ``obj`` itself.

    ``root_rank`` is a global rank. The default name is fixed (Horovod uses the type's name,
    which differs when non-root ranks pass ``None``, as they usually do, and then stalls).
    Objects travel pickled (cloudpickle when installed) after every connection proved the job
    secret, so unpickling them is as safe as the training script itself.
    """
    from . import broadcast

    base = f"broadcast_object.{name or 'object'}"
    root = rank() == root_rank
    payload = _dumps(obj) if root else np.zeros(0, np.uint8)
    length = broadcast(np.asarray([payload.size], np.int64), root_rank, name=f"{base}.len",
                       process_set=process_set)
    data = broadcast(payload if root else np.empty(int(length[0]), np.uint8), root_rank,
                     name=f"{base}.data", process_set=process_set)
    return obj if root else _pickler.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order of ``process_set`` (pickled as in
    :func:`broadcast_object`; the default name is fixed for the same reason)."""
    from . import allgather

    base = f"allgather_object.{name or 'object'}"
    payload = _dumps(obj)
    lengths = allgather(np.asarray([payload.size], np.int64), name=f"{base}.len",
                        process_set=process_set)
    data = allgather(payload, name=f"{base}.data", process_set=process_set)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [_pickler.loads(data[offsets[i]:offsets[i + 1]].tobytes())
            for i in range(lengths.size)]


# local validation --------------------------------------------------------------------------------
class Invalid:
    """Stands for a tensor that failed local validation; ``np.asarray`` of it raises the reason.

    The core turns that into a request carrying the error, so the operation fails on every rank
    with the same text. ``ndim`` / ``shape`` let shape helpers look at it without converting it.
    """

    ndim = 1
    shape = (0,)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(self.reason)


# gradients ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """One forward collective call, as its gradient rule needs it."""

    kind: str  # allreduce, allgather, broadcast, alltoall, reducescatter
    name: str | None
    process_set: ProcessSet
    op: ReduceOp = ReduceOp.AVERAGE
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    rows: Any = None  # allgather: this rank's first dimension of each input (framework values)
    received: Any = None  # alltoall: the splits this rank received


class Ops(Protocol[T]):
    """What a gradient rule needs from a framework: collectives on lists of its tensors (one
    tensor: the plain op; several: the grouped op), and three local tensor operations."""

    def allreduce(self, xs: list[T], op: ReduceOp, prescale: float, postscale: float,
                  process_set: ProcessSet, name: str | None) -> list[T]: ...

    def allgather(self, xs: list[T], process_set: ProcessSet, name: str | None) -> list[T]: ...

    def alltoall(self, x: T, splits: Any, process_set: ProcessSet, name: str | None) -> T: ...

    def scale(self, x: T, factor: float) -> T: ...

    def zeros_like(self, x: T) -> T: ...

    def own_rows(self, xs: list[T], rows: Any, process_set: ProcessSet,
                 name: str | None) -> list[T]:
        """Of each ``xs[i]`` (a concatenation over the members of ``process_set``), the
        ``rows[i]`` rows this rank contributed; where they start takes one allgather of every
        member's row counts, named ``name``."""
        ...


def _allreduce_grad(f: Ops[T], dys: list[T], s: Spec) -> list[T]:
    return f.allreduce(dys, s.op, s.prescale, s.postscale, s.process_set, grad_name(s.name))


def _allgather_grad(f: Ops[T], dys: list[T], s: Spec) -> list[T]:
    name = grad_name(s.name)
    reduced = f.allreduce(dys, ReduceOp.AVERAGE, 1.0, 1.0, s.process_set, name)
    return f.own_rows(reduced, s.rows, s.process_set, None if name is None else f"{name}.rows")


def _broadcast_grad(f: Ops[T], dys: list[T], s: Spec) -> list[T]:
    reduced = f.allreduce(dys, ReduceOp.AVERAGE, 1.0, 1.0, s.process_set, grad_name(s.name))
    return reduced if rank() == s.root else [f.zeros_like(g) for g in reduced]


def _alltoall_grad(f: Ops[T], dys: list[T], s: Spec) -> list[T]:
    return [f.alltoall(dys[0], s.received, s.process_set, grad_name(s.name))]


def _reducescatter_grad(f: Ops[T], dys: list[T], s: Spec) -> list[T]:
    factor = (s.process_set.size() if s.op == ReduceOp.SUM else 1) * s.prescale * s.postscale
    gathered = f.allgather(dys, s.process_set, grad_name(s.name))
    return gathered if factor == 1.0 else [f.scale(g, factor) for g in gathered]


#: kind -> rule(ops, output gradients, forward spec) -> input gradients
GRADIENTS: dict[str, Callable[[Ops[Any], list[Any], Spec], list[Any]]] = {
    "allreduce": _allreduce_grad,
    "allgather": _allgather_grad,
    "broadcast": _broadcast_grad,
    "alltoall": _alltoall_grad,
    "reducescatter": _reducescatter_grad,
}


# sparse ------------------------------------------------------------------------------------------
class SparseOpError(TensorError, UnsupportedError):
    """A sparse allreduce with an op other than Sum or Average: a ``ValueError`` (a misuse) and a
    ``NotImplementedError``, the class Horovod's TensorFlow ``allreduce`` raises for it."""


def sparse_scale(op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet,
                 name: str | None) -> float:
    """The factor of the gathered values of a sparse allreduce.

    A sparse tensor (torch COO, ``tf.IndexedSlices``) is reduced as Horovod does it: every rank's
    values and indices are allgathered, so the represented dense tensors add up (duplicate
    indices included); Average divides the values by the set size, and the scale factors
    multiply them (torch; ``ringflow.tensorflow`` refuses scale factors and divides, as Horovod's
    TensorFlow does). Horovod's torch treats any other op as Sum and its TensorFlow raises
    NotImplementedError; ringflow refuses it in both (at the call, on every rank alike), since
    the result would silently not be a Min/Max/Product.

    Raises:
        SparseOpError: ``op`` is not Sum or Average (a TensorError and a NotImplementedError).
    """
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise SparseOpError(f"allreduce of the sparse tensor {name or '(unnamed)'} supports op "
                            f"Sum or Average, not {op.name}; densify it first "
                            "(sparse_as_dense=True)")
    return prescale * postscale / (process_set.size() if op == ReduceOp.AVERAGE else 1)


# point to point ----------------------------------------------------------------------------------
def grad_tag(tag: int, seq: Any) -> tuple[int, Any]:
    """The tag on which the gradient of the forward message ``seq`` (its sender's number, which
    the receiver learns with the message) sent with ``tag`` travels back: the pair, which no
    user tag (an int) equals, and which names one message, so the two ranks' backward passes
    need not run their point-to-point operations in the same order. ``seq`` may be a framework
    value (a TensorFlow graph's); the adapter turns it into an int when the operation runs."""
    return (tag, seq)


@dataclasses.dataclass(frozen=True)
class P2PSpec:
    """One forward point-to-point call, as its gradient rule needs it."""

    kind: str  # send, recv
    peer: int  # send: the destination; recv: the source
    tag: int
    seq: Any  # the forward message's number (an int, or a framework value)
    like: Any = None  # send: what the gradient looks like (the adapter's; opaque to the kit)


class P2POps(Protocol[T]):
    """What the point-to-point gradient rules need from a framework."""

    def send(self, x: T, dst: int, tag: Any) -> None:
        """Start sending ``x`` to ``dst`` and return without waiting for it to be received (a
        backward pass must not wait on its peer's: the two may run in any order)."""
        ...

    def recv(self, src: int, tag: Any, like: Any) -> T:
        """Receive from ``src`` a tensor described by ``like`` (see :class:`P2PSpec`)."""
        ...


def _send_grad(f: P2POps[T], dys: list[T], s: P2PSpec) -> list[T]:
    return [f.recv(s.peer, grad_tag(s.tag, s.seq), s.like)]


def _recv_grad(f: P2POps[T], dys: list[T], s: P2PSpec) -> list[T]:
    f.send(dys[0], s.peer, grad_tag(s.tag, s.seq))
    return []  # a receive has no input to differentiate


#: kind -> rule(ops, output gradients, forward spec) -> input gradients. ``send``'s output is the
#: token (its gradient is ignored); ``recv``'s the received tensor.
P2P_GRADIENTS: dict[str, Callable[[P2POps[Any], list[Any], P2PSpec], list[Any]]] = {
    "send": _send_grad,
    "recv": _recv_grad,
}
