"""Shared-memory allreduce for the ranks of one host: :class:`ShmAllreduce`.

Every local rank owns one flag line in ``/dev/shm`` and, on the copy path, one data segment,
created with mode 0600 and **unlinked as soon as every rank has mapped them** (the kernel frees
the memory with the last mapping). The data segment holds two halves; successive allreduces
alternate between them.

**Space.** Each segment's memory is reserved when it is created (``posix_fallocate``): a file of
``/dev/shm`` that is only truncated to its size gets its pages when they are first written, and
a tmpfs that is full then (Docker's default ``/dev/shm`` is 64 MiB) kills the writer with
SIGBUS. Every rank publishes whether its reservation succeeded (through the store for the flag
lines, through the flag lines for the data segments) before any rank maps a peer's segment, so a
shortfall is one :class:`~ringflow.errors.SharedMemoryError` on every local rank, with the same
text: the size needed, what ``/dev/shm`` had free, and the fixes (a larger ``/dev/shm``, or
``RINGFLOW_TRANSPORT=tcp``). Growing closes the old segments and waits for every rank to have
done so before reserving the new ones, so the old and new never need room together.

**Names left behind.** A rank killed between creating its segment and unlinking it (after
every rank has mapped it) leaves the name. The survivors unlink every rank's names of a growth
that failed, and of the current and next generation when they close; under ``ringflow-run`` the
names start with ``rfj<job id>_`` and each worker's supervisor removes the job's names that are
left when its worker exits (:mod:`ringflow.runner.supervisor`), which covers the ranks that
were killed too.

Allreduce of ``B`` bytes on ``n`` local ranks (rank ``r`` owns share ``r`` of ``even_split``)
takes one of two paths, the same on every rank, chosen when the job starts.

**Single copy** (when every rank may read every other's memory with ``process_vm_readv``: the
same user, and no ptrace restriction such as Yama's ``ptrace_scope`` 1 or a seccomp filter; each
rank probes each peer at setup and the ranks agree through the store; and when the local ranks
do not outnumber the CPUs they may run on, the union of their affinities):

1. publish the addresses of the input and the output in this rank's flag line; barrier;
2. reduce share ``r`` in rank order 0..n-1 into the output, block by block: each peer's block is
   read from its input into a cache-sized scratch block, then combined;
3. barrier: every share is reduced, in its rank's output;
4. read share ``k`` of rank ``k``'s output straight into this rank's output, for every ``k != r``;
5. barrier: no peer reads this rank's memory any more, so the caller may reuse it.

Per rank that is one read of ``(n-1)/n B`` from the peers, one reduce pass over ``B/n`` (in place
when the op is in place), and one read of ``(n-1)/n B``: at 2 ranks, 64 MiB, 7 ms for steps 1-2
and 4.6 ms for step 4 (each rank, both at once), against 14.6 ms for the copy path below.

**Copy** (otherwise):

1. copy every share of the input but share ``r`` into this rank's current half (skipped when the
   engine packed the input there); this rank reads its own share from the input itself;
2. barrier: every input is in place;
3. reduce share ``r`` of all ``n`` inputs, in rank order, into share ``r`` of this rank's half;
   block by block, each reduced block is also copied to the output while it is in cache;
4. barrier: every share is reduced;
5. copy share ``k`` of rank ``k``'s half into the output, for every ``k != r``.

Per rank that is a copy of ``(n-1)/n B``, one reduce pass reading ``B`` and writing ``2B/n``,
and a copy of ``(n-1)/n B``: 4 passes over ``B`` at 2 ranks (64 MiB, each rank, both at once:
copy in 2.8 ms, reduce 9, copy out 2.8, with the workers' glibc streaming large copies past the
cache, :data:`ringflow.runner.launch.MEMCPY_TUNABLE`; 5, 10.5 and 5 ms without it), where copying
the whole input in and the whole result out took 5.5 (28 ms). A half is rewritten two
operations later, after every rank has passed the next operation's first barrier, so no rank can
overwrite data another is still reading.

Both paths reduce with :func:`~ringflow.algorithms.local.reduce_parts` (16-bit floats accumulate
in float32, integers in their dtype, wrapping as on the ring, and are scaled in float64; scaled
once). No byte goes through a socket. Because each element is reduced by one rank in a fixed
order that does not depend on where it sits in the buffer, results are bitwise identical on every
rank, across fusion layouts, and between paths.

Across hosts (:mod:`.hierarchical`): :meth:`ShmAllreduce.allreduce` takes an ``across`` step
that runs on this rank's reduced share between the two barriers of either path, so a ring
between hosts can finish the reduction in place before any rank copies it out.

Barriers: each rank bumps its flag word to the operation's epoch and waits until every flag has
reached it, polling (with ``sched_yield``) for up to 200 us, then sleeping progressively longer
(:func:`ringflow.polling.polls`). Every few milliseconds the wait checks the transport
(``check_peers``) for a failed peer among the ranks not there yet (one that arrived may have
finished and shut down since), and again at the deadline (``timeout_s``) before it times out, so
a dead or frozen rank ends the wait with the same errors as on the TCP path.
Every size takes these paths: even at 4 KiB two flag barriers beat the TCP ring's socket exchanges
and thread hand-offs (engine path, 2 / 4 ranks, two runs each: 0.50-0.85 / 1.3-1.6 ms against
0.87-1.12 / 2.5-2.8 ms over TCP). Allreduces of at most ``collectives.EAGER_BYTES`` that the
response cache knows never get here: the coordinator reduces them (see :mod:`ringflow.engine`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import injection
from ..collectives import EAGER_BYTES
from ..errors import PeerError, RingflowTimeoutError, SharedMemoryError
from ..lane import LINE as _LINE
from ..lane import Lane
from ..ops import ReduceOp, check_dtype
from ..polling import polls
from .buffers import chunk_elems, chunk_ranges, even_split
from .local import reduce_parts

__all__ = ["JOB_PREFIX", "ShmAllreduce", "available", "job_names"]

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
#: Names of a ``ringflow-run`` job start with this and its job id (RINGFLOW_JOB_ID), then ``_``;
#: the supervisor (which imports nothing of ringflow) spells it out too.
JOB_PREFIX = "rfj"
_FLAG_BYTES = 64  # one cache line of flag words per rank: no false sharing between ranks
# The words of a rank's flag line: barrier epoch, pid, the line's own address in that process
# (what a peer reads to check that it may read this process's memory), the addresses of the
# current single-copy allreduce's input and output, and the outcome of the last growth: its
# generation (or minus the errno of a failed reservation) and /dev/shm's free and total bytes
# when it failed.
_EPOCH, _PID, _SELF, _SRC, _OUT, _GROWN, _FREE, _TOTAL = range(8)
_ALIGN = 4096
# A barrier polls without sleeping for this long before it naps: the shortest sleep on this
# machine lasts ~80 us (timer slack), longer than a typical wait for a peer.
_SPIN_S = 200e-6


def available() -> bool:
    return os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


def job_names(job: str) -> list[str]:
    """The paths in /dev/shm of the ringflow-run job ``job`` (its RINGFLOW_JOB_ID)."""
    start = f"{JOB_PREFIX}{job}_"
    try:
        return [f"{_SHM_DIR}/{f}" for f in os.listdir(_SHM_DIR) if f.startswith(start)]
    except OSError:
        return []


def _space() -> tuple[int, int]:
    """(free, total) bytes of /dev/shm."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]


