"""The public API on numpy arrays: ``ringflow.allreduce`` and the rest of ``ringflow.NAME``.

``import ringflow`` loads this module on the first use of one of these names
(ringflow/__init__.py), so that the processes that import the package for something else --
``ringflow-run`` and its remote bootstrap, the supervisors -- load neither numpy nor the engine;
``ringflow.NAME`` is the object defined or imported here. Every collective has an ``_async`` form
returning a :class:`Handle`; the plain form waits for it.

Where things are: the job's lifecycle in :mod:`.runtime`, process sets in :mod:`.process_sets`,
the table of collectives in :mod:`.collectives`, turning a call into a request in
:mod:`.submission`; this module holds the public functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .compression import Compression, Compressor
from .config import Config
from .errors import RingflowError
from .handles import Handle
from .negotiation import Request
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
    set_id,
)
from .runtime import (
    cross_rank,
    cross_size,
    get_client,
    is_initialized,
    local_rank,
    local_size,
    rank,
    running,
    shutdown,
    size,
    start_timeline,
    stats,
    stop_timeline,
)
from .single_process import single_process_scope  # Jittor's (DESIGN.md section 10)
from .submission import GroupHandle, call_site, name_of, scales, submit, submit_fields, submit_group
from .submission import joined as _count_names_afresh


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None,
         **kwargs: Any) -> None:
    """Join the job that started this process (:func:`ringflow.runtime.init` has the details:
    the launchers, ``comm``, and the keyword arguments ``rank``, ``size``, ``init_method``,
    ``local_rank``, ``local_size``, ``store``), then add ``process_sets`` (collectively, in the
    order given; Horovod's ``hvd.init(process_sets=...)``).

    Raises:
        ConfigError: a RINGFLOW_* variable, the launcher environment or an argument is invalid,
            or a variable says the job has several processes and none is joined.
        PeerError / RingflowTimeoutError: the other ranks could not be reached within timeout_s.
    """
    from . import runtime

    runtime.init(comm, **kwargs)
    for ps in process_sets or ():
        add_process_set(ps)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Config",
    "Handle",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RingflowError",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "cross_rank",
    "cross_size",
    "gather",
    "gather_async",
    "get_client",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "reduce",
    "reduce_async",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "scatter",
    "scatter_async",
    "shutdown",
    "single_process_scope",
    "size",
    "start_timeline",
    "stats",
    "stop_timeline",
    "synchronize",
]
# point to point (ringflow.p2p)
__all__ += ["irecv", "isend", "recv", "send"]


# collectives -------------------------------------------------------------------------------------
def allreduce_async(tensor: Any, name: str | None = None, op: ReduceOp | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    compression: Compressor = Compression.none, out: Any = None) -> Handle:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op: Average)."""
    fields = scales(op, prescale_factor, postscale_factor)
    fields["compression"] = compression.name
    return submit_fields("allreduce", tensor, name, process_set, out, fields)


def allreduce(tensor: Any, name: str | None = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set,
              compression: Compressor = Compression.none, out: Any = None) -> np.ndarray:
    """:func:`allreduce_async`, waited for: the reduced array."""
    # Spelled out rather than (*args, **kwargs): the path of every small allreduce.
    return allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set,
                           compression, out).wait()


def grouped_allreduce_async(tensors: Sequence[Any], name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: Compressor = Compression.none,
                            outs: Sequence[Any] | None = None) -> GroupHandle:
    """Allreduce a list of tensors negotiated together and fused into as few buffers as fit."""
    return submit_group("allreduce", tensors, name, process_set, outs,
                         compression=compression.name,
                         **scales(op, prescale_factor, postscale_factor))


