"""Taking in plans, in plan order, on every rank; running their data plane; completing handles.

:meth:`Plans.receive` (under the control lock, on whichever thread has the plan) does each
item's bookkeeping at once: the response cache, process-set changes, which items are this
rank's. Items that move data, and any item behind one, wait in ``ready`` for the engine thread,
which runs them one after the other outside the lock (:meth:`Plans.run_ready`); the others
complete at once. Handles complete in plan order either way.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import injection
from ..collectives import Kind, collective
from ..errors import from_wire
from ..executor import Entry, unpack
from ..negotiation import CachedAllreduce, Response
from ..requests import on_the_wire
from .common import Wake

if TYPE_CHECKING:
    from . import Engine

__all__ = ["Plans"]

#: Kinds whose plan item changes this rank's process sets (their value is the set's id).
_SET_CHANGES = (Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET)


class Plans:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        # Plan items for the engine thread, in plan order: (item, entries, data plane?, result).
        self.ready: collections.deque[tuple[Response, list, bool, Any]] = collections.deque()

    def receive(self, plan: list[Response | CachedAllreduce]) -> None:
        """Take in a plan (every rank, in plan order): book-keeping now, execution in order."""
        e = self.e
        if injection.ARMED:
            injection.hit("plan")
        queued = False
        for item in plan:
            result = None
            if isinstance(item, CachedAllreduce):
                refs = tuple(e.cache.ref[b] for b in item.bits)
                result = item.result
                # A joined rank has no entry here: the executor gives it zeros.
                resp = Response(Kind.ALLREDUCE, refs[0].process_set, refs, joined=(),
                                wire=item.wire, chunk=item.chunk)
            else:
                resp = item
                mine = {r.key: e._submitted.get(r.key) for r in item.requests}
                e.cache.record(item, mine.get)
            resp = on_the_wire(resp)
            for r in resp.requests:
                e._submitted.pop(r.key, None)
            if e._timeline is not None:
                for r in resp.requests:
                    e._timeline.planned(r.key)
            members = e.process_sets.get(resp.process_set)
            if not resp.error:
                self._change_sets(resp)
            if not resp.error and resp.kind != Kind.JOIN and (
                (members is None and resp.kind != Kind.REMOVE_PROCESS_SET)
                or (members is not None and e.rank not in members)
            ):
                continue  # not this rank's (it never submitted it)
            entries = [e._pending.get(r.key) for r in resp.requests]
            data_plane = collective(resp.kind).data and not resp.error and result is None
            if data_plane or self.ready:
                self.ready.append((resp, entries, data_plane, result))
                queued = True
            else:
                self.complete(resp, entries, None, result)
        e.posts.took_in(e.seat.stream)
        if queued:
            e._inbox.put((Wake.RUN,))

    def _change_sets(self, resp: Response) -> None:
        e = self.e
        if resp.kind == Kind.ADD_PROCESS_SET:
            e.process_sets[resp.value] = list(resp.requests[0].shape)
        elif resp.kind == Kind.REMOVE_PROCESS_SET:
            e.process_sets.pop(resp.requests[0].root, None)
            e.executor.forget(resp.requests[0].root)
            if e.seat.coordinator is not None:
                e.seat.coordinator.rescan()  # its pending names fail now

    def run_ready(self) -> None:
        """The engine thread: execute queued plan items in order, the data plane unlocked."""
        e = self.e
        while True:
            with e._control():
                if not self.ready:
                    return
                resp, entries, data_plane, result = self.ready[0]
                if data_plane and e._timeline is not None:
                    for r in resp.requests:
                        e._timeline.started(r.key)
            nbytes = (sum(x.request.nbytes for x in entries if x is not None)
                      if injection.ARMED else 0)
            if data_plane and injection.ARMED:
                injection.hit("data_start", nbytes)
            results = e.executor.run(resp, entries) if data_plane else None
            if data_plane and injection.ARMED:
                injection.hit("data_end", nbytes)
            with e._control():
                if e._closed:
                    return
                self.ready.popleft()
                self.complete(resp, entries, results, result)

    def complete(self, resp: Response, entries: list[Entry | None], results: list | None,
                 result: np.ndarray | None) -> None:
        """Finish the handles of one plan item (under the lock)."""
        e = self.e
        for r in resp.requests:
            e._pending.pop(r.key, None)
        tl = e._timeline
        if resp.kind == Kind.JOIN:
            join = (0, str(Kind.JOIN))
            entry = e._pending.pop(join, None)
            if entry is not None:
                e._done(entry.handle, resp.value)
                if tl is not None:
                    tl.completed(join, resp.kind, 1)
            return
        if resp.error:
            for r, entry in zip(resp.requests, entries, strict=True):
                if entry is not None:
                    e._done(entry.handle, error=from_wire(resp.error_type, resp.error))
                    if tl is not None:
                        tl.completed(r.key, resp.kind, len(entries), resp.error)
            return
        if result is not None:
            results = unpack(result, resp.requests, entries)
            e.count("eager")
        elif results is None:  # ops without data: barrier, process-set changes
            results = [resp.value if resp.kind in _SET_CHANGES else None] * len(entries)
        e.count("collectives")
        e.stats["tensors"] += len(entries)
        for r, entry, value in zip(resp.requests, entries, results, strict=True):
            if entry is not None:
                if tl is not None:
                    tl.completed(r.key, resp.kind, len(entries))
                e._done(entry.handle, value)
        e.posts.maybe_idle()
