"""The background engine: queue -> negotiate -> fuse -> compress -> execute -> complete.

Framework threads call :meth:`Engine.enqueue` and get a :class:`~ringflow.handles.Handle` back at
once. Two kinds of work are kept apart:

* **Control** (accepting tensors, talking to the coordinator, reading plans, completing handles)
  runs under one lock, in whichever thread has something to do: the framework thread that
  enqueues while the engine is idle, the transport's reader thread that receives a submission or
  a plan, or the engine thread. Each hand-off between threads costs ~35 us on this 2-core
  machine (a thread wake-up through a queue), so doing the control work where it arrives,
  instead of passing it on, is what keeps a small allreduce fast.
* **Data-plane execution** (ring, shared memory, MPI, NCCL) runs only on the engine thread,
  outside the lock, one plan item after the other in plan order.

One round of negotiation: a rank sends the coordinator its new requests in one message (full
requests for new names, bare cache bits for names whose request is unchanged, and with the bit
of a small allreduce the tensor itself); the coordinator feeds them to the
:class:`~ringflow.negotiation.Coordinator` and sends the plan to every rank, which takes it in in
order. The engine is this loop; its parts live in modules of their own:

* :mod:`.seat` -- who coordinates, the stream of plans and handovers, submissions to it;
* :mod:`.plans` -- taking in plans, running their data plane, completing handles;
* :mod:`.posts` -- small operations that skip the coordinator (the same-host lane, one rank);
* :mod:`.verdicts` -- fatal conditions, and the one error text every rank reports.

Handles are completed after the lock is released, so a done-callback may call back into ringflow.
Only the engine thread acts on failures; other threads pass them on through its inbox
(:class:`~.common.Wake` items). :mod:`ringflow.liveness` exchanges heartbeats between each rank
and the coordinator, so a frozen process is found even while nothing is pending.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import Any

import numpy as np

from .. import errors, injection
from ..autotune import Params
from ..backends import Backends
from ..config import Config
from ..errors import RingflowError, ShutdownError
from ..executor import Entry, Executor, eager_input
from ..handles import Handle
from ..liveness import Liveness
from ..messages import (
    TIMELINE,
    Abort,
    ClockProbe,
    Fatal,
    Handover,
    Heartbeat,
    Message,
    Plan,
    decode,
    encode,
)
from ..negotiation import Request, ResponseCache
from ..p2p import PointToPoint
from ..timeline import Timeline, answer_probe
from .common import Key, Wake, clone
from .plans import Plans
from .posts import Posts
from .seat import CoordinatorSeat
from .verdicts import Verdicts, as_failure

__all__ = ["Engine", "Entry", "Wake"]

log = logging.getLogger(__name__)

# How long the waiter of an operation submitted while the engine was idle polls before sleeping.
_LONE_SPIN_S = 100e-6


class Engine:
    def __init__(self, rank: int, size: int, backends: Backends, config: Config) -> None:
        self.rank, self.size, self.config = rank, size, config
        self.backends = backends
        self.transport = transport = backends.transport
        self.process_sets: dict[int, list[int]] = {0: list(range(size))}
        self.executor = Executor(backends, self.process_sets)
        self.cache = ResponseCache(config.cache_capacity)
        self.request_memo: dict[tuple, Request] = {}  # ringflow.submission.request's
        # collectives: plan items completed (fused tensors count once); eager: those of them that
        # the coordinator reduced itself (collectives.EAGER_BYTES); lane: those that took the
        # same-host lane or completed in the caller of a one-rank job (.posts).
        self.stats = {"collectives": 0, "tensors": 0, "bits_sent": 0, "requests_sent": 0,
                      "eager": 0, "lane": 0}
        # Everything below is control state, guarded by _lock, except _inbox (the engine
        # thread's queue).
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _control() blocks in the thread holding _lock
        self._ctl = _Control(self)
        self._finished: list[tuple[Handle, Any, BaseException | None]] = []
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._queued: set[Key] = set()  # entries in the inbox not yet accepted
        self._pending: dict[Key, Entry] = {}
        self._submitted: dict[Key, Request] = {}
        # Once set, enqueue() fails at once with this error; once _closed, nothing new is
        # accepted or planned (both set under _lock, so nothing slips in behind the final drain).
        self._refuse: BaseException | None = None
        self._closed = False
        self._liveness = Liveness(rank, size, config.timeout_s, transport.peer_host)
        self._timeline: Timeline | None = None  # set under _lock; closed outside it
        self._closing: Timeline | None = None  # the one being closed (see timeline())
        if config.timeline_path:
            self._timeline = Timeline(config.timeline_path, rank, size, self._send)
        self.p2p = PointToPoint(rank, size, transport.send_ctrl, self.stats)
        # The tunable values in force (ringflow.autotune): the configuration's, until rank 0's
        # autotuner (the seat's) sends others with a plan.
        self.params = Params.of(config)
        self.seat = CoordinatorSeat(self)
        self.verdicts = Verdicts(self)
        self.posts = Posts(self)
        self.plans = Plans(self)
        if size > 1:
            ref = weakref.ref(self)
            transport.set_ctrl_handler(
                lambda src, payload: _call(ref, "_on_ctrl", src, payload),
                lambda peer, err: _call(ref, "_on_peer_failure", peer, err),
            )
        self._thread = threading.Thread(target=self._run, name=f"ringflow-engine-{rank}",
                                        daemon=True)
        self._thread.start()
        self._liveness.start(self, Engine._beat, f"ringflow-heartbeat-{rank}")

    @property
    def fatal(self) -> BaseException | None:
        """The job's fatal error as this rank knows it, once the job has failed."""
        return self.verdicts.fatal

    @property
    def coordinator(self) -> Any:
        """The :class:`~ringflow.negotiation.Coordinator` while this rank coordinates, else
        None."""
        return self.seat.coordinator

    def _control(self) -> _Control:
        """Hold the control lock; complete the handles finished inside once it is released."""
        return self._ctl

    def _done(self, handle: Handle, value: Any = None, error: BaseException | None = None) -> None:
        self._finished.append((handle, value, error))

    def count(self, *stats: str) -> None:
        for stat in stats:
            self.stats[stat] += 1

    # framework side ----------------------------------------------------------------------------
    def enqueue(self, request: Request, array: np.ndarray | None = None, out: Any = None) -> Handle:
        return self.enqueue_many([(request, array, out)])[0]

    def enqueue_many(self, items: list[tuple[Request, np.ndarray | None, Any]]) -> list[Handle]:
        """Hand ``(request, input, output)`` items to the engine; their handles, in order.

        Raises:
            TensorError: a name is already in flight on this rank (none of ``items`` is taken,
                as Horovod checks a whole group before it enqueues any of it).
            HorovodInternalError: the job has failed (its error, naming the cause) or was shut
                down; every later call raises it until ``shutdown()`` and ``init()``.
        """
        with self._control():
            if self._refuse is not None:
                raise clone(self._refuse)
            busy = bool(self._pending or self._queued or self._closed)
            for request, _, _ in items:
                if request.key in self._pending or request.key in self._queued:
                    raise errors.TensorError(
                        f"tensor {request.name!r} was submitted again while it was in flight; "
                        "wait for the first handle or use another name")
            spin = 0.0 if busy else _LONE_SPIN_S  # see Handle
            entries = [Entry(r, a, o, Handle(r.name, spin)) for r, a, o in items]
            if busy:
                # The engine thread batches what arrives meanwhile into one submission.
                self.posts.going_normal()
                for entry in entries:
                    self._queued.add(entry.request.key)
                    self._inbox.put((Wake.ENQUEUE, entry))
            elif not (len(entries) == 1 and self.posts.post(entries[0])):
                self.posts.going_normal()
                try:
                    self._submit_entries(entries)  # idle: no reason to wake another thread
                except Exception as exc:  # the engine thread fails the job (and these entries)
                    self._inbox.put((Wake.ERROR, exc))
        return [entry.handle for entry in entries]

    def shutdown(self) -> None:
        """Fail what is pending, stop the threads, and close the transport (with a goodbye)."""
        if injection.ARMED:
            injection.hit("shutdown")
        with self._control():
            if self._refuse is None:
                self._refuse = ShutdownError("ringflow has been shut down; call init() again")
        self._inbox.put((Wake.STOP,))
        self._thread.join(self.config.timeout_s)
        self.seat.stop_tuning()
        self.timeline(None)  # before the goodbye: the last records travel ahead of it
        self._liveness.stop()
        self.seat.hand_over()
        self.backends.close()

    def abort(self, error: RingflowError) -> None:
        """Fail the job on every rank with ``error``, as a fatal condition found here would: this
        process is going down (an uncaught exception, :mod:`ringflow.failure`)."""
        self._inbox.put((Wake.ERROR, error))

    def record_step(self, overlap: Any) -> None:
        """An optimizer's step (:class:`ringflow.overlap.StepOverlap`), for the timeline."""
        tl = self._timeline
        if tl is not None:
            tl.step(overlap)

    def record_span(self, row: str, label: str, start: float, end: float) -> None:
        """Work outside the engine (the compressed exchange's phases), for the timeline."""
        tl = self._timeline
        if tl is not None:
            tl.span(row, label, start, end)

    def timeline(self, path: str | None) -> None:
        """Start recording the job's timeline (rank 0 writes it to ``path``), or stop with None.
        Closing waits (rank 0: up to timeline.FINAL_WAIT_S) outside the control lock."""
        with self._control():
            old, self._timeline = self._timeline, None
        if old is not None:
            self._closing = old  # still takes the other ranks' last records
            old.close()
            self._closing = None
        if path:
            new = Timeline(path, self.rank, self.size, self._send)
            with self._control():
                self._timeline = new

    # callbacks from transport reader threads ---------------------------------------------------
    def _on_ctrl(self, src: int, payload: bytes) -> None:
        self._liveness.heard(src)
        try:
            msg = decode(payload)
            if isinstance(msg, Heartbeat):
                return
            if isinstance(msg, PointToPoint.MESSAGES):
                self.p2p.on_message(src, msg)  # between two ranks: no engine lock, no wake-up
                return
            if isinstance(msg, TIMELINE):
                tl = self._timeline or self._closing
                if tl is not None:
                    tl.on_message(src, msg)
                elif isinstance(msg, ClockProbe):
                    self._send(src, answer_probe(msg, False))
                return
            if isinstance(msg, (Abort, Fatal)):
                self.verdicts.on_message(src, msg)
                return
            with self._control():
                if self._closed:
                    return
                if isinstance(msg, (Plan, Handover)):
                    self.seat.in_stream(msg)
                else:
                    self.seat.on_submit(src, msg)
        except Exception as exc:  # not this thread's to handle: the engine thread fails the job
            self._inbox.put((Wake.ERROR, exc))

    def _on_peer_failure(self, peer: int, error: BaseException) -> None:
        self.verdicts.on_peer_failure(peer, error)

    # the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = self._next_items()
            stop = False
            departed: list[tuple] = []
            try:
                with self._control():
                    stop, departed = self._step(items)
                    self.posts.step()
                self.plans.run_ready()
            except RingflowError as exc:
                self.verdicts.note(exc)
            except Exception as exc:  # a bug must not leave handles hanging
                log.exception("ringflow engine failed")
                self.verdicts.note(as_failure(exc))
            self.verdicts.act()
            # After the job's error, if any: a peer that announced it and then left must not
            # turn it into "has shut down" here.
            try:
                with self._control():
                    for _, peer, error in departed:
                        self.verdicts.on_peer(peer, error)
            except Exception as exc:
                self.verdicts.internal(exc)
            if stop:
                break
        stopped = ShutdownError("ringflow was shut down while this op was pending")
        self._close(stopped)
        self.p2p.close(stopped)  # point to point ends with this rank's engine...

    def _next_items(self) -> list[tuple]:
        c = self.seat.coordinator
        busy = self._pending or (c is not None and c.holding)
        wait = self.params.cycle_time_ms / 1000.0 if busy else self._liveness.interval
        try:
            items = [self._inbox.get(timeout=wait)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _step(self, items: list[tuple]) -> tuple[bool, list[tuple]]:
        """Handle one batch of inbox items under the lock; returns (stop, departed peers)."""
        entries: list[Entry] = []
        departed: list[tuple] = []
        stop = False
        for item in items:
            kind = item[0]
            if kind is Wake.ENQUEUE:
                self._queued.discard(item[1].request.key)
                entries.append(item[1])
            elif kind is Wake.MESSAGE:
                self.verdicts.on_verdict(item[2])
            elif kind is Wake.PEER and isinstance(item[2], ShutdownError):
                # A peer that shut down on purpose sent its last plans before its goodbye: they
                # are queued already; run them first (they may hold this rank's results).
                departed.append(item)
            elif kind is Wake.PEER:
                self.verdicts.on_peer(item[1], item[2])
            elif kind is Wake.ERROR:
                self.verdicts.note(as_failure(item[1]))
            elif kind is Wake.STOP:
                stop = True
        if entries:
            self._submit_entries(entries)
        if self.seat.coordinator is not None and self.verdicts.failure is None \
                and not self._closed:
            self.seat.plan()  # joins and departures can make names ready without a submission
        self.verdicts.check_liveness()
        return stop, departed

    def _submit_entries(self, entries: list[Entry]) -> None:
        """Accept ``entries`` and send what the coordinator needs to hear of them."""
        requests: list[Request] = []
        bits: list[int] = []
        data: list[np.ndarray | None] = []
        for entry in entries:
            if self._closed:
                self._done(entry.handle, error=clone(self._refuse or ShutdownError("closed")))
                continue
            req = entry.request
            self._pending[req.key] = entry
            if self._timeline is not None:
                self._timeline.submitted(req.key)
            bit = None if req.error else self.cache.lookup(req)
            if bit is None:
                requests.append(req)
            else:
                bits.append(bit)
                data.append(eager_input(entry))
            self._submitted[req.key] = req
        if self.verdicts.failure is not None or not (requests or bits):
            return
        self.stats["requests_sent"] += len(requests)
        self.stats["bits_sent"] += len(bits)
        if injection.ARMED:
            injection.hit("submit")
        self.seat.submit(requests, bits, data)

    def _close(self, error: BaseException) -> None:
        """Refuse new operations with ``error`` and fail every one in flight with it."""
        with self._control():
            if self._refuse is None:
                self._refuse = error
            self._closed = True
            self.posts.close()
            self.plans.ready.clear()
            pending, self._pending = self._pending, {}
            for entry in pending.values():
                self._done(entry.handle, error=clone(error))
            keep = []
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] is Wake.ENQUEUE:
                    self._queued.discard(item[1].request.key)
                    self._done(item[1].handle, error=clone(error))
                else:
                    keep.append(item)  # a STOP must still stop the thread
            for item in keep:
                self._inbox.put(item)

    # messaging ---------------------------------------------------------------------------------
    def _send(self, dst: int, msg: Message) -> None:
        try:
            self.transport.send_ctrl(encode(msg), dst)
        except RingflowError as exc:
            log.debug("rank %d: could not send %s to %d: %s", self.rank, type(msg).__name__,
                      dst, exc)

    def _beat(self) -> None:
        """The liveness thread: a heartbeat to the other side, the verdict on a silent peer
        (here, since the engine thread may be blocked in a data-plane wait that only this
        verdict ends), a tick for the engine thread; the timeline's clock probes (rank 0) or
        records (other ranks)."""
        tl = self._timeline
        if tl is not None:
            tl.beat()
        self.seat.heartbeat()
        self.verdicts.check_silent()
        self._inbox.put((Wake.TICK,))

    def _members(self, ps: int) -> list[int]:
        return self.process_sets.get(ps, [])


class _Control:
    """:meth:`Engine._control`: a class rather than a generator, since every operation enters
    it two or three times (~1.5 us saved each); handles finished inside are completed even when
    the block raises."""

    __slots__ = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        engine._lock.acquire()
        engine._depth += 1

    def __exit__(self, *exc: object) -> None:
        engine = self.engine
        engine._depth -= 1
        done: list = []
        if engine._depth == 0:
            done, engine._finished = engine._finished, []
        engine._lock.release()
        for handle, value, error in done:
            handle._finish(value, error)


def _call(ref: weakref.ReferenceType, method: str, *args: Any) -> None:
    engine = ref()
    if engine is not None:
        getattr(engine, method)(*args)
