"""ringflow: distributed data-parallel training for PyTorch and TensorFlow, in pure Python.

This module is the framework-neutral API on numpy arrays; ``ringflow.torch`` and
``ringflow.tensorflow`` wrap it with Horovod's names. Every collective has an ``_async`` form
returning a :class:`Handle`; the plain form waits for it. ``import ringflow`` imports no
framework, no mpi4py and no cupy.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import ops as _ops
from .client import Client, local_client
from .compression import Compression, Compressor
from .config import Config
from .errors import AdasumError, ConfigError, NotInitializedError, RingflowError, TensorError
from .handles import Handle
from .negotiation import Request
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .runner.pyrun import launcher, run

__version__ = "0.1.0"

__all__ = [
    "Adasum", "Average", "Compression", "Config", "Handle", "Max", "Min", "ProcessSet", "Product",
    "ReduceOp", "RingflowError", "Sum", "__version__", "add_process_set", "allgather",
    "allgather_async", "allreduce", "allreduce_async", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_async", "cross_rank", "cross_size", "get_client", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_initialized", "join",
    "launcher", "local_rank", "local_size", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "run", "shutdown", "size", "start_timeline", "stats", "stop_timeline",
    "synchronize",
]

log = logging.getLogger(__name__)


class ProcessSet:
    """A subset of ranks with its own collectives (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = 0 if ranks is None else None

    def _members(self) -> list[int]:
        return list(range(size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not a member."""
        members = self._members()
        return members.index(rank()) if rank() in members else -1

    def included(self) -> bool:
        return rank() in self._members()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()

_state_lock = threading.Lock()
_engine: Any = None
_info: Any = None
_client: Any = None
_generation = itertools.count()
_counters: dict[str, itertools.count] = {}


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None, *,
         rank: int | None = None, size: int | None = None, init_method: str | None = None,
         local_rank: int | None = None, local_size: int | None = None) -> None:
    """Join the job that started this process: ringflow-run, mpirun, srun, torchrun, torch's
    env:// contract, a process where torch.distributed is initialised, ... (the detectors and
    where each finds its peers: ringflow.topology and ringflow.bootstrap).

    Calling it again while initialized does nothing. ``process_sets`` are added (collectively)
    right after. ``comm``, an mpi4py intracommunicator, makes the job of just its ranks
    (Horovod's ``hvd.init(comm=...)``): every rank of ``comm`` must call ``init(comm=comm)``;
    ranks, local and cross values come from the communicator, and the transport is ``mpi`` over
    a private duplicate of it unless RINGFLOW_TRANSPORT names another one.

    For processes a script starts itself (torch.distributed's and MegEngine's style): ``rank``
    and ``size`` (both, or neither) with ``init_method`` ``"env://"`` (MASTER_ADDR and
    MASTER_PORT; the default), ``"tcp://HOST:PORT"`` (rank 0's host and a free port there) or
    ``"file:///PATH"`` (a fresh directory every rank sees). ``local_rank``/``local_size``
    default to what the ranks' host names say.

    Raises:
        ConfigError: a RINGFLOW_* variable, the launcher environment or an argument is invalid,
            or a variable says the job has several processes and none is joined.
        PeerError / RingflowTimeoutError: the other ranks could not be reached within timeout_s.
    """
    global _engine, _info, _client
    from . import topology
    from .backends import connect
    from .engine import Engine

    with _state_lock:
        if _engine is not None:
            return
        config = Config.from_env()
        logging.getLogger("ringflow").setLevel(config.log_level.upper())
        if comm is not None:
            from .bootstrap import comm_info

            info = comm_info(comm)
        elif rank is not None or size is not None:
            info = topology.explicit(rank, size, local_rank, local_size)
            init_method = init_method or "env://"
        else:
            if init_method or local_rank is not None or local_size is not None:
                raise ConfigError("init(init_method=..., local_rank=..., local_size=...) needs "
                                  "rank= and size= too")
            info = topology.detect()
        generation = next(_generation)
        prefix, store = f"init{generation}/", None
        if info.size == 1 and not info.placed:
            info = topology.place(info, [info.hostname])
        elif info.size > 1:
            from .bootstrap import connect_store

            store = connect_store(info, config.timeout_s, comm=comm, init_method=init_method)
            if not info.placed:
                store.set(f"{prefix}host/{info.rank}", info.hostname.encode())
                info = topology.place(info, [store.get(f"{prefix}host/{r}").decode()
                                             for r in range(info.size)])
        if config.bind_to == "core":
            cpus = topology.bind_to_cores(info)
            logging.getLogger("ringflow").info("rank %d bound to CPUs %s", info.rank, cpus)
        backends = connect(info, store, config, prefix, comm=comm)
        _info = info
        _client = Client(store) if store is not None else local_client(config.timeout_s)
        _engine = Engine(info.rank, info.size, backends, config)
        _counters.clear()
    for ps in process_sets or ():
        add_process_set(ps)


def get_client() -> Client:
    """The job's key-value client (MegEngine's ``dist.get_client()``): ``user_set(key, value)``
    and ``user_get(key, timeout=None)`` on the store every rank reached at ``init()``."""
    _need()
    return _client


def shutdown() -> None:
    """Stop the engine; pending operations fail with ShutdownError. Safe to call twice."""
    global _engine
    with _state_lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.shutdown()


atexit.register(shutdown)


def is_initialized() -> bool:
    return _engine is not None


def _need() -> Any:
    if _engine is None:
        raise NotInitializedError("ringflow has not been initialized; call ringflow.init() first")
    return _engine


def rank() -> int:
    _need()
    return int(_info.rank)


def size() -> int:
    _need()
    return int(_info.size)


def local_rank() -> int:
    _need()
    return int(_info.local_rank)


def local_size() -> int:
    _need()
    return int(_info.local_size)


def cross_rank() -> int:
    _need()
    return int(_info.cross_rank)


def cross_size() -> int:
    _need()
    return int(_info.cross_size)


def stats() -> dict[str, int]:
    """Engine counters (collectives run, tensors, cache hits, negotiations, ...), for tests."""
    engine = _need()
    out = dict(engine.stats)
    if engine.coordinator is not None:
        out.update(engine.coordinator.stats)
    out["cached_names"] = len(engine.cache.key_of)
    return out


# building requests ---------------------------------------------------------------------------
def _set_id(process_set: ProcessSet) -> int:
    if process_set.process_set_id is None:
        raise TensorError(f"{process_set} has not been added; call add_process_set() first")
    return process_set.process_set_id


def _name(op: str, name: str | None, ps: int) -> str:
    if name:
        return str(name)
    counter = _counters.setdefault(f"{op}/{ps}", itertools.count())
    return f"{op}.noname.{next(counter)}"


def _check(array: Any, what: str) -> tuple[np.ndarray | None, str]:
    """The array as a C-contiguous numpy array, or None and the reason it cannot be used."""
    try:
        arr = np.asarray(array)  # ascontiguousarray would turn a 0-d array into shape (1,)
        if not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        _ops.check_dtype(arr.dtype, what)
    except (RingflowError, TypeError, ValueError) as exc:
        return None, str(exc)
    return arr, ""


def _check_op(op: str, arr: np.ndarray, name: str, members: list[int],
              fields: dict[str, Any]) -> str:
    """Why ``op`` cannot run on ``arr`` with these arguments ("" if it can).

    Checked here, before submission, so that the failure reaches every rank as a failed request;
    found by the collective on the engine thread instead, it would end the whole job.
    """
    n = len(members)
    if op in ("allreduce", "reducescatter") and arr.dtype == np.bool_ and (
        fields["reduce_op"] == ReduceOp.AVERAGE or fields["prescale"] != 1.0
        or fields["postscale"] != 1.0
    ):
        return (f"tensor {name!r} has dtype bool, which cannot be averaged or scaled; use Sum "
                "(logical or), Min, Max or Product (logical and), or cast to a numeric dtype")
    if op == "allreduce" and fields["reduce_op"] == ReduceOp.ADASUM and arr.dtype.kind != "f":
        return (f"allreduce of {name!r} with op Adasum needs a floating-point tensor, got "
                f"{arr.dtype}; use Sum or Average for integer and bool tensors")
    if op == "reducescatter" and fields["reduce_op"] == ReduceOp.ADASUM:
        return (f"reducescatter of {name!r}: Reducescatter currently only supports AVERAGE and "
                "SUM (Horovod's text); Adasum is an allreduce op")
    if op in ("reducescatter", "alltoall") and arr.ndim == 0:
        return f"{op} of {name!r} splits the first dimension and needs at least 1 dimension"
    if op == "broadcast" and fields["root"] not in members:
        if members == list(range(size())):
            return (f"broadcast of {name!r}: root rank {fields['root']} is outside 0..{n - 1} "
                    "(the ranks of the job)")
        return (f"broadcast of {name!r}: root rank {fields['root']} is not a member of the "
                f"process set {members}; root_rank is a global rank (as in Horovod and "
                "torch.distributed)")
    if op == "alltoall":
        splits = fields["splits"]
        if len(splits) != n or min(splits, default=0) < 0 or sum(splits) != arr.shape[0]:
            return (f"alltoall of {name!r}: splits {list(splits)} must be {n} non-negative row "
                    f"counts (one per rank of the process set) adding up to the first "
                    f"dimension, {arr.shape[0]}")
    return ""


def _request(op: str, array: Any, name: str, process_set: ProcessSet, out: Any = None,
             **fields: Any) -> tuple[Request, np.ndarray | None, Any]:
    """The request for ``array`` (carrying the reason if it cannot take part), input, output."""
    arr, error = _check(array, f"tensor {name!r}")
    if out is not None and not error and (
        not isinstance(out, np.ndarray) or not out.flags.c_contiguous or out.shape != arr.shape
    ):
        error = f"the output for {name!r} must be a C-contiguous array of shape {arr.shape}"
    if not error:
        error = _check_op(op, arr, name, process_set._members(), fields)
    request = Request(
        name=name, op=op, dtype="" if arr is None else _ops.dtype_name(arr.dtype),
        shape=() if arr is None else tuple(arr.shape), process_set=process_set.process_set_id,
        error=error, **fields,
    )
    return request, arr, out


def _member_set(op: str, name: str | None, process_set: ProcessSet, fields: dict) -> int:
    ps = _set_id(process_set)
    n = process_set.size()
    if op.endswith("allreduce") and fields.get("reduce_op") == ReduceOp.ADASUM and n & (n - 1):
        # Every member knows the size, so every member raises here alike and nobody waits.
        raise AdasumError(f"Running Adasum with non-power of 2 ranks is not supported yet "
                          f"({op} {name or '(unnamed)'} on {n} ranks)")
    if not process_set.included():
        # Only this rank knows: the members never submit this name, so it is refused here
        # rather than sent to the coordinator, where it would wait for them forever.
        raise TensorError(f"{op} {name or '(unnamed)'}: rank {rank()} is not a member of "
                          f"{process_set}; call it only where process_set.included() is true")
    return ps


def _submit(op: str, array: Any, name: str | None, process_set: ProcessSet, out: Any = None,
            **fields: Any) -> Handle:
    engine = _need()
    ps = _member_set(op, name, process_set, fields)
    return engine.enqueue(*_request(op, array, _name(op, name, ps), process_set, out, **fields))


def _submit_group(op: str, arrays: Sequence[Any], name: str | None, process_set: ProcessSet,
                  outs: Sequence[Any] | None = None, **fields: Any) -> _GroupHandle:
    """Submit ``arrays`` as one group: negotiated together, and refused together at the call."""
    engine = _need()
    ps = _member_set(f"grouped_{op}", name, process_set, fields)
    base = _name(f"grouped_{op}", name, ps)
    items = [_request(op, a, f"{base}.{i}", process_set, None if outs is None else outs[i],
                      group=base, group_size=len(arrays), **fields)
             for i, a in enumerate(arrays)]
    return _GroupHandle(base, engine.enqueue_many(items))


def _scales(op: ReduceOp | int | None, prescale: float, postscale: float) -> dict[str, Any]:
    op = ReduceOp.AVERAGE if op is None else ReduceOp(op)
    return {"reduce_op": int(op), "prescale": float(prescale), "postscale": float(postscale)}


# collectives -------------------------------------------------------------------------------------
def allreduce_async(tensor: Any, name: str | None = None, op: ReduceOp | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set,
                    compression: Compressor = Compression.none, out: Any = None) -> Handle:
    """Reduce ``tensor`` over the ranks of ``process_set`` (default op: Average)."""
    return _submit("allreduce", tensor, name, process_set, out=out,
                   compression=compression.name, **_scales(op, prescale_factor, postscale_factor))


def allreduce(tensor: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    return allreduce_async(tensor, *args, **kwargs).wait()


def grouped_allreduce_async(tensors: Sequence[Any], name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: Compressor = Compression.none,
                            outs: Sequence[Any] | None = None) -> _GroupHandle:
    """Allreduce a list of tensors negotiated together and fused into as few buffers as fit."""
    return _submit_group("allreduce", tensors, name, process_set, outs,
                         compression=compression.name,
                         **_scales(op, prescale_factor, postscale_factor))


def grouped_allreduce(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_allreduce_async(tensors, *args, **kwargs).wait()


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ)."""
    if np.ndim(tensor) == 0:
        tensor = np.reshape(tensor, (1,))
    return _submit("allgather", tensor, name, process_set)


def allgather(tensor: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    return allgather_async(tensor, *args, **kwargs).wait()


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> _GroupHandle:
    return _submit_group("allgather", [np.reshape(t, (1,)) if np.ndim(t) == 0 else t
                                       for t in tensors], name, process_set)


def grouped_allgather(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_allgather_async(tensors, *args, **kwargs).wait()


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, out: Any = None) -> Handle:
    """Every rank of ``process_set`` receives ``root_rank``'s tensor.

    ``root_rank`` is a global rank, as in Horovod 0.28 and torch.distributed; it must be a member
    of ``process_set`` (otherwise the broadcast fails on every member).
    """
    return _submit("broadcast", tensor, name, process_set, out=out, root=int(root_rank))


def broadcast(tensor: Any, root_rank: int, *args: Any, **kwargs: Any) -> np.ndarray:
    return broadcast_async(tensor, root_rank, *args, **kwargs).wait()


def alltoall_async(tensor: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Send ``splits[d]`` rows to rank ``d``; the result is (rows received, splits received).

    Without ``splits`` the first dimension is divided as evenly as possible, lower ranks first.
    """
    n = process_set.size()
    rows = int(np.shape(tensor)[0]) if np.ndim(tensor) else 0
    if splits is None:
        splits = [rows // n + (1 if d < rows % n else 0) for d in range(n)]
    return _submit("alltoall", tensor, name, process_set,
                   splits=tuple(int(s) for s in np.asarray(splits).reshape(-1)))


def alltoall(tensor: Any, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    return alltoall_async(tensor, *args, **kwargs).wait()


def reducescatter_async(tensor: Any, name: str | None = None, op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        compression: Compressor = Compression.none) -> Handle:
    """Reduce, then give each rank its share of rows (lower ranks take the remainder)."""
    return _submit("reducescatter", tensor, name, process_set, compression=compression.name,
                   **_scales(op, prescale_factor, postscale_factor))


def reducescatter(tensor: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    return reducescatter_async(tensor, *args, **kwargs).wait()


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                compression: Compressor = Compression.none) -> _GroupHandle:
    return _submit_group("reducescatter", tensors, name, process_set,
                         compression=compression.name,
                         **_scales(op, prescale_factor, postscale_factor))


def grouped_reducescatter(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return grouped_reducescatter_async(tensors, *args, **kwargs).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    ps = _set_id(process_set)
    _need().enqueue(Request(_name("barrier", None, ps), "barrier", process_set=ps)).wait()


def join() -> int:
    """Stop contributing data: until every rank has joined, this rank's engine takes part in
    other ranks' allreduces with zeros (allgathers with no rows). Returns the last rank to join.
    """
    return int(_need().enqueue(Request("join", "join")).wait())


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call this with the same ranks, in the same order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or ps.process_set_id is not None:
        raise TensorError(f"{ps} is already registered")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad or len(set(ps.ranks)) != len(ps.ranks) or not ps.ranks:
        raise TensorError(f"process set ranks {ps.ranks} must be distinct ranks of 0..{size() - 1}")
    ranks = tuple(ps.ranks)
    name = f"add_process_set.{','.join(map(str, ranks))}"
    ps.process_set_id = int(_need().enqueue(Request(name, "add_process_set", shape=ranks)).wait())
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collectively); its pending operations fail."""
    if process_set.process_set_id in (None, 0):
        return False
    set_id = _set_id(process_set)
    _need().enqueue(Request(f"remove_process_set.{set_id}", "remove_process_set",
                            root=set_id)).wait()
    process_set.process_set_id = None
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome-trace timeline of this rank's operations to ``file_path`` (rank 0) or
    ``file_path`` with ``.rank<r>`` before the suffix (other ranks). ``mark_cycles`` is accepted
    for Horovod compatibility; ringflow has no cycles to mark (negotiation is event-driven)."""
    _need().timeline(str(file_path))


def stop_timeline() -> None:
    """Stop writing the timeline started by :func:`start_timeline` or RINGFLOW_TIMELINE_PATH."""
    _need().timeline(None)


def poll(handle: Handle) -> bool:
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    return handle.wait()


class _GroupHandle(Handle):
    """A handle over several handles; its result is the list of their results."""

    def __init__(self, name: str, handles: list[Handle]) -> None:
        super().__init__(name)
        self.handles = handles

    def poll(self) -> bool:
        return all(h.poll() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            return [h.wait() for h in self.handles]
        deadline = time.monotonic() + timeout  # one deadline for the group, not one per tensor
        return [h.wait(max(0.0, deadline - time.monotonic())) for h in self.handles]

    result = wait

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(group_handle)`` once every tensor of the group is done."""
        left = [len(self.handles)]
        lock = threading.Lock()

        def one(_: Handle) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        if not self.handles:
            fn(self)
        for h in self.handles:
            h.add_done_callback(one)
