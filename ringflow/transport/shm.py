"""Shared-memory allreduce for the ranks of one host (and hierarchical allreduce across hosts).

Every local rank owns one data segment and one flag word in ``/dev/shm``, created with mode 0600
and **unlinked as soon as every rank has mapped it**, so nothing is left behind even when a rank is
killed (the kernel frees the memory with the last mapping). The data segment holds two halves;
successive allreduces alternate between them.

Allreduce of ``B`` bytes on ``n`` local ranks (rank ``r`` owns share ``r`` of ``even_split``):

1. copy every share of the input but share ``r`` into this rank's current half (skipped when the
   engine packed the input there); this rank reads its own share from the input itself;
2. barrier: every input is in place;
3. reduce share ``r`` of all ``n`` inputs, in rank order 0..n-1, into share ``r`` of this rank's
   half (16-bit floats accumulate in float32, scaled integers in float64); scale once; block by
   block, each reduced block is also copied to the output while it is in cache;
4. barrier: every share is reduced;
5. copy share ``k`` of rank ``k``'s half into the output, for every ``k != r``.

Per rank that is a copy of ``(n-1)/n B``, one reduce pass reading ``B`` and writing ``2B/n``,
and a copy of ``(n-1)/n B``: 4 passes over ``B`` at 2 ranks (64 MiB, each rank, both at once:
copy in 2.8 ms, reduce 9, copy out 2.8, with the workers' glibc streaming large copies past the
cache, :data:`ringflow.runner.launch.MEMCPY_TUNABLE`; 5, 10.5 and 5 ms without it), where copying
the whole input in and the whole result out took 5.5 (28 ms). No byte goes through a socket.
Because each element is reduced by one rank in a fixed order that does not depend on where it
sits in the buffer, results are bitwise identical on every rank and across fusion layouts. A
half is rewritten two operations later, after every rank has passed the next operation's first
barrier, so no rank can overwrite data another is still reading.

Hierarchical (several hosts with ``L`` ranks each): step 3 reduces share ``r`` of this host only
(no scaling), then the ``L`` shares travel in parallel, each over its own TCP ring between the
ranks of local rank ``r`` on every host, which also applies the scale; the result is written back
into share ``r`` before barrier 4. Each host thus sends ``2 (H-1)/H * B`` bytes across its link in
total -- the host-level ring bound -- instead of the rank-level ``2 (N-1)/N * B`` per rank.

Barriers: each rank bumps its flag word to the operation's epoch and waits until every flag has
reached it, polling (with ``sched_yield``) for up to 200 us, then sleeping progressively longer.
Every few milliseconds the wait checks the TCP transport for a failed peer and the deadline
(``timeout_s``), so a dead or frozen rank ends the wait with the same errors as on the TCP path.
Every size takes this path: even at 4 KiB two flag barriers beat the TCP ring's socket exchanges
and thread hand-offs (engine path, 2 / 4 ranks, two runs each: 0.50-0.85 / 1.3-1.6 ms against
0.87-1.12 / 2.5-2.8 ms over TCP). Allreduces of at most ``negotiation.EAGER_BYTES`` that the
response cache knows never get here: the coordinator reduces them (see :mod:`ringflow.engine`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import algorithms
from ..algorithms.buffers import even_split
from ..algorithms.local import reduce_parts
from ..errors import ConfigError, RingflowTimeoutError
from ..ops import ReduceOp, check_dtype

__all__ = ["ShmAllreduce", "ShmTransport", "create"]

_SHM_DIR = "/dev/shm"
_FLAG_BYTES = 64  # one cache line per flag word: no false sharing between ranks
_ALIGN = 4096
# A barrier polls without sleeping for this long before it naps: the shortest sleep on this
# machine lasts ~80 us (timer slack), longer than a typical wait for a peer.
_SPIN_S = 200e-6


def available() -> bool:
    return os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


class _Mapping:
    """A file in /dev/shm mapped into memory; the owner creates it, peers open it."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a view is still alive; the GC will unmap it
            self.map.close()