def grouped_allreduce(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_allreduce_async(tensors, *args, **kwargs).wait()


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ)."""
    if np.ndim(tensor) == 0:
        tensor = np.reshape(tensor, (1,))
    return submit("allgather", tensor, name, process_set)


def allgather(tensor: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    return allgather_async(tensor, *args, **kwargs).wait()


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    return submit_group("allgather", [np.reshape(t, (1,)) if np.ndim(t) == 0 else t
                                       for t in tensors], name, process_set)


def grouped_allgather(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_allgather_async(tensors, *args, **kwargs).wait()


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, out: Any = None) -> Handle:
    """Every rank of ``process_set`` receives ``root_rank``'s tensor.

    ``root_rank`` is a global rank, as in Horovod 0.28 and torch.distributed; it must be a member
    of ``process_set`` (otherwise the broadcast fails on every member).
    """
    return submit("broadcast", tensor, name, process_set, out=out, root=int(root_rank))


def broadcast(tensor: Any, root_rank: int, *args: Any, **kwargs: Any) -> np.ndarray:
    return broadcast_async(tensor, root_rank, *args, **kwargs).wait()


def alltoall_async(tensor: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Send ``splits[d]`` rows to rank ``d``; the result is (rows received, splits received).

    Without ``splits`` every rank gets an equal share of the rows; a first dimension that is not
    a multiple of the set's size fails the operation on every rank (Horovod's rule).
    """
    n = process_set.size()
    rows = int(np.shape(tensor)[0]) if np.ndim(tensor) else 0
    error = ""
    if splits is None:
        name = name_of("alltoall", name, set_id(process_set))
        if rows % n:
            error = (f"alltoall of {name!r}: splits not provided, but the first dimension of "
                     f"the tensor ({rows}) is not an even multiple of the number of ranks ({n}) "
                     "of the process set; pass splits= (rows per rank) to send unequal parts")
        splits = [rows // n] * n
    return submit("alltoall", tensor, name, process_set, error=error,
                  splits=tuple(int(s) for s in np.asarray(splits).reshape(-1)))


def alltoall(tensor: Any, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    return alltoall_async(tensor, *args, **kwargs).wait()


def reducescatter_async(tensor: Any, name: str | None = None, op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        compression: Compressor = Compression.none) -> Handle:
    """Reduce, then give each rank its share of rows (lower ranks take the remainder)."""
    return submit("reducescatter", tensor, name, process_set, compression=compression.name,
                   **scales(op, prescale_factor, postscale_factor))


def reducescatter(tensor: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    return reducescatter_async(tensor, *args, **kwargs).wait()


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                compression: Compressor = Compression.none) -> GroupHandle:
    return submit_group("reducescatter", tensors, name, process_set,
                         compression=compression.name,
                         **scales(op, prescale_factor, postscale_factor))


def grouped_reducescatter(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_reducescatter_async(tensors, *args, **kwargs).wait()


def reduce_async(tensor: Any, root_rank: int, op: ReduceOp | None = None,
                 name: str | None = None, process_set: ProcessSet = global_process_set,
                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 compression: Compressor = Compression.none) -> Handle:
    """Reduce ``tensor`` over ``process_set`` onto ``root_rank`` (a global rank; default op
    Average). The handle's result is the reduction on the root and None elsewhere; its bits
    equal those of an allreduce of the same tensors."""
    return submit("reduce", tensor, name, process_set, root=int(root_rank),
                  compression=compression.name,
                  **scales(op, prescale_factor, postscale_factor))


def reduce(tensor: Any, root_rank: int, *args: Any, **kwargs: Any) -> np.ndarray | None:
    return reduce_async(tensor, root_rank, *args, **kwargs).wait()


def gather_async(tensor: Any, root_rank: int, name: str | None = None,
                 process_set: ProcessSet = global_process_set) -> Handle:
    """Concatenate every rank's ``tensor`` along the first dimension (lengths may differ) on
    ``root_rank`` (a global rank); the result is None on the other ranks."""
    if np.ndim(tensor) == 0:
        tensor = np.reshape(tensor, (1,))
    return submit("gather", tensor, name, process_set, root=int(root_rank))


def gather(tensor: Any, root_rank: int, *args: Any, **kwargs: Any) -> np.ndarray | None:
    return gather_async(tensor, root_rank, *args, **kwargs).wait()


def scatter_async(tensors: Sequence[Any] | None, root_rank: int, name: str | None = None,
                  process_set: ProcessSet = global_process_set) -> Handle:
    """``root_rank`` (a global rank) passes one array per rank of ``process_set``, in set rank
    order (same dtype and trailing dimensions; first dimensions may differ); every rank gets
    its piece. ``tensors`` is ignored elsewhere (None is fine)."""
    root = int(root_rank)
    if rank() != root:
        return submit("scatter", np.empty(0, np.uint8), name, process_set, root=root)
    pieces, error = _pieces(tensors, process_set.size())
    joined = np.concatenate(pieces) if not error else np.empty(0, np.uint8)
    return submit("scatter", joined, name, process_set, root=root, error=error,
                  splits=tuple(int(p.shape[0]) for p in pieces) if not error else ())


def scatter(tensors: Sequence[Any] | None, root_rank: int, *args: Any,
            **kwargs: Any) -> np.ndarray:
    return scatter_async(tensors, root_rank, *args, **kwargs).wait()


def _pieces(tensors: Sequence[Any] | None, n: int) -> tuple[list[np.ndarray], str]:
    """The root's pieces for scatter, or why they cannot be scattered."""
    try:
        pieces = [np.asarray(t) for t in tensors or ()]
    except (TypeError, ValueError, RuntimeError) as exc:
        return [], (f"scatter: the root's arrays must be host (numpy) arrays; a device array "
                    f"is not scattered yet ({exc})")
    pieces = [p.reshape(1) if p.ndim == 0 else p for p in pieces]
    if len(pieces) != n:
        return [], (f"scatter: the root passed {len(pieces)} arrays for a process set of {n} "
                    "ranks; pass one array per rank, in rank order")
    kinds = {(p.dtype, p.shape[1:]) for p in pieces}
    if len(kinds) > 1:
        return [], ("scatter: the root's arrays must share their dtype and all but the first "
                    f"dimension, got {sorted((str(d), s) for d, s in kinds)}")
    return pieces, ""


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    ps = set_id(process_set)
    running().enqueue(Request(name_of("barrier", None, ps), "barrier", process_set=ps,
                              site=call_site(2))).wait()


def join() -> int:
    """Stop contributing data: until every rank has joined, this rank's engine takes part in
    other ranks' allreduces with zeros (their other collectives but barrier fail, as in
    Horovod). Returns the last rank to join.
    Unnamed operations are counted afresh after it on every rank (``submission.joined``).
    """
    last = int(running().enqueue(Request("join", "join", site=call_site(2))).wait())
    _count_names_afresh()
    return last


def poll(handle: Handle) -> bool:
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    return handle.wait()


# point to point (ringflow.p2p) -------------------------------------------------------------------
def isend(array: Any, dst: int, tag: int = 0) -> Handle:
    """Start sending ``array`` to rank ``dst``: only this rank and ``dst`` take part (no
    coordinator, no other rank). Messages of one (source, tag) are received in the order they
    were sent; ``tag`` is any int.

    The handle completes once ``dst`` has received the whole array (MPI's synchronous mode), or
    fails with what ``dst`` reports: a receive whose size or dtype disagrees (the same
    MismatchError text on both ranks), or a peer that failed. An array ringflow cannot send
    (its dtype) fails the handle and ``dst``'s matching receive alike.

    Raises:
        TensorError: ``dst`` is not another rank of the job, or ``tag`` is not an int.
        HorovodInternalError: the job has failed or was shut down.
    """
    from .submission import start_send

    return start_send(array, dst, tag)


def send(array: Any, dst: int, tag: int = 0) -> None:
    """Send ``array`` to rank ``dst`` and return once ``dst`` has received it; an exchange in
    which both ranks send first needs :func:`isend`. Errors as :func:`isend`'s."""
    isend(array, dst, tag).wait()


def irecv(src: int, tag: int = 0, out: np.ndarray | None = None,
          shape: Sequence[int] | None = None, dtype: Any = None) -> Handle:
    """Start receiving the next message of rank ``src`` sent with ``tag``; the handle's result is
    the array: ``out`` itself when given, else a new array of ``shape`` (default: the sender's)
    and the sender's dtype. A message sent before the receive is posted waits for it.

    ``out`` / ``shape`` must hold exactly as many elements as were sent, and ``out``'s dtype or
    ``dtype`` must be the one sent; otherwise the receive and the send fail with one
    MismatchError text, the message is dropped, and the next receive takes the next message.

    Raises:
        TensorError: ``src`` is not another rank of the job, ``tag`` is not an int, or ``out`` /
            ``shape`` / ``dtype`` are not usable (or disagree with each other).
        HorovodInternalError: the job has failed or was shut down.
    """
    from .submission import start_recv

    return start_recv(src, tag, out, shape, dtype)


def recv(src: int, tag: int = 0, out: np.ndarray | None = None,
         shape: Sequence[int] | None = None, dtype: Any = None) -> np.ndarray:
    """Receive the next message of rank ``src`` sent with ``tag`` (see :func:`irecv`)."""
    return irecv(src, tag, out, shape, dtype).wait()  # type: ignore[no-any-return]
