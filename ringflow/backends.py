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

These four take CPU buffers. Device buffers (:mod:`ringflow.devices`) go to:

* :class:`Nccl` -- CUDA buffers of NCCL's dtypes and ops, every collective
  (:mod:`ringflow.algorithms.device`), when every rank of the job can run one NCCL provider
  (each publishes what it has at :func:`connect`, so that all choose alike): cupy's binding,
  else torch's ProcessGroupNCCL; one communicator per process set, made at its first device
  item, unless its ranks share a GPU;
* :class:`HostStaging` -- any other non-CPU allreduce: the fused buffer is copied to host memory
  (one copy, with its library's own copy; straight into shared memory where that implementation
  offers a view), reduced by the implementation a CPU buffer of that item would get, and copied
  back. Other collectives are staged tensor by tensor (the executor).

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
from .ops import ReduceOp
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
    """The job's NCCL communicators, one per process set, through the provider every rank has
    (:mod:`ringflow.algorithms.nccl`: cupy's binding, else torch's ProcessGroupNCCL).

    A set's communicator is made at its first device item, which every member reaches in plan
    order. First every member publishes the UUID of the GPU it drives: NCCL refuses two ranks on
    one device (and the job used to die of it with "internal error in the engine"), so a set
    whose members share a GPU stages its device tensors through host memory instead, with one
    warning naming the ranks; every member reads the same UUIDs, so all choose alike.
    """

    name = "nccl"

    def __init__(self, provider: str, store: Any, prefix: str, timeout: float,
                 check: Any) -> None:
        self.provider, self.store, self.prefix, self.timeout = provider, store, prefix, timeout
        self._check = check  # (global ranks) -> raises the job's error, if any
        self._comms: dict[tuple[int, ...], Any] = {}

    def comm(self, link: Link, ns: Any, like: Any) -> Any:
        """The communicator of ``link``'s ranks on ``like``'s device, or None: stage."""
        ranks = tuple(link.members) if isinstance(link, Subset) else tuple(range(link.size))
        if ranks in self._comms:
            return self._comms[ranks]
        device = int(ns.device(like).partition(":")[2] or 0)
        key = f"{self.prefix}nccl/{'-'.join(map(str, ranks))}/"
        self.store.set(f"{key}gpu/{link.rank}", device_uuid(self.provider, device))
        uuids = [self.store.get(f"{key}gpu/{r}", self.timeout) for r in range(link.size)]
        shared = sorted({tuple(ranks[r] for r, u in enumerate(uuids) if u == uuid)
                         for uuid in uuids if uuids.count(uuid) > 1})
        if shared:
            if link.rank == 0 or len(ranks) == 1:
                log.warning(
                    "ranks %s share a GPU; NCCL cannot run two ranks on one device, so the "
                    "CUDA tensors of process set %s are staged through host memory (give each "
                    "rank its own GPU, e.g. torch.cuda.set_device(local_rank), for NCCL)",
                    " and ".join(map(str, shared[0])) if len(shared) == 1 else shared, ranks)
            self._comms[ranks] = None
            return None
        others = [r for r in ranks if r != ranks[link.rank]]
        comm = self._comms[ranks] = _PROVIDERS[self.provider](
            link.rank, link.size, self.store, key, device, self.timeout,
            lambda: self._check(others))
        return comm

    def close(self) -> None:
        for comm in self._comms.values():
            if comm is not None:
                comm.close()
        self._comms.clear()


def _cupy_comm(*args: Any) -> Any:
    from .algorithms.nccl import CupyNccl

    return CupyNccl(*args)


def _torch_comm(*args: Any) -> Any:
    from .algorithms.nccl_torch import TorchNccl

    return TorchNccl(*args)


#: NCCL providers in order of preference, and why each cannot run in this process ("" if it
#: can). torch is asked only when already imported (a torch user has imported it by then).
_PROVIDERS = {"cupy": _cupy_comm, "torch": _torch_comm}


def nccl_providers() -> dict[str, str]:
    """Each provider and why it cannot run here ("" where it can)."""
    import sys

    from .algorithms import nccl

    why = {"cupy": nccl.unusable_reason()}
    if sys.modules.get("torch") is not None:  # None: the import was halted on purpose
        from .algorithms import nccl_torch

        why["torch"] = nccl_torch.unusable_reason()
    else:
        why["torch"] = "torch is not imported"
    return why


def device_uuid(provider: str, device: int) -> bytes:
    """What names GPU ``device`` uniquely across the job's hosts."""
    if provider == "cupy":
        import cupy

        uuid = cupy.cuda.runtime.getDeviceProperties(device).get("uuid")
    else:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid:
        return uuid if isinstance(uuid, bytes) else str(uuid).encode()
    import socket

    return f"{socket.gethostname()}/{device}".encode()


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
    #: NCCL for device arrays, when every rank can run it (else they are staged)
    nccl: Nccl | None = None
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

    def device_comm(self, link: Link, ns: Any, like: Any) -> Any:
        """The NCCL communicator of ``link``'s ranks for ``like``'s device, or None (stage)."""
        if self.nccl is None or not ns.device(like).startswith("cuda"):
            return None
        return self.nccl.comm(link, ns, like)

    def close(self, linger: float = 2.0) -> None:
        if self.nccl is not None:
            self.nccl.close()
        if self.lane is not None:
            self.lane.close()
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
    """Give the job NCCL when every rank can run one provider (each publishes what it has, so
    that all choose alike: one rank on NCCL and another staging would wait for each other)."""
    backends.timeout_s = float(config.timeout_s)
    why = nccl_providers()
    mine = [p for p, reason in why.items() if not reason]
    if info.size == 1:
        if mine:
            from .rendezvous import MemoryStore

            store = MemoryStore()  # a job of one rank still gets its communicator of one
    elif store is None:  # init(comm=...): every rank of the job takes this path alike
        mine = []
    else:
        store.set(f"{prefix}nccl/providers/{info.rank}", ",".join(mine).encode())
        every = [store.get(f"{prefix}nccl/providers/{r}").decode().split(",")
                 for r in range(info.size)]
        mine = [p for p in mine if all(p in theirs for theirs in every)]
    if not mine:
        log.debug("CUDA buffers are staged through host memory: %s",
                  "; ".join(f"{p}: {w or 'not on every rank'}" for p, w in why.items()))
        return backends
    backends.nccl = Nccl(mine[0], store, prefix, float(config.timeout_s),
                         backends.transport.check_peers)
    return backends


def shared_memory(rank: int, size: int, store: Any, config: Any, prefix: str = "",
                  local_size: int | None = None, hostname: str = "") -> Backends:
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
    link = transport.create("tcp", rank, size, store, config, prefix, hostname=hostname)
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
        return shared_memory(info.rank, info.size, store, config, prefix, local, info.hostname)
    # The TCP transport names each peer's host in its errors: the name the launcher gave it.
    named = {"hostname": info.hostname} if name == "tcp" else {}
    return _over(transport.create(name, info.rank, info.size, store, config, prefix=prefix,
                                  **named))