class ShmAllreduce:
    """The shared segments of the ``size`` local ranks; see the module docstring."""

    def __init__(
        self, rank: int, size: int, store: Any, prefix: str, timeout: float,
        check_peers: Callable[[], None],
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._check_peers = check_peers
        self.cross: Any = None  # a Transport over the same local rank of every host, if several
        self._store = store
        self._key = f"{prefix}shm/"
        if rank == 0:
            store.set(self._key + "name", f"rf{os.getpid()}_{secrets.token_hex(4)}".encode())
        self._name = store.get(self._key + "name", timeout).decode()
        self._epoch = 0
        self._half = 0
        self._gen = 0
        self._capacity = 0  # bytes per half
        self._segs: list[_Mapping] = []
        self._words: list[np.ndarray] | None = None
        flag = _Mapping(self._path("f", rank), _FLAG_BYTES, create=True)
        self._flags = self._attach("f", _FLAG_BYTES, flag)
        self._words = [np.frombuffer(f.map, dtype=np.int64, count=1) for f in self._flags]

    def _path(self, kind: str, rank: int) -> str:
        return f"{_SHM_DIR}/{self._name}_{kind}{self._gen}_{rank}"

    def _sync(self, step: str) -> None:
        """Wait for every local rank to reach ``step``: through the store until the flag words
        exist, through the flags after."""
        if self._words is None:
            self._store.set(f"{self._key}{step}/{self.rank}", b"1")
            self._store.wait([f"{self._key}{step}/{r}" for r in range(self.size)], self.timeout)
        else:
            self.barrier()

    def _attach(self, kind: str, size: int, mine: _Mapping) -> list[_Mapping]:
        """Map every rank's segment (``mine`` is this rank's), then unlink this rank's file."""
        try:
            self._sync(f"{kind}{self._gen}/created")
            maps = [mine if r == self.rank else _Mapping(self._path(kind, r), size, create=False)
                    for r in range(self.size)]
            self._sync(f"{kind}{self._gen}/attached")
        finally:
            os.unlink(self._path(kind, self.rank))  # mapped memory lives on; the name must not
        return maps

    def barrier(self) -> None:
        self._epoch += 1
        self._words[self.rank][0] = self._epoch
        epoch = self._epoch
        words = self._words or []
        if all(w[0] >= epoch for w in words):
            return
        start = time.monotonic()
        check = start
        nap = 0.0
        while True:
            if all(w[0] >= epoch for w in words):
                return
            now = time.monotonic()
            if now - start < _SPIN_S:
                os.sched_yield()  # releases the GIL; gives the core away if anyone else needs it
                continue
            time.sleep(nap)
            nap = min(nap * 2 or 1e-6, 1e-3)
            if now - check > 0.005:
                check = now
                self._check_peers()
                if now - start > self.timeout:
                    late = [r for r, w in enumerate(words) if w[0] < epoch]
                    raise RingflowTimeoutError(
                        f"local ranks {late} did not reach the shared-memory barrier within "
                        f"{self.timeout} s; they may be frozen (RINGFLOW_TIMEOUT_S sets the limit)"
                    )

    def _ensure(self, nbytes: int) -> None:
        """Grow every rank's segment to two halves of ``nbytes`` (all ranks decide alike)."""
        if nbytes <= self._capacity:
            return
        capacity = max(-(-nbytes // _ALIGN) * _ALIGN, 2 * self._capacity)
        for seg in self._segs:
            seg.close()
        self._gen += 1
        mine = _Mapping(self._path("d", self.rank), 2 * capacity, create=True)
        self._segs = self._attach("d", 2 * capacity, mine)
        self._capacity = capacity

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray:
        """Where the next :meth:`allreduce` expects this rank's input (packing here saves a
        copy)."""
        self._ensure(max(n * dtype.itemsize, 1))
        base = self._half * self._capacity
        return self._segs[self.rank].array[base:base + n * dtype.itemsize].view(dtype)

    def allreduce(self, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` and ``out`` are 1-D of one dtype and length."""
        dtype = check_dtype(src.dtype, "allreduce buffer")
        n = src.size
        if n == 0:
            return
        mine = self.input_view(n, dtype)
        bounds = even_split(n, self.size)
        lo, hi = bounds[self.rank]
        halves = [s.array[self._half * self._capacity:][: n * dtype.itemsize].view(dtype)
                  for s in self._segs]
        parts = list(halves)
        if not np.shares_memory(mine, src):
            # The peers read every share of this rank's input but its own: copy only those.
            # This rank reads its own share straight from src.
            for k, (a, b) in enumerate(bounds):
                if k != self.rank and b > a:
                    np.copyto(mine[a:b], src[a:b])
            parts[self.rank] = src
        self._half ^= 1
        self.barrier()
        share = halves[self.rank]  # the peers copy this rank's reduced share from here
        mirrored = False
        if self.cross is None:
            # The result goes to out as well while each block is in cache (unless out is the
            # segment itself), so the copy-out below skips this rank's share.
            mirrored = out.ctypes.data != mine.ctypes.data
            reduce_parts(parts, lo, hi, share, op, postscale, out if mirrored else None)
        else:
            # This host's partial result, unscaled; the ring across hosts scales it once.
            local = ReduceOp.SUM if op == ReduceOp.AVERAGE else op
            reduce_parts(parts, lo, hi, share, local, 1.0)
            total = self.size * self.cross.size
            factor = postscale / total if op == ReduceOp.AVERAGE else postscale
            algorithms.allreduce(self.cross, share[lo:hi], local, factor)
        self.barrier()
        in_place = out.ctypes.data == mine.ctypes.data  # this rank's share is already there
        for k, (a, b) in enumerate(bounds):
            if b > a and not (k == self.rank and (in_place or mirrored)):
                np.copyto(out[a:b], halves[k][a:b])

    def close(self) -> None:
        for seg in self._segs + self._flags:
            seg.close()
        self._segs = []


class ShmTransport:
    """The TCP transport plus a shared-memory :meth:`allreduce` for same-host jobs."""

    def __init__(self, tcp: Any, shm: ShmAllreduce) -> None:
        self.tcp = tcp
        self.shm = shm
        self.rank = tcp.rank
        self.size = tcp.size

    def __getattr__(self, name: str) -> Any:  # isend, irecv, send_ctrl, set_ctrl_handler, ...
        return getattr(self.tcp, name)

    def close(self, linger: float = 2.0) -> None:
        self.shm.close()
        self.tcp.close(linger)


def create(rank: int, size: int, store: Any, config: Any, prefix: str = "",
           secret: bytes | None = None, local_size: int | None = None) -> ShmTransport:
    """TCP between all ranks, plus shared memory among the ``local_size`` ranks of each host.

    Ranks must be assigned host by host (``rank = host * local_size + local_rank``, as
    ringflow-run, mpirun and srun do by default) with the same number of ranks on every host.
    """
    from . import Subset, tcp

    local_size = size if local_size is None else local_size
    if local_size < 1 or size % local_size:
        raise ConfigError(
            f"shared memory needs the same number of ranks on every host; {size} ranks with "
            f"{local_size} on this host do not divide evenly; set RINGFLOW_TRANSPORT=tcp"
        )
    host, local_rank = divmod(rank, local_size)
    link = tcp.create(rank, size, store, config, prefix, secret)
    # Barriers wait for this host's ranks only: another host's rank that finished and left is
    # not a reason to fail them.
    local = range(host * local_size, (host + 1) * local_size)
    shm = ShmAllreduce(local_rank, local_size, store, f"{prefix}host{host}/",
                       float(config.timeout_s), lambda: link.check_peers(local))
    if size > local_size:
        shm.cross = Subset(link, list(range(local_rank, size, local_size)))
    return ShmTransport(link, shm)