def _cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: a cpuset, taskset or ``--bind-to core``)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _read_from(pid: int, addr: int, dst: np.ndarray) -> int:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into ``dst`` (C-contiguous);
    the number copied, or ``-errno``."""
    if _readv is None:
        return -38  # ENOSYS
    local = _Iovec(dst.ctypes.data, dst.nbytes)
    remote = _Iovec(addr, dst.nbytes)
    got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


class _Mapping:
    """A file in /dev/shm mapped into memory; the owner creates it, peers open it."""

    def __init__(self, path: str, size: int, create: bool, keep_fd: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self.fd = -1  # kept open (for flock) only when asked
        try:
            if create:
                try:
                    # Reserve the pages now: touching a page that a full tmpfs cannot back
                    # later is a SIGBUS, not an error.
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.unlink(path)
                    raise
            self.map = mmap.mmap(fd, size)
        finally:
            if keep_fd:
                self.fd = fd
            else:
                os.close(fd)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # a view is still alive; the GC will unmap it
            self.map.close()


class ShmAllreduce:
    """The shared segments of the ``size`` local ranks; see the module docstring."""

    def __init__(
        self, rank: int, size: int, store: Any, prefix: str, timeout: float,
        check_peers: Callable[[list[int]], None], job: str = "",
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._check_peers = check_peers
        self._store = store
        self._key = f"{prefix}shm/"
        if rank == 0:
            # Under ringflow-run the job id names the segments, so that what a killed job left
            # can be found (the supervisor removes it); else this process's pid.
            owner = f"{JOB_PREFIX}{job}" if job else f"rf{os.getpid()}"
            store.set(self._key + "name", f"{owner}_{secrets.token_hex(4)}".encode())
        self._name = store.get(self._key + "name", timeout).decode()
        self._epoch = 0
        self._half = 0
        self._gen = 0
        self._capacity = 0  # bytes per half
        self._segs: list[_Mapping] = []
        self._flags: list[_Mapping] = []
        self._lane: list[_Mapping] = []
        self._words: list[np.ndarray] | None = None
        self._flags = self._attach("f", _FLAG_BYTES, _FLAG_BYTES)
        self._words = [np.frombuffer(f.map, dtype=np.int64) for f in self._flags]
        self._scratch = np.empty(0, np.uint8)
        self._packed = np.empty(0, np.uint8)
        self.single_copy = self._agree_on_single_copy()

    def _agree_on_single_copy(self) -> bool:
        """Whether every local rank may read every other's memory (``process_vm_readv``: same
        user, and no ptrace restriction such as Yama's scope 1 or a seccomp filter), and the
        local ranks do not outnumber the CPUs they may run on together."""
        mine = self._words[self.rank]
        mine[_PID] = os.getpid()
        mine[_SELF] = mine.ctypes.data
        self.barrier()
        probe = np.zeros(1, np.int64)
        ok = True
        for k, line in enumerate(self._words):
            if k != self.rank:
                got = _read_from(int(line[_PID]), int(line[_SELF]) + 8 * _PID, probe)
                if got != 8 or probe[0] != line[_PID]:
                    log.debug("local rank %d cannot read local rank %d's memory (%d)",
                              self.rank, k, got)
                    ok = False
        # Ranks that outnumber the CPUs they may run on (the union of their affinities) time-share
        # them, and then the copy path measured faster (4 ranks on 2 CPUs, 64 MiB: 35-39 ms
        # against 43-45 ms single copy; 2 ranks on 2 CPUs: 15-16 ms against 12-13).
        cpus = ",".join(map(str, sorted(_cpus()))) if ok else "-"
        self._store.set(f"{self._key}direct/{self.rank}", cpus.encode())
        keys = [f"{self._key}direct/{r}" for r in range(self.size)]
        self._store.wait(keys, self.timeout)
        union: set[bytes] = set()
        for key in keys:
            value = self._store.get(key, self.timeout)
            if value == b"-":
                return False
            union.update(value.split(b","))
        return len(union) >= self.size

    def _path(self, kind: str, rank: int) -> str:
        return f"{_SHM_DIR}/{self._name}_{kind}{self._gen}_{rank}"

    def _attach(self, kind: str, size: int, nbytes: int, lock: bool = False) -> list[_Mapping]:
        """Create this rank's segment of ``size`` bytes (its memory reserved) for an allreduce of
        ``nbytes``, agree with every local rank that all reservations succeeded, map every
        rank's segment, then unlink this rank's name. With ``lock``, the mapping of local rank
        0's segment keeps its file open (every rank's own open file: :mod:`ringflow.lane` locks it
        with ``flock``).

        Raises:
            SharedMemoryError: some rank could not reserve its segment (on every local rank,
                with the same text).
        """
        gen = self._gen
        mine: _Mapping | None = None
        status = (gen, 0, 0)
        try:
            try:
                mine = _Mapping(self._path(kind, self.rank), size, create=True)
            except OSError as exc:
                status = (-(exc.errno or 1), *_space())
            if injection.ARMED and kind == "d":
                injection.hit("shm_growth", size)  # this rank's new name exists, none is mapped
            outcomes = self._agree(f"{kind}{gen}/created", status)
            failed = [r for r, (got, _, _) in enumerate(outcomes) if got != gen]
            if failed:
                if mine is not None:
                    mine.close()
                raise self._shortfall(failed, outcomes, size, nbytes)
            if lock and self.rank == 0 and mine is not None:
                mine.fd = os.open(self._path(kind, 0), os.O_RDWR)
            maps = [mine if r == self.rank else
                    _Mapping(self._path(kind, r), size, create=False, keep_fd=lock and r == 0)
                    for r in range(self.size)]
            self._agree(f"{kind}{gen}/attached", None)
        except BaseException:
            # A peer may have died between creating its segment and unlinking it.
            for r in range(self.size):
                _unlink(self._path(kind, r))
            raise
        finally:
            _unlink(self._path(kind, self.rank))  # mapped memory lives on; the name must not
        return maps

    def _agree(self, step: str, status: tuple[int, int, int] | None) -> list[tuple[int, int, int]]:
        """Wait for every local rank to reach ``step``, each publishing ``status``: through the
        store until the flag words exist, through the flags after. Every rank's status."""
        if self._words is None:
            text = ",".join(map(str, status or (0, 0, 0))).encode()
            keys = [f"{self._key}{step}/{r}" for r in range(self.size)]
            self._store.set(keys[self.rank], text)
            self._store.wait(keys, self.timeout)
            return [tuple(map(int, self._store.get(k, self.timeout).split(b",")))  # type: ignore[misc]
                    for k in keys]
        if status is not None:
            self._words[self.rank][_GROWN:_TOTAL + 1] = status
        self.barrier()
        return [(int(w[_GROWN]), int(w[_FREE]), int(w[_TOTAL])) for w in self._words]

    def _shortfall(self, failed: list[int], outcomes: list[tuple[int, int, int]], size: int,
                   nbytes: int) -> SharedMemoryError:
        """The error every local rank raises: made of what the first failing rank published."""
        first = failed[0]
        errno, free, total = outcomes[first]
        what = (f"an allreduce of {_mib(nbytes)}" if nbytes > _FLAG_BYTES
                else "their flag lines")
        return SharedMemoryError(
            f"shared memory in {_SHM_DIR} is too small: local rank {first} could not reserve "
            f"{_mib(size)} ({os.strerror(-errno)}); the {self.size} ranks on this host need "
            f"{_mib(self.size * size)} for {what}, and {_SHM_DIR} had {_mib(free)} free of "
            f"{_mib(total)}. Give {_SHM_DIR} more room (docker run --shm-size=1g, or a larger "
            f"tmpfs), or run without shared memory: RINGFLOW_TRANSPORT=tcp "
            f"(ringflow-run --transport tcp)")

    def barrier(self) -> None:
        self._epoch += 1
        self._words[self.rank][_EPOCH] = self._epoch
        epoch = self._epoch
        words = self._words or []
        if all(w[_EPOCH] >= epoch for w in words):
            return
        late: list[int] = []
        check = time.monotonic()  # peers are checked every 5 ms, the first time 5 ms from now
        # Spinning, os.sched_yield releases the GIL and gives the core away if anyone else
        # needs it; then naps from 1 us, doubling up to 1 ms.
        for now in polls(self.timeout, 1e-6, 1e-3, spin=_SPIN_S):
            late = [r for r, w in enumerate(words) if w[_EPOCH] < epoch]
            if not late:
                return
            if now - check > 0.005:
                check = now
                # Only the late ranks: one that reached the barrier may have finished its last
                # operation and shut down meanwhile, which is no failure of this one.
                self._check_peers(late)
        self._check_peers(late)  # a failed peer rather than the timeout, as at every check
        raise RingflowTimeoutError(
            f"local ranks {late} did not reach the shared-memory barrier within "
            f"{self.timeout} s; they may be frozen (RINGFLOW_TIMEOUT_S sets the limit)")

    def _ensure(self, nbytes: int) -> None:
        """Grow every rank's segment to two halves of ``nbytes`` (all ranks decide alike)."""
        if nbytes <= self._capacity:
            return
        capacity = max(-(-nbytes // _ALIGN) * _ALIGN, 2 * self._capacity)
        if self._segs:
            for seg in self._segs:
                seg.close()
            self._segs, self._capacity = [], 0
            self.barrier()  # every rank has unmapped the old segments: their memory is free
        self._gen += 1
        self._segs = self._attach("d", 2 * capacity, nbytes)
        self._capacity = capacity

    def input_view(self, n: int, dtype: np.dtype) -> np.ndarray:
        """Where the next :meth:`allreduce` expects this rank's input (packing here saves a
        copy). Single copy: a buffer of this process, grown here alone, since the ranks of one
        operation need not all pack (a rank that joined packs zeros, the others may not)."""
        if self.single_copy:
            if self._packed.nbytes < n * dtype.itemsize:
                self._packed = np.empty(n * dtype.itemsize, np.uint8)
            return self._packed[:n * dtype.itemsize].view(dtype)
        self._ensure(max(n * dtype.itemsize, 1))
        base = self._half * self._capacity
        return self._segs[self.rank].array[base:base + n * dtype.itemsize].view(dtype)

    def allreduce(self, src: np.ndarray, out: np.ndarray, op: ReduceOp, postscale: float = 1.0,
                  across: Callable[[np.ndarray], None] | None = None) -> None:
        """``out = reduce(src over the local ranks)``; ``src`` and ``out`` are 1-D of one dtype
        and length. ``across``, if given, finishes this rank's reduced share in place (another
        host's ranks, :mod:`.hierarchical`) before any rank reads it."""
        check_dtype(src.dtype, "allreduce buffer")
        if src.size == 0:
            return
        if self.single_copy:
            self._allreduce_direct(src, out, op, postscale, across)
        else:
            self._allreduce_copy(src, out, op, postscale, across)

    def _allreduce_direct(self, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                          postscale: float, across: Callable[[np.ndarray], None] | None) -> None:
        """Single copy: each rank reads the peers' inputs and results in their own memory."""
        result = out
        src = np.ascontiguousarray(src)
        if not out.flags.c_contiguous:
            out = np.empty_like(src)
        n, item = src.size, src.dtype.itemsize
        bounds = even_split(n, self.size)
        lo, hi = bounds[self.rank]
        mine = self._words[self.rank]
        mine[_SRC], mine[_OUT] = src.ctypes.data, out.ctypes.data
        self.barrier()  # every input is ready and its address published
        lines = [(int(w[_PID]), int(w[_SRC]), int(w[_OUT])) for w in self._words]
        per = chunk_elems(item)
        if self._scratch.nbytes < self.size * per * item:
            self._scratch = np.empty(self.size * per * item, np.uint8)
        scratch = self._scratch.view(src.dtype)
        for a, b in chunk_ranges(lo, hi, per):
            parts = [src[a:b] if k == self.rank else
                     self._read(k, pid, addr + a * item, scratch[k * per:k * per + b - a])
                     for k, (pid, addr, _) in enumerate(lines)]
            reduce_parts(parts, 0, b - a, out[a:b], op, postscale)
        if across is not None:
            across(out[lo:hi])
        if injection.ARMED:
            injection.hit("data_mid", src.nbytes)
        self.barrier()  # every share is reduced, in its rank's output
        for k, ((pid, _, addr), (a, b)) in enumerate(zip(lines, bounds, strict=True)):
            if k != self.rank and b > a:
                self._read(k, pid, addr + a * item, out[a:b])
        self.barrier()  # no peer reads this rank's memory any more
        if result is not out:
            np.copyto(result, out)

    def _read(self, k: int, pid: int, addr: int, dst: np.ndarray) -> np.ndarray:
        got = _read_from(pid, addr, dst)
        if got == dst.nbytes:
            return dst
        # A peer that died: give the transport a moment to report it the way every rank will.
        deadline = time.monotonic() + min(self.timeout, 2.0)
        while time.monotonic() < deadline:
            self._check_peers([k])
            time.sleep(0.01)
        raise PeerError(f"could not read local rank {k}'s memory (process {pid}): "
                        f"{os.strerror(-got) if got < 0 else f'{got} of {dst.nbytes} bytes'}")

    def _allreduce_copy(self, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                        postscale: float, across: Callable[[np.ndarray], None] | None) -> None:
        """Through this rank's segment: see the module docstring."""
        dtype = src.dtype
        n = src.size
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
        # On a single host the result goes to out as well while each block is in cache (unless
        # out is the segment itself), so the copy-out below skips this rank's share.
        mirrored = across is None and out.ctypes.data != mine.ctypes.data
        reduce_parts(parts, lo, hi, share, op, postscale, out if mirrored else None)
        if across is not None:
            across(share[lo:hi])
        if injection.ARMED:
            injection.hit("data_mid", src.nbytes)
        self.barrier()
        in_place = out.ctypes.data == mine.ctypes.data  # this rank's share is already there
        for k, (a, b) in enumerate(bounds):
            if b > a and not (k == self.rank and (in_place or mirrored)):
                np.copyto(out[a:b], halves[k][a:b])

    def open_lane(self) -> Lane:
        """The small-operation lane of these ranks (:mod:`ringflow.lane`): one header line and
        ``EAGER_BYTES`` of data per rank, beside the flag lines. Every local rank calls it."""
        self._lane = self._attach("l", _LINE + EAGER_BYTES, _LINE + EAGER_BYTES, lock=True)
        return Lane(self.rank, self._lane, self._lane[0].fd)

    def close(self) -> None:
        """Unmap every segment (the lane's :meth:`~ringflow.lane.Lane.close` first: a view
        still alive keeps its mapping, and the descriptor Python's mmap holds, until the
        garbage collector frees the view) and remove what a killed rank left."""
        self._words = None
        for seg in self._segs + self._flags + self._lane:
            seg.close()
        self._segs, self._flags, self._lane = [], [], []
        # Names a rank killed while creating its segments left (no-ops otherwise).
        for r in range(self.size):
            for kind in ("f0", "l0", f"d{self._gen}", f"d{self._gen + 1}"):
                _unlink(f"{_SHM_DIR}/{self._name}_{kind}_{r}")
