"""The background engine: queue -> negotiate -> fuse -> compress -> execute -> complete.

Framework threads call :meth:`Engine.enqueue` and get a :class:`~ringflow.handles.Handle` back at
once. Two kinds of work are kept apart:

* **Control** (accepting tensors, talking to the coordinator, reading plans, completing handles)
  runs under one lock, in whichever thread has something to do: the framework thread that
  enqueues while the engine is idle, the transport's reader thread that receives a submission or
  a plan, or the engine thread. Each of those hand-offs between threads costs ~35 us on this
  2-core machine (a thread wake-up through a queue: 76 us per round trip), so doing the control
  work where it arrives, instead of passing it on, is what keeps a small allreduce fast.
* **Data-plane execution** (ring, shared memory, MPI) runs only on the engine thread, outside the
  lock, one plan item after the other in plan order. Items that need no data plane (errors,
  barriers, process-set changes, and small allreduces that the coordinator reduced itself)
  complete as soon as their plan arrives, unless a data-plane item is still ahead of them.

One round of negotiation:

1. a rank sends its new requests to the coordinator (rank 0) in one message: full requests for
   new names, bare cache bits for names whose request is unchanged, and, with a bit for an
   allreduce of at most ``EAGER_BYTES``, the tensor itself (prescaled, in the wire dtype);
2. rank 0 feeds them to the :class:`~ringflow.negotiation.Coordinator` and sends the resulting
   plan to every rank. A fused item of small cached allreduces whose data came from every member
   is reduced right there (rank order, :func:`~ringflow.algorithms.local.reduce_parts`) and its
   result travels in the plan: one round trip and no data-plane collective;
3. every rank walks the plan in order: process-set changes and the response cache are updated at
   once; other items are completed or queued for the engine thread, whose
   :class:`~ringflow.executor.Executor` packs the tensors into a reusable fusion buffer of the
   wire dtype (casting compresses), runs the algorithm, and unpacks (casting decompresses); the
   engine completes the handles.

The messages are the frozen dataclasses of :mod:`ringflow.messages`; the engine thread's inbox
holds :class:`Wake` items.

Handles are completed after the lock is released, so a done-callback may call back into ringflow.

Failures: a plan item that carries an error fails its handles on every rank with the same class
and text. A fatal condition (a peer died or went silent for ``timeout_s``, a stall past
``stall_shutdown_s``, a data-plane error) is reported to the coordinator, which broadcasts one text
that every rank uses; every pending handle fails with it and later calls raise ShutdownError
naming it. Only the engine thread acts on failures; other threads pass them on through its inbox.
:mod:`ringflow.liveness` exchanges heartbeats between each rank and rank 0, so a frozen process is
found even while nothing is pending.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from . import errors, fault
from .autotune import Params, Tuner, fixed_knobs
from .backends import Backends
from .collectives import collective
from .config import Config
from .errors import RingflowError, ShutdownError, from_wire
from .executor import Entry, Executor, eager_input, output_of, solo_allreduce, unpack
from .handles import Handle
from .liveness import Liveness
from .messages import (
    TIMELINE,
    Abort,
    ClockProbe,
    Fatal,
    Handover,
    Heartbeat,
    Message,
    Plan,
    Submit,
    decode,
    encode,
)
from .negotiation import (
    CachedAllreduce,
    Coordinator,
    Request,
    Response,
    ResponseCache,
    on_the_wire,
)
from .ops import ReduceOp
from .p2p import PointToPoint
from .timeline import Timeline, answer_probe

__all__ = ["Engine", "Entry"]

log = logging.getLogger(__name__)

Key = tuple[int, str]

# How long the waiter of an operation submitted while the engine was idle polls before sleeping.
_LONE_SPIN_S = 100e-6


class Wake(enum.Enum):
    """What an item of the engine thread's inbox asks of it: ``(Wake.X, *arguments)``."""

    ENQUEUE = "enqueue"  # (entry,): accept it (submitted while the engine was busy)
    MESSAGE = "message"  # (src, Abort | Fatal): act on a verdict
    PEER = "peer"  # (rank, error): a peer failed or said goodbye
    ERROR = "error"  # (exception,): another thread failed doing control work
    RUN = "run"  # (): plan items are ready to execute
    TICK = "tick"  # (): check liveness, stalls and the fusion window
    STOP = "stop"  # (): shut down



