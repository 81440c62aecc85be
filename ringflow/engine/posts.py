"""Small operations that skip the coordinator: the same-host lane, and a job of one rank.

* **The lane** (:mod:`ringflow.lane`, DESIGN section 3): when every rank is on one host, a small
  cached allreduce submitted while this rank is idle is posted in a shared slot; the post that
  completes the set commits every rank's, and each rank reduces the slots itself with the eager
  path's arithmetic. A post withdraws to the coordinator within ``lane_wait_us``, so any other
  situation ends on the normal path. The submitting thread drives the post (its waiter polls,
  which calls :meth:`Posts.drive`); the engine thread drives it every cycle too.
* **One rank**: a cached allreduce completes at once in the caller
  (:func:`ringflow.executor.solo_allreduce`: the scaled copy a reduction of one part is), on
  the host or a device, any size.

Everything here runs under the engine's control lock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..collectives import Kind
from ..errors import ShutdownError
from ..executor import Entry, eager_input, output_of, solo_allreduce
from ..ops import ReduceOp

if TYPE_CHECKING:
    from . import Engine

__all__ = ["Posts"]


class Posts:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.lane = engine.backends.lane if engine.size > 1 and engine.config.lane_wait_us > 0 \
            else None
        self.solo = engine.size == 1 and engine.config.lane_wait_us > 0
        self.posted: tuple[Entry, float] | None = None  # on the lane: (entry, withdraw by)

    def post(self, entry: Entry) -> bool:
        """Post ``entry`` on the lane if it may take it (the engine idle); in a job of one rank,
        complete a cached allreduce at once. False: it goes to the coordinator."""
        e, lane, req = self.e, self.lane, entry.request
        if (req.process_set != 0 or req.group or req.error or e._timeline is not None
                or (lane is None and not self.solo)):
            return False
        if self.solo:
            if req.kind != Kind.ALLREDUCE or e.cache.lookup(req) is None:
                return False
            self._solo(entry)
            return True
        if lane.blocked():
            return False
        bit = e.cache.lookup(req)
        data = None if bit is None else eager_input(entry)
        if data is None:
            return False
        deadline = time.perf_counter() + e.config.lane_wait_us * 1e-6
        lane.set_busy(False)
        if not lane.post(bit, data, deadline):
            return False
        e._pending[req.key] = entry
        self.posted = (entry, deadline)
        entry.handle._drive = self.drive
        self.step()  # this post may have committed every rank's
        return True

    def _solo(self, entry: Entry) -> None:
        """A cached allreduce of a job of one rank, done here: a copy (scaled, through the wire
        dtype), none in place. The plan's round trip with itself cost a 4 KiB allreduce ~0.1 ms
        on CPU, 0.4 ms on a GPU, and a 64 MiB one in place 66 us on CPU."""
        e = self.e
        try:
            out = solo_allreduce(entry)
        except Exception as exc:  # validated requests do not raise here; a device may
            e._done(entry.handle, error=ShutdownError(f"internal error in the engine: {exc!r}"))
        else:
            e.count("collectives", "tensors", "lane")
            e._done(entry.handle, out)

    def drive(self) -> bool:
        """Move the posted operation on (its waiter, poll() and the engine thread call this);
        True while it is still posted."""
        with self.e._control():
            return self.step()

    def step(self) -> bool:
        if self.posted is None:
            return False
        e = self.e
        entry, deadline = self.posted
        lane, req = self.lane, entry.request
        if not lane.committed():
            if not (lane.hopeless() or e._refuse is not None
                    or time.perf_counter() > deadline):
                return True
            withdrawn = lane.withdraw()
            if withdrawn is None:
                return True  # the lock is held: try again
            if withdrawn:  # to the coordinator, as any operation
                self.posted = None
                self.going_normal()
                e._submit_entries([entry])
                return False
        self.posted = None
        e._pending.pop(req.key, None)
        try:
            out = output_of(entry, req)
            flat = out.reshape(-1)
            wire = req.wire_dtype
            result = flat if flat.dtype == wire else np.empty(flat.size, wire)
            lane.reduce(result, ReduceOp(req.reduce_op), req.postscale)
            if result is not flat:
                np.copyto(flat, result, casting="unsafe")  # decompresses, as unpack() does
        except Exception as exc:  # every rank reduced the same slots: every rank fails alike
            e._done(entry.handle, error=ShutdownError(f"internal error on the lane: {exc!r}"))
        else:
            e.count("collectives", "tensors", "lane")
            e._done(entry.handle, out)
        self.maybe_idle()
        return False

    def going_normal(self) -> None:
        """This rank is about to have operations with the coordinator: no rank waits for it on
        the lane meanwhile."""
        if self.lane is not None:
            self.lane.set_busy(True)

    def maybe_idle(self) -> None:
        e = self.e
        if self.lane is not None and not (e._pending or e._queued or e._closed):
            self.lane.set_busy(False)

    def took_in(self, stream: int) -> None:
        """This rank has taken in a plan, the coordinator's stream now at ``stream``."""
        if self.lane is not None:
            self.lane.took_in(stream)

    def close(self) -> None:
        """For good: no rank waits for this one on the lane, and its post is withdrawn."""
        self.going_normal()
        if self.posted is not None:
            self.lane.withdraw()
            self.posted = None
        self.lane = None  # the backends close it at shutdown
