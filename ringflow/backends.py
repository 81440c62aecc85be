"""The transport a job runs on, and the ordered allreduce implementations over it.

:func:`connect` chooses alike on every rank, from what they all publish in the store:

* ``RINGFLOW_TRANSPORT=auto`` (the default): the ``mpi`` transport when the job was started by
  mpirun (detector ``openmpi`` or ``pmi``) and every rank can use mpi4py with
  ``MPI_THREAD_MULTIPLE`` (each rank publishes why it cannot, so that all choose alike); else
  TCP, with shared memory among the ranks of each host when ranks are numbered host by host with
  the same number (more than one) on every host;
* ``shm``: TCP plus shared memory (an error if the layout does not allow it); any other value
  names a registered transport (:func:`ringflow.transport.create`), used as is.

For every allreduce plan item the executor takes the first implementation in
:attr:`Backends.allreduce` whose ``enabled()`` accepts it (process set, dtype, op, device), as
Horovod's operation manager does:

1. :class:`SharedMemory` -- every rank on one host, global process set
   (:class:`~ringflow.algorithms.shm.ShmAllreduce`);
2. :class:`Hierarchical` -- shared memory within hosts, rings across them, global process set
   (:class:`~ringflow.algorithms.hierarchical.HierarchicalAllreduce`);
3. :class:`Native` -- the transport's own allreduce (MPI), global process set, for the dtypes
   and ops it has; scaled by :class:`~ringflow.algorithms.reduction.Reduction` afterwards;
4. :class:`Ring` -- any process set (:func:`~ringflow.algorithms.ring.allreduce`).

These four take CPU buffers. Device buffers (:mod:`ringflow.devices`; the executor fuses them on
their device) go to:

0. :class:`Nccl` -- first in the list: device kind ``cuda``, NCCL's dtypes and ops, when every
   rank of the job can run NCCL (each publishes why it cannot at :func:`connect`, so that all
   choose alike); one communicator per (process set, device), its unique id through the store;
5. :class:`HostStaging` -- any other non-CPU item: the buffer is copied to host memory (one copy
   of the fused buffer, with its library's own copy; straight into shared memory where that
   implementation offers a view), reduced by the implementation a CPU buffer of that item would
   get, and copied back.

An item that none accepts fails with a ShutdownError naming it. Adasum is an algorithm of its
own (``op=Adasum``), not one of these (on a device it is staged with the other collectives).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Protocol

import numpy as np

from . import devices, lane, transport
from .algorithms import ring
from .algorithms.hierarchical import HierarchicalAllreduce
from .algorithms.reduction import Reduction, scale_only
from .algorithms.shm import ShmAllreduce, available
from .devices.host import HOST
from .errors import ConfigError, ShutdownError
from .lane import Lane
from .ops import BFLOAT16, ReduceOp
from .transport.base import Link, NativeAllreduce, Subset, Transport, data_wait_s

__all__ = ["AllreduceImpl", "Backends", "Hierarchical", "HostStaging", "Native", "Nccl", "Ring",
           "SharedMemory", "connect", "shared_memory"]

log = logging.getLogger(__name__)


class AllreduceImpl(Protocol):
    """One way to run an allreduce plan item."""

    name: str

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        """Whether this implementation can reduce such a buffer."""

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray | None:
        """Where to pack ``n`` elements of input to save a copy, or None (any buffer)."""

    def allreduce(self, link: Link, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float) -> None:
        """``out = reduce(src)`` over ``link``'s ranks (1-D; ``src`` may be ``out``)."""


