"""The same-host lane: small cached allreduces without the coordinator, a socket or a thread.

When every rank of the job is on one host (the shared-memory transport), an allreduce of at most
``EAGER_BYTES`` whose request the response cache knows unchanged, submitted while this rank's
engine has nothing else in flight, is **posted** here instead of being sent to rank 0: the rank
copies its prescaled contribution (the wire dtype, as the eager path sends it) into its slot of
a shared segment and marks the slot POSTED with the name's cache bit. The rank whose post finds
every rank POSTED with the same bit **commits** them all at once. Every rank then reduces the
slots itself, in rank order with :func:`~ringflow.algorithms.local.reduce_parts`: the arithmetic
of the coordinator's eager path, so the bits are the same whichever path an operation took.
A 4 KiB allreduce at 2 ranks then costs the submitting thread's own work and a wait for the
other rank, with no thread wake-up and no round trip over a socket.

**Never a different answer, never a new wait.** A post is only a proposal. The rank withdraws
it and submits the operation to the coordinator as usual (the engine's normal path, with every
check, mismatch report, stall report and failure verdict it has) when

* another rank has operations in flight on the normal path (its ``BUSY`` word) and has taken
  in as much of the coordinator's stream of plans as this rank (its ``STREAM`` word), or posted
  a different name: the ranks submit in different orders, so the coordinator orders them. A busy
  rank that is behind in the stream is still finishing operations this rank has finished, so a
  post waits for it (within ``lane_wait_us``): otherwise one operation on the normal path sends
  the next ones there too, the rank that completes first finding the others still busy (a job
  of 3 ranks on a loaded 2-CPU machine never came back to the lane in 299 operations);
* the other ranks have not all posted within ``lane_wait_us`` (a rank that computes, or waits
  elsewhere, or died): a post never waits longer than that.

Commit and withdrawal take one ``flock`` on local rank 0's segment, so a post is either committed
(every rank's, at once) or withdrawn, never both. A bit names one validated request on every
rank (:class:`~ringflow.negotiation.ResponseCache`: bits are never reassigned), so equal bits
mean equal names, dtypes, shapes, ops and scale factors: the checks the coordinator made when it
cached the name. A rank posts only while it has nothing else in flight, so the operations that
commit together are the same instance of the name on every rank (an earlier instance completed
everywhere: its completion needed every rank's contribution).

**Slots.** Each rank's slot is one 64-byte header line (``STATE``, ``BIT``, ``GEN``: the commit
this rank's post belongs to, ``READ``: the last commit whose slots it has finished reading,
``BUSY``, ``STREAM``; local rank 0's line also holds ``COMMITS``) and ``EAGER_BYTES`` of data.
A rank writes its data only after every rank has read its previous committed data (``READ``), so
no rank reads a slot while its owner rewrites it. A rank that sees its slot COMMITTED reads the
others' data without the lock, which x86's total store order makes safe (stores are seen in the
order they were made); on other CPUs there is no lane (:data:`TSO`).

**A job of one rank** has no lane: the engine completes its cached allreduces (any size, on
the host or a device) in the submitting thread, with the same arithmetic
(:func:`ringflow.executor.solo_allreduce`).
"""

from __future__ import annotations

import fcntl
import os
import platform
import time

import numpy as np

from .algorithms.local import reduce_parts
from .ops import ReduceOp

__all__ = ["LINE", "TSO", "Lane"]