class Engine:
    def __init__(self, rank: int, size: int, backends: Backends, config: Config) -> None:
        self.rank = rank
        self.size = size
        self.backends = backends
        self.transport = transport = backends.transport
        self.config = config
        self.process_sets: dict[int, list[int]] = {0: list(range(size))}
        self.executor = Executor(backends, self.process_sets)
        self.cache = ResponseCache(config.cache_capacity)
        self.request_memo: dict[tuple, Request] = {}  # ringflow.submission.request's
        # The coordinator is rank 0, until it shuts down while others go on (Handover).
        self.coord = 0
        self.coordinator = (
            Coordinator(size, self._members, config.fusion_threshold_bytes, self.cache)
            if rank == 0 else None
        )
        self._early_submits: list[tuple[int, Submit]] = []  # before this rank took over
        # The tunable values in force (ringflow.autotune): the configuration's, until rank 0's
        # autotuner sends others with a plan.
        self.params = Params.of(config)
        self._tuner = Tuner(
            self.params, allowed_compression=config.autotune_compression,
            fixed=fixed_knobs(), warmup_samples=config.autotune_warmup_samples,
            steps_per_sample=config.autotune_steps_per_sample,
            log_path=config.autotune_log_file) if rank == 0 and size > 1 and config.autotune \
            else None
        if self.coordinator is not None:
            self._configure(self.coordinator)
        # collectives: plan items completed (fused tensors count once); eager: those of them that
        # rank 0 reduced itself (see negotiation.EAGER_BYTES).
        # lane: of them, those that took the same-host lane (ringflow.lane).
        self.stats = {"collectives": 0, "tensors": 0, "bits_sent": 0, "requests_sent": 0,
                      "eager": 0, "lane": 0}
        self.lane = backends.lane if size > 1 and config.lane_wait_us > 0 else None
        # A job of one rank completes its cached allreduces in the caller (_solo).
        self._solo_ok = size == 1 and config.lane_wait_us > 0
        # Everything below is control state, guarded by _lock, except _inbox (the engine
        # thread's queue) and _fatal (written by the engine thread only).
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _control() blocks in the thread holding _lock
        self._ctl = _Control(self)
        self._finished: list[tuple[Handle, Any, BaseException | None]] = []
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._queued: set[Key] = set()  # entries in the inbox not yet accepted
        self._pending: dict[Key, Entry] = {}
        self._submitted: dict[Key, Request] = {}
        # Plan items for the engine thread, in plan order: (item, entries, data plane?, result).
        self._ready: collections.deque[tuple[Response, list, bool, Any]] = collections.deque()
        self._posted: tuple[Entry, float] | None = None  # on the lane: (entry, withdraw by)
        self._fatal: BaseException | None = None
        self._failure: tuple[BaseException, bool] | None = None  # to act on: (error, report)
        # Written by reader and heartbeat threads: the job's error as the coordinator announced
        # it, and how each peer failed (dead, or silent past timeout_s).
        self._verdict: BaseException | None = None
        self._peer_errors: dict[int, BaseException] = {}
        # Once set, enqueue() fails at once with this error; once _closed, nothing new is
        # accepted or planned (both set under _lock, so nothing slips in behind the final drain).
        self._refuse: BaseException | None = None
        self._closed = False
        self._liveness = Liveness(rank, size, config.timeout_s)
        self._timeline: Timeline | None = None  # set under _lock; closed outside it
        self._closing: Timeline | None = None  # the one being closed (see timeline())
        if config.timeline_path:
            self._timeline = Timeline(config.timeline_path, rank, size, self._send)
        self.p2p = PointToPoint(rank, size, transport.send_ctrl, self.stats)
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
        return self._fatal

    def _control(self) -> _Control:
        """Hold the control lock; complete the handles finished inside once it is released."""
        return self._ctl

    def _done(self, handle: Handle, value: Any = None, error: BaseException | None = None) -> None:
        self._finished.append((handle, value, error))

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
                raise _clone(self._refuse)
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
                self._going_normal()
                for entry in entries:
                    self._queued.add(entry.request.key)
                    self._inbox.put((Wake.ENQUEUE, entry))
            elif not (len(entries) == 1 and self._post(entries[0])):
                self._going_normal()
                try:
                    self._submit_entries(entries)  # idle: no reason to wake another thread
                except Exception as exc:  # the engine thread fails the job (and these entries)
                    self._inbox.put((Wake.ERROR, exc))
        return [entry.handle for entry in entries]

    # the same-host lane (ringflow.lane) --------------------------------------------------------
    def _post(self, entry: Entry) -> bool:
        """Post ``entry`` on the lane if it may take it (under the lock, the engine idle); in a
        job of one rank, complete a cached allreduce at once."""
        lane, req = self.lane, entry.request
        if (req.process_set != 0 or req.group or req.error or self._timeline is not None
                or (lane is None and not self._solo_ok)):
            return False
        if self._solo_ok:
            if req.kind != "allreduce" or self.cache.lookup(req) is None:
                return False
            return self._solo(entry)
        if lane.others_busy():
            return False
        bit = self.cache.lookup(req)
        data = None if bit is None else eager_input(entry)
        if data is None:
            return False
        deadline = time.perf_counter() + self.config.lane_wait_us * 1e-6
        lane.set_busy(False)
        if not lane.post(bit, data, deadline):
            return False
        self._pending[req.key] = entry
        self._posted = (entry, deadline)
        entry.handle._drive = self._drive
        self._lane_step()  # this post may have committed every rank's
        return True

    def _solo(self, entry: Entry) -> bool:
        """A cached allreduce of a job of one rank, done here: a copy (scaled, through the wire
        dtype), none in place. The plan's round trip with itself cost a 4 KiB allreduce ~0.1 ms
        on CPU, 0.4 ms on a GPU, and a 64 MiB one in place 66 us on CPU."""
        try:
            out = solo_allreduce(entry, self.backends.timeout_s)
        except Exception as exc:  # validated requests do not raise here; a device may
            self._done(entry.handle, error=ShutdownError(f"internal error in the engine: {exc!r}"))
        else:
            for stat in ("collectives", "tensors", "lane"):
                self.stats[stat] += 1
            self._done(entry.handle, out)
        return True

    def _drive(self) -> bool:
        """Move the posted operation on (its waiter, poll() and the engine thread call this);
        True while it is still posted."""
        with self._control():
            return self._lane_step()

    def _lane_step(self) -> bool:
        if self._posted is None:
            return False
        entry, deadline = self._posted
        lane, req = self.lane, entry.request
        if not lane.committed():
            if not (lane.hopeless() or self._refuse is not None
                    or time.perf_counter() > deadline):
                return True
            withdrawn = lane.withdraw()
            if withdrawn is None:
                return True  # the lock is held: try again
            if withdrawn:  # to the coordinator, as any operation
                self._posted = None
                self._going_normal()
                self._submit_entries([entry])
                return False
        self._posted = None
        self._pending.pop(req.key, None)
        try:
            out = output_of(entry, req)
            flat = out.reshape(-1)
            wire = req.wire_dtype
            result = flat if flat.dtype == wire else np.empty(flat.size, wire)
            lane.reduce(result, ReduceOp(req.reduce_op), req.postscale)
            if result is not flat:
                np.copyto(flat, result, casting="unsafe")  # decompresses, as unpack() does
        except Exception as exc:  # every rank reduced the same slots: every rank fails alike
            self._done(entry.handle, error=ShutdownError(f"internal error on the lane: {exc!r}"))
        else:
            for stat in ("collectives", "tensors", "lane"):
                self.stats[stat] += 1
            self._done(entry.handle, out)
        self._maybe_idle()
        return False

    def _going_normal(self) -> None:
        """This rank is about to have operations with the coordinator: no rank waits for it on
        the lane meanwhile."""
        if self.lane is not None:
            self.lane.set_busy(True)

    def _maybe_idle(self) -> None:
        if self.lane is not None and not (self._pending or self._queued or self._closed):
            self.lane.set_busy(False)

    def shutdown(self) -> None:
        """Fail what is pending, stop the threads, and close the transport (with a goodbye)."""
        if fault.ARMED:
            fault.hit("shutdown")
        with self._control():
            if self._refuse is None:
                self._refuse = ShutdownError("ringflow has been shut down; call init() again")
        self._inbox.put((Wake.STOP,))
        self._thread.join(self.config.timeout_s)
        tuner = self._tuner
        if tuner is not None:
            tuner.close()
        self.timeline(None)  # before the goodbye: the last records travel ahead of it
        self._liveness.stop()
        self._hand_over()
        self.backends.close()

    def abort(self, error: RingflowError) -> None:
        """Fail the job on every rank with ``error``, as a fatal condition found here would: this
        process is going down (an uncaught exception, :mod:`ringflow.failure`)."""
        self._inbox.put((Wake.ERROR, error))

    def _hand_over(self) -> None:
        """The coordinator leaves while other ranks may go on (process sets without it): the
        lowest rank still there coordinates from now on. Sent after this rank's last plan, on
        the same ordered channels, so every rank has taken in every plan before it switches."""
        c = self.coordinator
        if c is None or self.size == 1 or self._fatal is not None:
            return
        gone = {**c.gone, self.rank: "it called shutdown()"}
        successor = next((r for r in range(self.size) if r not in gone), None)
        if successor is not None:
            self._broadcast(Handover(successor, gone, list(c.joined), c.next_set_id))

    def record_step(self, overlap: Any) -> None:
        """An optimizer's step (:class:`ringflow.overlap.StepOverlap`), for the timeline."""
        tl = self._timeline
        if tl is not None:
            tl.step(overlap)

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
                error = msg.exception()
                if isinstance(msg, Fatal):
                    self._verdict = error
                if isinstance(msg, Fatal) or self.coordinator is not None:
                    # The job has failed: end this rank's data-plane wait now (the engine
                    # thread may be blocked in one), then let the engine thread act on it.
                    self.transport.abort(error)
                self._inbox.put((Wake.MESSAGE, src, msg))
                return
            with self._control():
                if self._closed:
                    return
                if isinstance(msg, Plan):
                    if msg.params is not None:
                        self._set_params(msg.params)
                    self._receive(msg.items)
                elif isinstance(msg, Handover):
                    self._take_over(msg)
                elif self.coordinator is not None:
                    if fault.ARMED:
                        fault.hit("negotiate")
                    if self._timeline is not None:
                        self._timeline.arrived(src, msg.requests, msg.bits, self.cache)
                    self.coordinator.submit(src, msg.requests, msg.bits, msg.data)
                    self._plan()
                else:  # sent to this rank as the successor before its Handover arrived
                    self._early_submits.append((src, msg))
        except Exception as exc:  # not this thread's to handle: the engine thread fails the job
            self._inbox.put((Wake.ERROR, exc))

    def _take_over(self, msg: Handover) -> None:
        """The coordinator left cleanly (under the lock, in plan order): follow its successor,
        and submit again in full what it never planned (the successor knows none of it)."""
        self.coord = msg.successor
        self._liveness.follow(msg.successor, msg.gone)
        self.cache.mine.clear()  # the successor cannot decode other ranks' bits: full requests
        pending = [self._submitted[k] for k in self._submitted]
        if msg.successor != self.rank:
            if pending:
                self._send(msg.successor, Submit(pending, [], []))
            return
        c = Coordinator(self.size, self._members, self.config.fusion_threshold_bytes, self.cache)
        self._configure(c)
        c.gone, c.joined, c.next_set_id = dict(msg.gone), list(msg.joined), msg.next_set_id
        self.coordinator = c
        c.submit(self.rank, pending, [], [])
        early, self._early_submits = self._early_submits, []
        for src, sub in early:
            c.submit(src, sub.requests, sub.bits, sub.data)
        self._plan()

    def _on_peer_failure(self, peer: int, error: BaseException) -> None:
        self.p2p.peer_failed(peer, error)
        if isinstance(error, ShutdownError):
            self._liveness.forget(peer)  # it said goodbye: not a frozen peer after timeout_s
        else:
            self._peer_errors.setdefault(peer, error)
            if not self._closed:
                self.transport.abort(error)  # a fatal condition: end the data plane's waits
        self._inbox.put((Wake.PEER, peer, error))

    # the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = self._next_items()
            stop = False
            departed: list[tuple] = []
            try:
                with self._control():
                    stop, departed = self._step(items)
                    self._lane_step()
                self._run_ready()
            except RingflowError as exc:
                self._note_failure(exc)
            except Exception as exc:  # a bug must not leave handles hanging
                log.exception("ringflow engine failed")
                self._note_failure(ShutdownError(f"internal error in the engine: {exc!r}"))
            if self._failure is not None and self._fatal is None:
                self._fail_job(*self._failure)
            # After the job's error, if any: a peer that announced it and then left must not
            # turn it into "has shut down" here.
            try:
                with self._control():
                    for _, peer, error in departed:
                        self._on_peer(peer, error)
            except Exception as exc:
                log.exception("ringflow engine failed")
                if self._fatal is None:
                    self._fail_job(ShutdownError(f"internal error in the engine: {exc!r}"))
            if stop:
                break
        stopped = ShutdownError("ringflow was shut down while this op was pending")
        self._close(stopped)
        self.p2p.close(stopped)  # point to point ends with this rank's engine...

    def _next_items(self) -> list[tuple]:
        busy = self._pending or (self.coordinator is not None and self.coordinator.holding)
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
                self._on_verdict(item[2])
            elif kind is Wake.PEER and isinstance(item[2], ShutdownError):
                # A peer that shut down on purpose sent its last plans before its goodbye: they
                # are queued already; run them first (they may hold this rank's results).
                departed.append(item)
            elif kind is Wake.PEER:
                self._on_peer(item[1], item[2])
            elif kind is Wake.ERROR:
                exc = item[1]
                self._note_failure(exc if isinstance(exc, RingflowError) else ShutdownError(
                    f"internal error in the engine: {exc!r}"))
            elif kind is Wake.STOP:
                stop = True
        if entries:
            self._submit_entries(entries)
        if self.coordinator is not None and self._failure is None and not self._closed:
            self._plan()  # joins and departures can make names ready without a submission
        self._check_liveness()
        return stop, departed

    def _submit_entries(self, entries: list[Entry]) -> None:
        """Accept ``entries`` and send what the coordinator needs to hear of them."""
        requests: list[Request] = []
        bits: list[int] = []
        data: list[np.ndarray | None] = []
        for entry in entries:
            if self._closed:
                self._done(entry.handle, error=_clone(self._refuse or ShutdownError("closed")))
            else:
                self._accept(entry, requests, bits, data)
        if self._failure is not None or not (requests or bits):
            return
        self.stats["requests_sent"] += len(requests)
        self.stats["bits_sent"] += len(bits)
        if fault.ARMED:
            fault.hit("submit")
        if self.coordinator is not None:
            if self._timeline is not None:
                self._timeline.arrived(self.rank, requests, bits, self.cache)
            self.coordinator.submit(self.rank, requests, bits, data)
            self._plan()
        else:
            self._send(self.coord, Submit(requests, bits, data))

    def _accept(self, entry: Entry, requests: list[Request], bits: list[int],
                data: list[np.ndarray | None]) -> None:
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

    def _plan(self) -> None:
        """Rank 0: turn what is ready into a plan, send it to every rank and take it in here."""
        holding = self.coordinator.holding
        plan = self.coordinator.plan(self.params.cycle_time_ms / 1000.0)
        if plan:
            if self._timeline is not None:
                self._timeline.negotiated(plan, self.cache)
            params = self._tune(plan) if self._tuner is not None else None
            self._broadcast(Plan(plan, params))
            self._receive(plan)
        elif self.coordinator.holding and not holding:
            self._inbox.put((Wake.TICK,))  # the engine thread plans them when the window closes

    def _tune(self, plan: list[Response | CachedAllreduce]) -> Params | None:
        """Rank 0: tell the autotuner what was planned; its new values, now in force here."""
        names = []
        for item in plan:
            if isinstance(item, CachedAllreduce):
                names += [(self.cache.key_of[b], self.cache.ref[b].nbytes) for b in item.bits]
            else:
                names += [(r.key, r.nbytes) for r in item.requests]
        params = self._tuner.planned(names)
        if self._tuner.done:
            self._tuner = None
        if params is not None:
            self._set_params(params)
        return params

    def _set_params(self, params: Params) -> None:
        """New tunable values (under the lock, in plan order): items planned from now on carry
        them (the coordinator's), optimizers read them at their next backward pass."""
        self.params = params
        if self.coordinator is not None:
            self._configure(self.coordinator)

    def _configure(self, coordinator: Coordinator) -> None:
        p = self.params
        coordinator.fusion_threshold = p.fusion_threshold_bytes
        coordinator.wire = "" if p.wire_compression == "none" else p.wire_compression
        coordinator.chunk = p.chunk_bytes

    def _on_verdict(self, msg: Abort | Fatal) -> None:
        if isinstance(msg, Fatal):
            self._note_failure(msg.exception(), report=False)
        elif self.coordinator is not None:
            self._note_failure(msg.exception())

    def _on_peer(self, peer: int, error: BaseException) -> None:
        if isinstance(error, ShutdownError):
            if self._closed:
                # The job has failed (or this rank shut down): a goodbye now is that failure's
                # echo -- a rank that crashed says goodbye after its Abort -- and a plan made
                # of it ("left the job (it called shutdown())") would reach the others on
                # their reader threads, ahead of the Fatal their engine threads act on.
                return
            if self.coordinator is not None:
                self.coordinator.rank_gone(peer, "it called shutdown()")
                self._plan()
            elif peer == self.coord:
                self._close(ShutdownError(f"rank {peer} (the coordinator) has shut down"))
            return
        self._note_failure(error)

    def _check_liveness(self) -> None:
        silent = self._liveness.silent()
        if silent is not None:
            self._note_failure(self._peer_errors.setdefault(*silent))
            return
        if self.coordinator is not None:
            warnings, fatal = self.coordinator.stalled(
                self.config.stall_warning_s, self.config.stall_shutdown_s,
                self.config.deadlock_shutdown_s)
            for text in warnings:
                log.warning("ringflow stall: %s", text)
            if fatal:
                self._note_failure(errors.StallError(fatal))

    # failure -----------------------------------------------------------------------------------
    def _note_failure(self, error: BaseException, report: bool = True) -> None:
        """Remember the first fatal error; the engine thread acts on it outside the lock."""
        if self._failure is None:
            self._failure = (error, report)

    def _fail_job(self, error: BaseException, report: bool = True) -> None:
        """Make ``error`` the job's fatal error on this rank (rank 0: on every rank)."""
        if report and self.size > 1:
            if self.coordinator is not None:
                self._broadcast(Fatal.of(error))
            elif self._verdict is not None:
                error = self._verdict  # announced already
            elif self._coordinator_failure() is not None:
                # No verdict can come: every survivor names the coordinator alike.
                error = self._coordinator_failure()
            else:
                self._send(self.coord, Abort.of(error))
                error = self._await_verdict(error)
        self.transport.abort(error)
        self._fatal = error
        log.error("ringflow: %s", error)
        self._close(error)
        self.p2p.close(error)  # ... or the job, not when rank 0 leaves: it takes no part in it

    def _coordinator_failure(self) -> BaseException | None:
        """How the coordinator failed (it died, or froze past ``timeout_s``), if it did."""
        return self._peer_errors.get(self.coord)

    def _await_verdict(self, error: BaseException) -> BaseException:
        """Give rank 0 a moment to announce the job's error, so every rank reports one text; if
        rank 0 itself is found dead or frozen meanwhile, its failure is the text."""
        deadline = time.monotonic() + 1.0
        verdict = error
        keep = []  # entries and a stop: _close() fails the entries and keeps the stop
        while (left := deadline - time.monotonic()) > 0:
            if self._verdict is not None or self._coordinator_failure() is not None:
                verdict = self._verdict or self._coordinator_failure() or error
                break
            try:
                item = self._inbox.get(timeout=min(left, 0.01))
            except queue.Empty:
                continue
            if item[0] is Wake.MESSAGE and isinstance(item[2], Fatal):
                verdict = item[2].exception()
                break
            if item[0] in (Wake.ENQUEUE, Wake.STOP):
                keep.append(item)
                if item[0] is Wake.STOP:
                    break
        for item in keep:
            self._inbox.put(item)
        return verdict

    def _close(self, error: BaseException) -> None:
        """Refuse new operations with ``error`` and fail every one in flight with it."""
        with self._control():
            if self._refuse is None:
                self._refuse = error
            self._closed = True
            self._going_normal()  # for good: no rank waits for this one on the lane
            if self._posted is not None:
                self.lane.withdraw()
                self._posted = None
            self._ready.clear()
            pending, self._pending = self._pending, {}
            for entry in pending.values():
                self._done(entry.handle, error=_clone(error))
            keep = []
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] is Wake.ENQUEUE:
                    self._queued.discard(item[1].request.key)
                    self._done(item[1].handle, error=_clone(error))
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

    def _broadcast(self, msg: Message) -> None:
        if self.size == 1:
            return
        payload = encode(msg)
        gone = self.coordinator.gone if self.coordinator is not None else {}
        for dst in range(self.size):
            if dst == self.rank or dst in gone:
                continue
            try:
                self.transport.send_ctrl(payload, dst)
            except RingflowError as exc:
                log.debug("rank 0: could not send %s to %d: %s", type(msg).__name__, dst, exc)

    def _beat(self) -> None:
        """The liveness thread: a heartbeat to the other side, the verdict on a silent peer
        (here, since the engine thread may be blocked in a data-plane wait that only this
        verdict ends), a tick for the engine thread; the timeline's clock probes (rank 0) or
        records (other ranks)."""
        tl = self._timeline
        if tl is not None:
            tl.beat()
        if self.coordinator is not None:
            self._broadcast(Heartbeat())
        else:
            self._send(self.coord, Heartbeat())
        silent = self._liveness.silent()
        if silent is not None and silent[0] not in self._peer_errors and not self._closed:
            self._on_peer_failure(*silent)
        self._inbox.put((Wake.TICK,))

    # plans -------------------------------------------------------------------------------------
    def _members(self, ps: int) -> list[int]:
        return self.process_sets.get(ps, [])

    def _receive(self, plan: list[Response | CachedAllreduce]) -> None:
        """Take in a plan (every rank, in plan order): book-keeping now, execution in order."""
        if fault.ARMED:
            fault.hit("plan")
        queued = False
        for item in plan:
            result = None
            if isinstance(item, CachedAllreduce):
                refs = tuple(self.cache.ref[b] for b in item.bits)
                result = item.result
                # cached items never carry joined ranks
                resp = Response("allreduce", refs[0].process_set, refs, joined=(),
                                wire=item.wire, chunk=item.chunk)
            else:
                resp = item
                mine = {r.key: self._submitted.get(r.key) for r in item.requests}
                self.cache.record(item, mine.get)
            resp = on_the_wire(resp)
            for r in resp.requests:
                self._submitted.pop(r.key, None)
            if self._timeline is not None:
                for r in resp.requests:
                    self._timeline.planned(r.key)
            members = self.process_sets.get(resp.process_set)
            if resp.kind == "add_process_set" and not resp.error:
                self.process_sets[resp.value] = list(resp.requests[0].shape)
            elif resp.kind == "remove_process_set" and not resp.error:
                self.process_sets.pop(resp.requests[0].root, None)
                self.executor.forget(resp.requests[0].root)
                if self.coordinator is not None:
                    self.coordinator.rescan()  # its pending names fail now
            if not resp.error and resp.kind != "join" and (
                (members is None and resp.kind != "remove_process_set")
                or (members is not None and self.rank not in members)
            ):
                continue  # not this rank's (it never submitted it)
            entries = [self._pending.get(r.key) for r in resp.requests]
            data_plane = collective(resp.kind).data and not resp.error and result is None
            if data_plane or self._ready:
                self._ready.append((resp, entries, data_plane, result))
                queued = True
            else:
                self._complete(resp, entries, None, result)
        if queued:
            self._inbox.put((Wake.RUN,))

    def _run_ready(self) -> None:
        """The engine thread: execute queued plan items in order, the data plane unlocked."""
        while True:
            with self._control():
                if not self._ready:
                    return
                resp, entries, data_plane, result = self._ready[0]
                if data_plane and self._timeline is not None:
                    for r in resp.requests:
                        self._timeline.started(r.key)
            nbytes = sum(e.request.nbytes for e in entries if e is not None) if fault.ARMED else 0
            if data_plane and fault.ARMED:
                fault.hit("data_start", nbytes)
            results = self.executor.run(resp, entries) if data_plane else None
            if data_plane and fault.ARMED:
                fault.hit("data_end", nbytes)
            with self._control():
                if self._closed:
                    return
                self._ready.popleft()
                self._complete(resp, entries, results, result)

    def _complete(self, resp: Response, entries: list[Entry | None], results: list | None,
                  result: np.ndarray | None) -> None:
        """Finish the handles of one plan item (under the lock)."""
        for r in resp.requests:
            self._pending.pop(r.key, None)
        tl = self._timeline
        if resp.kind == "join":
            entry = self._pending.pop((0, "join"), None)
            if entry is not None:
                self._done(entry.handle, resp.value)
                if tl is not None:
                    tl.completed((0, "join"), "join", 1)
            return
        if resp.error:
            for r, entry in zip(resp.requests, entries, strict=True):
                if entry is not None:
                    self._done(entry.handle, error=from_wire(resp.error_type, resp.error))
                    if tl is not None:
                        tl.completed(r.key, resp.kind, len(entries), resp.error)
            return
        if result is not None:
            results = unpack(result, resp.requests, entries)
            self.stats["eager"] += 1
        elif results is None:  # ops without data: barrier, process-set changes
            value = resp.value if resp.kind in ("add_process_set", "remove_process_set") else None
            results = [value] * len(entries)
        self.stats["collectives"] += 1
        self.stats["tensors"] += len(entries)
        for r, entry, value in zip(resp.requests, entries, results, strict=True):
            if entry is not None:
                if tl is not None:
                    tl.completed(r.key, resp.kind, len(entries))
                self._done(entry.handle, value)
        self._maybe_idle()


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


def _clone(error: BaseException) -> BaseException:
    """A fresh exception of the same class and text, so tracebacks do not pile up across waits."""
    try:
        return type(error)(*error.args)
    except Exception:
        return ShutdownError(str(error))


def _call(ref: weakref.ReferenceType, method: str, *args: Any) -> None:
    engine = ref()
    if engine is not None:
        getattr(engine, method)(*args)