def _into(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` holding ``src``: the in-place implementations' input."""
    if src is not out:
        np.copyto(out, src)
    return out


class Nccl:
    """ncclAllReduce on CUDA buffers (:class:`~ringflow.algorithms.nccl.NcclComm`).

    The buffer may be a cupy array or a torch CUDA tensor (seen as cupy through DLPack, no copy).
    A communicator is made for each (process set, device) at its first item, which every member
    reaches in plan order; the engine thread then waits for the GPU by polling the operation's
    event (with NCCL's asynchronous error and the job's timeout), never in a blocking CUDA call.
    UNVERIFIED: nothing of it has run on a GPU yet (tests/gpu).
    """

    name = "nccl"

    def __init__(self, store: Any, prefix: str, timeout: float) -> None:
        self.store, self.prefix, self.timeout = store, prefix, timeout
        self._comms: dict[tuple[tuple[int, ...], int], Any] = {}

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        from .algorithms.nccl import NCCL_DTYPES, NCCL_OPS

        # bfloat16: NCCL has it, but cupy has no such dtype to view the buffer with (staged).
        return (device == "cuda" and dtype.name in NCCL_DTYPES and op in NCCL_OPS
                and dtype != BFLOAT16)

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray | None:
        return None

    def _comm(self, link: Link, device: int) -> Any:
        from .algorithms.nccl import NcclComm

        ranks = tuple(link.members) if isinstance(link, Subset) else tuple(range(link.size))
        comm = self._comms.get((ranks, device))
        if comm is None:
            key = "-".join(map(str, ranks))
            comm = self._comms[(ranks, device)] = NcclComm(
                link.rank, link.size, self.store, f"{self.prefix}nccl/{key}/d{device}/",
                device, self.timeout)
        return comm

    def allreduce(self, link: Link, src: Any, out: Any, op: ReduceOp,
                  postscale: float) -> None:
        import cupy

        buf = out if isinstance(out, cupy.ndarray) else cupy.from_dlpack(out)
        if src is not out:
            buf[...] = src if isinstance(src, cupy.ndarray) else cupy.from_dlpack(src)
        what = f"NCCL allreduce of {buf.size} x {buf.dtype}"
        self._comm(link, buf.device.id).allreduce(buf, op, postscale, what).wait()

    def close(self) -> None:
        for comm in self._comms.values():
            comm.close()
        self._comms.clear()


class HostStaging:
    """A device buffer reduced on the host by ``inner`` (a CPU implementation): one copy of the
    buffer to host memory, the CPU allreduce, one copy back (see the module doc)."""

    def __init__(self, inner: AllreduceImpl) -> None:
        self.inner = inner
        self.name = f"staging+{inner.name}"
        self._host: dict[str, np.ndarray] = {}

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        return device != "cpu"

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray | None:
        return None  # the executor packs on the device

    def allreduce(self, link: Link, src: Any, out: Any, op: ReduceOp,
                  postscale: float) -> None:
        ns = devices.namespace_of(out) or HOST
        dtype = ns.dtype(out)
        n = math.prod(out.shape)
        host = self.inner.input_view(n, dtype)  # shared memory: stage straight into it
        if host is None:
            buf = self._host.get(dtype.str)
            if buf is None or buf.size < n:
                buf = self._host[dtype.str] = ns.host_empty(max(n, 1), dtype, out)
            host = buf[:n]
        ns.to_host(src, host)
        self.inner.allreduce(link, host, host, op, postscale)
        ns.from_host(host, out)


class Ring:
    name = "ring"

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        return device == "cpu"

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray | None:
        return None

    def allreduce(self, link: Link, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float) -> None:
        ring.allreduce(link, out, op, postscale, src=src)  # the copy folded into the ring


class Native(Ring):
    """The transport's own allreduce (:class:`~ringflow.transport.base.NativeAllreduce`)."""

    name = "native"

    def __init__(self, link: NativeAllreduce) -> None:
        self.link = link

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        return process_set == 0 and device == "cpu" and self.link.native_supported(dtype, op)

    def allreduce(self, link: Link, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float) -> None:
        red = Reduction(out.dtype, op, postscale, link.size, "allreduce buffer")  # checks first
        flat = _into(src, out)
        self.link.native_allreduce(flat, op)
        scale_only(flat, red)


class SharedMemory:
    """Every rank of the job on this host."""

    name = "shm"

    def __init__(self, shm: ShmAllreduce) -> None:
        self.shm = shm

    def enabled(self, process_set: int, dtype: np.dtype, op: ReduceOp, device: str) -> bool:
        return process_set == 0 and device == "cpu"

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray | None:
        return self.shm.input_view(n, dtype)

    def allreduce(self, link: Link, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float) -> None:
        self.shm.allreduce(src, out, op, postscale)


class Hierarchical(SharedMemory):
    """Shared memory within hosts, rings across them."""

    name = "hierarchical"

    def __init__(self, shm: ShmAllreduce, cross: Link) -> None:
        super().__init__(shm)
        self.algorithm = HierarchicalAllreduce(shm, cross)

    def allreduce(self, link: Link, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float) -> None:
        self.algorithm.allreduce(src, out, op, postscale)


@dataclasses.dataclass
class Backends:
    """The job's transport, its allreduce implementations in order, and what they hold."""

    transport: Transport
    allreduce: tuple[AllreduceImpl, ...]
    shm: ShmAllreduce | None = None
    #: the same-host lane of small operations (every rank of the job on this host)
    lane: Lane | None = None
    #: how long the data plane waits for a device (RINGFLOW_TIMEOUT_S)
    timeout_s: float = 30.0
    _staged: dict[int, HostStaging] = dataclasses.field(default_factory=dict)

    def allreduce_for(self, process_set: int, dtype: np.dtype, op: ReduceOp,
                      device: str) -> AllreduceImpl:
        """The first enabled implementation; for a device buffer that none takes,
        :class:`HostStaging` around the implementation a CPU buffer would get.

        Raises:
            ShutdownError: none is (no implementation for that device, for example).
        """
        for impl in self.allreduce:
            if impl.enabled(process_set, dtype, op, device):
                return impl
        if device != "cpu":
            inner = self.allreduce_for(process_set, dtype, op, "cpu")
            staged = self._staged.get(id(inner))
            if staged is None:
                staged = self._staged[id(inner)] = HostStaging(inner)
            return staged
        raise ShutdownError(
            f"no allreduce implementation for {dtype} on device {device!r} in process set "
            f"{process_set} (have: {[i.name for i in self.allreduce]})")

    def close(self, linger: float = 2.0) -> None:
        for impl in self.allreduce:
            if isinstance(impl, Nccl):
                impl.close()
        if self.shm is not None:
            self.shm.close()
        self.transport.close(linger)


def _over(link: Transport, shm: ShmAllreduce | None = None,
          first: tuple[AllreduceImpl, ...] = ()) -> Backends:
    impls: list[AllreduceImpl] = list(first)
    if isinstance(link, NativeAllreduce):
        impls.append(Native(link))
    impls.append(Ring())
    return Backends(link, tuple(impls), shm)


def _with_nccl(backends: Backends, info: Any, store: Any, config: Any, prefix: str) -> Backends:
    """Put :class:`Nccl` first when every rank can run NCCL (each publishes why it cannot, so
    that all choose alike: one rank on NCCL and another staging would wait for each other)."""
    from .algorithms import nccl

    backends.timeout_s = float(config.timeout_s)
    why = nccl.unusable_reason()
    if info.size == 1:
        if not why:
            from .rendezvous import MemoryStore

            store = MemoryStore()  # a job of one rank still gets its communicator of one
    elif store is None:  # init(comm=...): every rank of the job takes this path alike
        why = "no rendezvous store to carry the NCCL id"
    else:
        store.set(f"{prefix}nccl/usable/{info.rank}", (why or "ok").encode())
        answers = [store.get(f"{prefix}nccl/usable/{r}").decode() for r in range(info.size)]
        why = next((f"rank {r}: {w}" for r, w in enumerate(answers) if w != "ok"), "")
    if why:
        log.debug("CUDA buffers are staged through host memory: %s", why)
        return backends
    backends.allreduce = (Nccl(store, prefix, float(config.timeout_s)), *backends.allreduce)
    return backends


def shared_memory(rank: int, size: int, store: Any, config: Any, prefix: str = "",
                  local_size: int | None = None) -> Backends:
    """TCP between all ranks, plus shared memory among the ``local_size`` ranks of each host.

    Ranks must be assigned host by host (``rank = host * local_size + local_rank``, as
    ringflow-run, mpirun and srun do by default) with the same number of ranks on every host.
    """
    local_size = size if local_size is None else local_size
    if local_size < 1 or size % local_size:
        raise ConfigError(
            f"shared memory needs the same number of ranks on every host; {size} ranks with "
            f"{local_size} on this host do not divide evenly; set RINGFLOW_TRANSPORT=tcp"
        )
    host, local_rank = divmod(rank, local_size)
    link = transport.create("tcp", rank, size, store, config, prefix)
    # Barriers wait for this host's ranks only: another host's rank that finished and left is
    # not a reason to fail them.
    local = range(host * local_size, (host + 1) * local_size)
    job = os.environ.get("RINGFLOW_JOB_ID", "")  # names the segments (ringflow-run's contract)
    shm = ShmAllreduce(local_rank, local_size, store, f"{prefix}host{host}/",
                       data_wait_s(float(config.timeout_s)),
                       lambda late: link.check_peers([local[r] for r in late]),
                       job=job if job.isalnum() else "")
    if size > local_size:
        cross = Subset(link, list(range(local_rank, size, local_size)))
        return _over(link, shm, (Hierarchical(shm, cross),))
    backends = _over(link, shm, (SharedMemory(shm),))
    if lane.TSO:
        backends.lane = shm.open_lane()
    return backends


def connect(info: Any, store: Any, config: Any, prefix: str, comm: Any = None) -> Backends:
    """The job's backends, chosen alike on every rank (see the module doc), NCCL included.

    Raises:
        ConfigError: the configured transport cannot be used here.
        PeerError / RingflowTimeoutError: the other ranks could not be reached in time.
    """
    return _with_nccl(_connect(info, store, config, prefix, comm), info, store, config, prefix)


def _connect(info: Any, store: Any, config: Any, prefix: str, comm: Any = None) -> Backends:
    """The transport and the CPU implementations.

    Raises:
        ConfigError: the configured transport cannot be used here.
        PeerError / RingflowTimeoutError: the other ranks could not be reached in time.
    """
    name = config.transport
    if info.size == 1:
        return _over(transport.create("tcp", 0, 1, None, config))
    if comm is not None and name in ("auto", "mpi"):
        return _over(transport.create("mpi", info.rank, info.size, None, config, comm=comm))
    if name == "auto" and info.detector in ("openmpi", "pmi"):
        from .transport import mpi

        store.set(f"{prefix}mpi/{info.rank}", (mpi.unusable_reason() or "ok").encode())
        why = [store.get(f"{prefix}mpi/{r}").decode() for r in range(info.size)]
        if all(w == "ok" for w in why):
            name = "mpi"
        else:
            log.info("not using the mpi transport: %s", next(w for w in why if w != "ok"))
    local = info.local_size
    if name == "auto":
        store.set(f"{prefix}layout/{info.rank}",
                  f"{info.cross_rank},{info.local_rank},{info.local_size}".encode())
        layout = [tuple(map(int, store.get(f"{prefix}layout/{r}").split(b",")))
                  for r in range(info.size)]
        local = layout[0][2]
        by_host = all(ls == local and r == cr * local + lr
                      for r, (cr, lr, ls) in enumerate(layout))
        name = "shm" if by_host and local > 1 and available() else "tcp"
    if name == "shm":
        return shared_memory(info.rank, info.size, store, config, prefix, local)
    return _over(transport.create(name, info.rank, info.size, store, config, prefix=prefix))