#: Bytes of a slot's header line (one cache line).
LINE = 64
_STATE, _BIT, _GEN, _READ, _BUSY, _COMMITS, _STREAM = range(7)  # words of a header line
EMPTY, POSTED, COMMITTED = 0, 1, 2
#: Whether this CPU keeps stores in order as other CPUs see them (x86's total store order), which
#: the lane's lock-free reads rely on: elsewhere there is no lane (the coordinator's eager path).
TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class Lane:
    """This rank's view of the lane of ``len(maps)`` ranks (local rank = global rank)."""

    def __init__(self, rank: int, maps: list, lock_fd: int) -> None:
        self.rank = rank
        self.size = len(maps)
        self._maps = maps  # kept alive with the views below
        # The header words as memoryviews: indexing one gives a Python int (a numpy view's
        # scalars cost 3-4x more per access, and the lane reads these words all the time).
        self._words = [memoryview(m.map)[:LINE].cast("q") for m in maps]
        self._data = [m.array[LINE:] for m in maps]
        self._mine = self._words[rank]
        self._others = [w for k, w in enumerate(self._words) if k != rank]
        self._fd = lock_fd
        self._last = 0  # the commit this rank's last committed post belonged to
        self._views: dict[tuple[int, np.dtype], list[np.ndarray]] = {}  # (size, dtype) -> slots

    def close(self) -> None:
        """Release every view of the segments this object made, so that their mappings (and
        the descriptor each holds) close with :meth:`ShmAllreduce.close`; the lane is unusable
        after (an elastic survivor closes a generation's and goes on in the same process)."""
        for words in self._words:
            words.release()
        self._data, self._views, self._maps = [], {}, []

    # --- the busy and stream words: written by their rank alone, read by the others unlocked --
    def set_busy(self, busy: bool) -> None:
        self._mine[_BUSY] = busy

    def took_in(self, stream: int) -> None:
        """This rank has taken in (and completed what it could of) the coordinator's stream up to
        ``stream``. Written after the ``BUSY`` word that completing it cleared, and read before
        it (:meth:`blocked`): a rank seen caught up is seen idle if it is."""
        self._mine[_STREAM] = stream

    def blocked(self) -> bool:
        """Whether another rank has operations in flight on the normal path beyond what this
        rank has taken in of the coordinator's stream: they need the coordinator."""
        stream = self._mine[_STREAM]
        for w in self._others:
            if w[_STREAM] >= stream and w[_BUSY]:
                return True
        return False

    # --- posting ----------------------------------------------------------------------------------
    def post(self, bit: int, data: np.ndarray, deadline: float) -> bool:
        """Propose this rank's ``data`` (1-D, contiguous, at most ``EAGER_BYTES``) for the name of
        cache bit ``bit``; commit every rank's posts if this completes them. False (nothing
        posted) if a rank still reads this rank's previous data at ``deadline``."""
        while not self._read_by_all():
            if time.perf_counter() > deadline or self.blocked():
                return False
            os.sched_yield()
        self._data[self.rank][:data.nbytes] = data.view(np.uint8)
        mine, words = self._mine, self._words
        if not self._lock(deadline):
            return False
        try:
            mine[_BIT] = bit
            mine[_STATE] = POSTED
            if self._all_posted(bit):
                commit = words[0][_COMMITS] + 1
                words[0][_COMMITS] = commit
                for w in words:
                    w[_GEN] = commit
                    w[_STATE] = COMMITTED
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def _read_by_all(self) -> bool:
        """Whether every rank has read the data of this rank's last committed post."""
        last = self._last
        for w in self._words:
            if w[_READ] < last:
                return False
        return True

    def _all_posted(self, bit: int) -> bool:
        for w in self._words:
            if w[_STATE] != POSTED or w[_BIT] != bit:
                return False
        return True

    def committed(self) -> bool:
        return self._mine[_STATE] == COMMITTED

    def hopeless(self) -> bool:
        """Whether this rank's post cannot commit: another rank is :meth:`blocked` or posted
        another name."""
        bit = self._mine[_BIT]
        for w in self._others:
            if w[_STATE] == POSTED and w[_BIT] != bit:
                return True
        return self.blocked()

    def withdraw(self) -> bool | None:
        """Take this rank's post back: True, False if it was committed meanwhile, None if the
        lock is held (try again: its holder is between two instructions, or frozen, which the
        job's liveness checks turn into the job's error)."""
        if not self._lock(0.0):
            return None
        try:
            posted = self._mine[_STATE] == POSTED
            if posted:
                self._mine[_STATE] = EMPTY
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return posted

    def _lock(self, deadline: float) -> bool:
        """Take the lock, polling until ``deadline`` (``perf_counter``) at the latest. Never
        sleeping in ``flock``: ranks post at the same moment all the time, and a sleeping
        process takes tens of microseconds to wake."""
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return False
                os.sched_yield()

    def reduce(self, out: np.ndarray, op: ReduceOp, postscale: float) -> None:
        """``out`` (1-D, of the wire dtype) = the committed operation's result: every rank's data
        reduced in rank order (the eager path's arithmetic). Frees this rank's slot."""
        key = (out.size, out.dtype)
        parts = self._views.get(key)
        if parts is None:
            parts = self._views[key] = [d[:out.nbytes].view(out.dtype) for d in self._data]
        reduce_parts(parts, 0, out.size, out, op, postscale)
        commit = self._mine[_GEN]
        self._last = commit
        self._mine[_READ] = commit
        self._mine[_STATE] = EMPTY
