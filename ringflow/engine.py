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
   once; other items are completed or queued for the engine thread, which packs the tensors into
   a reusable fusion buffer of the wire dtype (casting compresses), runs the algorithm, unpacks
   (casting decompresses) and completes the handles.

Handles are completed after the lock is released, so a done-callback may call back into ringflow.

Failures: a plan item that carries an error fails its handles on every rank with the same class
and text. A fatal condition (a peer died or went silent for ``timeout_s``, a stall past
``stall_shutdown_s``, a data-plane error) is reported to the coordinator, which broadcasts one text
that every rank uses; every pending handle fails with it and later calls raise ShutdownError
naming it. Only the engine thread acts on failures; other threads pass them on through its inbox.
A heartbeat thread exchanges a small message between each rank and rank 0 every
``min(1 s, timeout_s / 4)``, so a frozen process is found even while nothing is pending.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import algorithms, errors
from .config import Config
from .errors import PeerError, RingflowError, ShutdownError
from .handles import Handle
from .negotiation import EAGER_BYTES, CachedAllreduce, Coordinator, Request, Response, ResponseCache
from .ops import DTYPES, ReduceOp, scale_into
from .timeline import Timeline, path_for_rank
from .transport import Subset

__all__ = ["Engine", "Entry"]

log = logging.getLogger(__name__)

Key = tuple[int, str]

# How long the waiter of an operation submitted while the engine was idle polls before sleeping.
_LONE_SPIN_S = 100e-6

# Plan items that move data through the transport; everything else completes from the plan alone.
_DATA_OPS = frozenset({"allreduce", "allgather", "broadcast", "alltoall", "reducescatter"})


class Entry:
    """A tensor handed to the engine: its request, input, optional output, and handle."""

    __slots__ = ("array", "handle", "out", "request")

    def __init__(self, request: Request, array: np.ndarray | None, out: Any, handle: Handle):
        self.request = request
        self.array = array
        self.out = out
        self.handle = handle


class Engine:
    def __init__(self, rank: int, size: int, transport: Any, config: Config) -> None:
        self.rank = rank
        self.size = size
        self.transport = transport
        self.config = config
        self.process_sets: dict[int, list[int]] = {0: list(range(size))}
        self.cache = ResponseCache(config.cache_capacity)
        self.coordinator = (
            Coordinator(size, self._members, config.fusion_threshold_bytes, self.cache)
            if rank == 0 else None
        )
        # collectives: plan items completed (fused tensors count once); eager: those of them that
        # rank 0 reduced itself (see negotiation.EAGER_BYTES).
        self.stats = {"collectives": 0, "tensors": 0, "bits_sent": 0, "requests_sent": 0,
                      "eager": 0}
        # Everything below is control state, guarded by _lock, except _inbox (the engine
        # thread's queue) and _fatal (written by the engine thread only).
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _control() blocks in the thread holding _lock
        self._finished: list[tuple[Handle, Any, BaseException | None]] = []
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._queued: set[Key] = set()  # entries in the inbox not yet accepted
        self._pending: dict[Key, Entry] = {}
        self._submitted: dict[Key, Request] = {}
        # Plan items for the engine thread, in plan order: (item, entries, transport, result).
        self._ready: collections.deque[tuple[Response, list, Any, Any]] = collections.deque()
        self._fusion: dict[str, np.ndarray] = {}
        self._subsets: dict[int, Any] = {}
        self._fatal: BaseException | None = None
        self._failure: tuple[BaseException, bool] | None = None  # to act on: (error, report)
        # Once set, enqueue() fails at once with this error; once _closed, nothing new is
        # accepted or planned (both set under _lock, so nothing slips in behind the final drain).
        self._refuse: BaseException | None = None
        self._closed = False
        self._last_heard: dict[int, float] = {}
        self._hb_interval = min(1.0, config.timeout_s / 4)
        self._timeline: Timeline | None = None
        if config.timeline_path:
            self._set_timeline(config.timeline_path)
        self._stop_hb = threading.Event()
        if size > 1:
            now = time.monotonic()
            self._last_heard = {r: now for r in (range(1, size) if rank == 0 else [0])}
            ref = weakref.ref(self)
            transport.set_ctrl_handler(
                lambda src, payload: _call(ref, "_on_ctrl", src, payload),
                lambda peer, err: _call(ref, "_on_peer_failure", peer, err),
            )
        self._thread = threading.Thread(target=self._run, name=f"ringflow-engine-{rank}",
                                        daemon=True)
        self._thread.start()
        if size > 1:
            threading.Thread(target=_heartbeat, args=(ref, self._stop_hb, self._hb_interval),
                             name=f"ringflow-heartbeat-{rank}", daemon=True).start()

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """Hold the control lock; complete the handles finished inside once it is released."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                done: list = []
                if self._depth == 0:
                    done, self._finished = self._finished, []
        for handle, value, error in done:
            handle._finish(value, error)

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
                for entry in entries:
                    self._queued.add(entry.request.key)
                    self._inbox.put(("enqueue", entry))
            else:
                try:
                    self._submit_entries(entries)  # idle: no reason to wake another thread
                except Exception as exc:  # the engine thread fails the job (and these entries)
                    self._inbox.put(("error", exc))
        return [entry.handle for entry in entries]

    def shutdown(self) -> None:
        """Fail what is pending, stop the threads, and close the transport (with a goodbye)."""
        with self._control():
            if self._refuse is None:
                self._refuse = ShutdownError("ringflow has been shut down; call init() again")
        self._inbox.put(("stop",))
        self._thread.join(self.config.timeout_s)
        if self._timeline is not None:
            self._timeline.close()
        self._stop_hb.set()
        self.transport.close()

    def timeline(self, path: str | None) -> None:
        """Start writing the timeline to ``path`` (this rank's file), or stop with None."""
        with self._control():
            self._set_timeline(path)

    def _set_timeline(self, path: str | None) -> None:
        if self._timeline is not None:
            self._timeline.close()
        self._timeline = Timeline(path_for_rank(path, self.rank), self.rank) if path else None

    # callbacks from transport reader threads ---------------------------------------------------
    def _on_ctrl(self, src: int, payload: bytes) -> None:
        self._last_heard[src] = time.monotonic()
        msg = pickle.loads(payload)
        kind = msg[0]
        if kind == "hb":
            return
        if kind not in ("submit", "plan"):
            self._inbox.put(("ctrl", src, msg))  # fatal / abort: the engine thread's business
            return
        try:
            with self._control():
                if self._closed:
                    return
                if kind == "plan":
                    self._receive(msg[1])
                elif self.coordinator is not None:
                    self.coordinator.submit(src, msg[1], msg[2], msg[3])
                    self._plan()
        except Exception as exc:  # not this thread's to handle: the engine thread fails the job
            self._inbox.put(("error", exc))

    def _on_peer_failure(self, peer: int, error: BaseException) -> None:
        self._inbox.put(("peer", peer, error))

    # the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = self._next_items()
            stop = False
            departed: list[tuple] = []
            try:
                with self._control():
                    stop, departed = self._step(items)
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
        self._close(ShutdownError("ringflow was shut down while this op was pending"))

    def _next_items(self) -> list[tuple]:
        busy = self._pending or (self.coordinator is not None and self.coordinator.holding)
        wait = self.config.cycle_time_ms / 1000.0 if busy else self._hb_interval
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
            if kind == "enqueue":
                self._queued.discard(item[1].request.key)
                entries.append(item[1])
            elif kind == "ctrl":
                self._on_message(item[2])
            elif kind == "peer" and isinstance(item[2], ShutdownError):
                # A peer that shut down on purpose sent its last plans before its goodbye: they
                # are queued already; run them first (they may hold this rank's results).
                departed.append(item)
            elif kind == "peer":
                self._on_peer(item[1], item[2])
            elif kind == "error":
                exc = item[1]
                self._note_failure(exc if isinstance(exc, RingflowError) else ShutdownError(
                    f"internal error in the engine: {exc!r}"))
            elif kind == "stop":
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
        if self.coordinator is not None:
            self.coordinator.submit(0, requests, bits, data)
            self._plan()
        else:
            self._send(0, ("submit", requests, bits, data))

    def _accept(self, entry: Entry, requests: list[Request], bits: list[int],
                data: list[np.ndarray | None]) -> None:
        req = entry.request
        self._pending[req.key] = entry
        if self._timeline is not None:
            self._timeline.begin(req.name, f"NEGOTIATE_{req.op.upper()}")
        bit = None if req.error else self.cache.lookup(req)
        if bit is None:
            requests.append(req)
        else:
            bits.append(bit)
            data.append(_eager_input(entry))
        self._submitted[req.key] = req

    def _plan(self) -> None:
        """Rank 0: turn what is ready into a plan, send it to every rank and take it in here."""
        holding = self.coordinator.holding
        plan = self.coordinator.plan(self.config.cycle_time_ms / 1000.0)
        if plan:
            self._broadcast(("plan", plan))
            self._receive(plan)
        elif self.coordinator.holding and not holding:
            self._inbox.put(("tick",))  # the engine thread plans them when the window closes

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "fatal":
            self._note_failure(getattr(errors, msg[1])(msg[2]), report=False)
        elif kind == "abort" and self.coordinator is not None:
            self._note_failure(getattr(errors, msg[1])(msg[2]))

    def _on_peer(self, peer: int, error: BaseException) -> None:
        if isinstance(error, ShutdownError):
            if self.coordinator is not None:
                self.coordinator.rank_gone(peer, "it called shutdown()")
                self._plan()
            elif peer == 0:
                self._close(ShutdownError("rank 0 (the coordinator) has shut down"))
            return
        self._note_failure(error)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for peer, heard in self._last_heard.items():
            if now - heard > self.config.timeout_s:
                self._note_failure(PeerError(
                    f"rank {peer} has not responded for {now - heard:.1f} s: it is frozen or "
                    "overloaded (RINGFLOW_TIMEOUT_S sets this limit)"))
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
                self._broadcast(("fatal", type(error).__name__, str(error)))
            else:
                self._send(0, ("abort", type(error).__name__, str(error)))
                error = self._await_verdict(error)
        self._fatal = error
        log.error("ringflow: %s", error)
        self._close(error)

    def _await_verdict(self, error: BaseException) -> BaseException:
        """Give rank 0 a moment to announce the job's error, so every rank reports one text."""
        deadline = time.monotonic() + 1.0
        verdict = error
        keep = []  # entries and a stop: _close() fails the entries and keeps the stop
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            if item[0] == "ctrl" and item[2][0] == "fatal":
                verdict = getattr(errors, item[2][1])(item[2][2])
                break
            if item[0] in ("enqueue", "stop"):
                keep.append(item)
                if item[0] == "stop":
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
                if item[0] == "enqueue":
                    self._queued.discard(item[1].request.key)
                    self._done(item[1].handle, error=_clone(error))
                else:
                    keep.append(item)  # a "stop" must still stop the thread
            for item in keep:
                self._inbox.put(item)

    # messaging ---------------------------------------------------------------------------------
    def _send(self, dst: int, msg: tuple) -> None:
        try:
            self.transport.send_ctrl(pickle.dumps(msg, protocol=5), dst)
        except RingflowError as exc:
            log.debug("rank %d: could not send %s to %d: %s", self.rank, msg[0], dst, exc)

    def _broadcast(self, msg: tuple) -> None:
        if self.size == 1:
            return
        payload = pickle.dumps(msg, protocol=5)
        for dst in range(1, self.size):
            try:
                self.transport.send_ctrl(payload, dst)
            except RingflowError as exc:
                log.debug("rank 0: could not send %s to %d: %s", msg[0], dst, exc)

    def heartbeat(self) -> None:
        if self.coordinator is not None:
            self._broadcast(("hb",))
        else:
            self._send(0, ("hb",))

    # plans -------------------------------------------------------------------------------------
    def _members(self, ps: int) -> list[int]:
        return self.process_sets.get(ps, [])

    def _transport_for(self, ps: int) -> Any:
        if ps == 0:
            return self.transport
        sub = self._subsets.get(ps)
        if sub is None:
            sub = self._subsets[ps] = Subset(self.transport, self.process_sets[ps])
        return sub

    def _receive(self, plan: list[Response | CachedAllreduce]) -> None:
        """Take in a plan (every rank, in plan order): book-keeping now, execution in order."""
        queued = False
        for item in plan:
            result = None
            if isinstance(item, CachedAllreduce):
                refs = tuple(self.cache.ref[b] for b in item.bits)
                result = item.result
                # cached items never carry joined ranks
                resp = Response("allreduce", refs[0].process_set, refs, joined=())
            else:
                resp = item
                mine = {r.key: self._submitted.get(r.key) for r in item.requests}
                self.cache.record(item, mine.get)
            for r in resp.requests:
                self._submitted.pop(r.key, None)
            if self._timeline is not None:
                for r in resp.requests:
                    if r.key in self._pending:
                        self._timeline.end(r.name, f"NEGOTIATE_{r.op.upper()}")
            members = self.process_sets.get(resp.process_set)
            if resp.op == "add_process_set" and not resp.error:
                self.process_sets[resp.value] = list(resp.requests[0].shape)
            elif resp.op == "remove_process_set" and not resp.error:
                self.process_sets.pop(resp.requests[0].root, None)
                self._subsets.pop(resp.requests[0].root, None)
            if not resp.error and resp.op != "join" and (
                (members is None and resp.op != "remove_process_set")
                or (members is not None and self.rank not in members)
            ):
                continue  # not this rank's (it never submitted it)
            entries = [self._pending.get(r.key) for r in resp.requests]
            data_plane = resp.op in _DATA_OPS and not resp.error and result is None
            transport = self._transport_for(resp.process_set) if data_plane else None
            if data_plane or self._ready:
                self._ready.append((resp, entries, transport, result))
                queued = True
            else:
                self._complete(resp, entries, None, result)
        if queued:
            self._inbox.put(("run",))

    def _run_ready(self) -> None:
        """The engine thread: execute queued plan items in order, the data plane unlocked."""
        while True:
            with self._control():
                if not self._ready:
                    return
                resp, entries, transport, result = self._ready[0]
                if transport is not None and self._timeline is not None:
                    for r, e in zip(resp.requests, entries, strict=True):
                        if e is not None:
                            self._timeline.begin(r.name, r.op.upper(), fused=len(entries))
            results = self._collective(resp, entries, transport) if transport else None
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
        if resp.op == "join":
            entry = self._pending.pop((0, "join"), None)
            if entry is not None:
                self._done(entry.handle, resp.value)
            return
        if resp.error:
            cls = getattr(errors, resp.error_type, errors.RingflowError)
            for entry in entries:
                if entry is not None:
                    self._done(entry.handle, error=cls(resp.error))
            return
        if result is not None:
            results = _unpack(result, resp.requests, entries)
            self.stats["eager"] += 1
        elif results is None:  # ops without data: barrier, process-set changes
            value = resp.value if resp.op in ("add_process_set", "remove_process_set") else None
            results = [value] * len(entries)
        tl = self._timeline
        self.stats["collectives"] += 1
        self.stats["tensors"] += len(entries)
        for r, entry, value in zip(resp.requests, entries, results, strict=True):
            if entry is not None:
                if tl is not None:
                    if resp.op not in _DATA_OPS or result is not None:
                        tl.begin(r.name, r.op.upper(), fused=len(entries))
                    tl.end(r.name, r.op.upper())
                self._done(entry.handle, value)

    # execution (engine thread, no lock) -------------------------------------------------------
    def _collective(self, item: Response, entries: list[Entry | None], t: Any) -> list[Any]:
        op = item.op
        if op == "allreduce":
            return self._allreduce(t, item, entries)
        if op == "allgather":
            return self._allgather(t, item, entries)
        (entry,) = entries
        req = item.requests[0]
        if op == "broadcast":
            if entry is None:  # a joined rank relays the root's data (the root has not joined)
                out = np.empty(req.shape, DTYPES[req.dtype])
            else:
                out = _output(entry, req)
                if out is not entry.array:
                    np.copyto(out, entry.array)
            # root_rank is global; the transport of a process set counts ranks within the set
            root = self.process_sets[item.process_set].index(req.root)
            algorithms.broadcast(t, out.reshape(-1), root)
            return [out]
        if op == "alltoall":
            # Splits differ by rank: each rank sends by its own request, not the reference one.
            return [algorithms.alltoall(t, entry.array, list(entry.request.splits))]
        if op == "reducescatter":
            buf, wire = entry.array, req.wire_dtype  # casting to the wire dtype compresses
            if req.prescale != 1.0:
                buf = _scaled(buf, req.prescale, wire)
            elif buf.dtype != wire:
                buf = buf.astype(wire)
            out = algorithms.reducescatter(t, buf, ReduceOp(req.reduce_op), req.postscale)
            return [out.astype(entry.array.dtype, copy=False)]
        raise AssertionError(f"no data-plane execution for {op}")

    def _allreduce(self, t: Any, item: Response, entries: list[Entry | None]) -> list[Any]:
        refs = item.requests
        ref = refs[0]
        wire = ref.wire_dtype
        reduce_op = ReduceOp(ref.reduce_op)
        sizes = [math.prod(r.shape) for r in refs]
        total = sum(sizes)
        adasum = reduce_op == ReduceOp.ADASUM  # its own algorithm: always through a buffer
        # The ranks of one host reduce in shared memory (transport/shm.py), at every size.
        shm = None if adasum else getattr(t, "shm", None)
        e0 = entries[0]
        if (len(refs) == 1 and not adasum and e0 is not None and e0.array is not None
                and e0.array.dtype == wire):
            out = _output(e0, ref)
            if shm is not None:
                src = e0.array.reshape(-1)
                if ref.prescale != 1.0:
                    src = shm.input_view(total, wire)
                    scale_into(e0.array.reshape(-1), ref.prescale, src)
                shm.allreduce(src, out.reshape(-1), reduce_op, ref.postscale)
                return [out]
            if ref.prescale != 1.0:
                scale_into(e0.array, ref.prescale, out)
            elif out is not e0.array:
                np.copyto(out, e0.array)
            _allreduce_on(t, out.reshape(-1), reduce_op, ref.postscale)
            return [out]
        buf = shm.input_view(total, wire) if shm else self._fusion_buffer(wire, total)
        offset = 0
        for entry, n in zip(entries, sizes, strict=True):
            view = buf[offset:offset + n]
            if entry is None or entry.array is None:
                view.fill(0)
            elif ref.prescale != 1.0:
                scale_into(entry.array.reshape(-1), ref.prescale, view)
            else:
                np.copyto(view, entry.array.reshape(-1), casting="unsafe")
            offset += n
        if adasum:
            algorithms.adasum(t, buf, sizes)
            if ref.postscale != 1.0:
                scale_into(buf, ref.postscale, buf)
        elif shm is not None:
            shm.allreduce(buf, buf, reduce_op, ref.postscale)
        else:
            _allreduce_on(t, buf, reduce_op, ref.postscale)
        return _unpack(buf, refs, entries)

    def _allgather(self, t: Any, item: Response, entries: list[Entry | None]) -> list[Any]:
        refs = item.requests
        me = t.rank
        if len(refs) == 1 and entries[0] is not None:
            return [algorithms.allgather(t, entries[0].array, list(item.first_dims[0]))]
        row_bytes = [math.prod(r.shape[1:]) * DTYPES[r.dtype].itemsize
                     for r in refs]
        counts = [sum(d[m] * rb for d, rb in zip(item.first_dims, row_bytes, strict=True))
                  for m in range(t.size)]
        send = self._fusion_buffer(np.dtype(np.uint8), counts[me])
        offset = 0
        for entry, dims, rb in zip(entries, item.first_dims, row_bytes, strict=True):
            n = dims[me] * rb
            if entry is not None and n:
                send[offset:offset + n] = entry.array.reshape(-1).view(np.uint8)
            offset += n
        gathered = algorithms.allgather(t, send[:counts[me]].copy(), counts)
        outs = [np.empty((sum(d), *r.shape[1:]), DTYPES[r.dtype])
                for d, r in zip(item.first_dims, refs, strict=True)]
        flat = [o.reshape(-1).view(np.uint8) for o in outs]
        cursor = [0] * len(outs)
        offset = 0
        for m in range(t.size):
            for i, (dims, rb) in enumerate(zip(item.first_dims, row_bytes, strict=True)):
                n = dims[m] * rb
                flat[i][cursor[i]:cursor[i] + n] = gathered[offset:offset + n]
                cursor[i] += n
                offset += n
        return [o if e is not None else None for o, e in zip(outs, entries, strict=True)]

    def _fusion_buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        """A reused buffer of at least ``n`` elements of ``dtype`` (grown, never shrunk)."""
        buf = self._fusion.get(dtype.str)
        if buf is None or buf.size < n:
            buf = self._fusion[dtype.str] = np.empty(max(n, 1), dtype)
        return buf[:n]


def _allreduce_on(t: Any, buf: np.ndarray, op: ReduceOp, postscale: float) -> None:
    """The transport's own allreduce where it has one (mpi: MPI_Iallreduce), else the ring.

    Only the global process set's transport can have one: a Subset never does.
    """
    native = getattr(t, "allreduce", None)
    if native is not None:
        native(buf, op, postscale)
    else:
        algorithms.allreduce(t, buf, op, postscale)


def _output(entry: Entry, req: Request) -> np.ndarray:
    if entry.out is not None:
        return entry.out
    return np.empty(req.shape, entry.array.dtype if entry.array is not None else DTYPES[req.dtype])


def _scaled(array: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    out = np.empty(array.shape, dtype)
    scale_into(array, factor, out)
    return out


def _eager_input(entry: Entry) -> np.ndarray | None:
    """What this rank sends with a cache bit so that rank 0 can reduce the tensor itself: the
    prescaled tensor in its wire dtype, for allreduces of at most ``EAGER_BYTES``."""
    req, arr = entry.request, entry.array
    if (req.op != "allreduce" or arr is None or req.nbytes > EAGER_BYTES
            or req.reduce_op == ReduceOp.ADASUM):
        return None
    flat = arr.reshape(-1)
    wire = req.wire_dtype
    if req.prescale != 1.0:
        return _scaled(flat, req.prescale, wire)
    # No copy: a worker pickles it at once, and rank 0 reduces it before the handle can finish.
    return flat if flat.dtype == wire else flat.astype(wire)


def _unpack(result: np.ndarray, refs: tuple[Request, ...], entries: list[Entry | None]) -> list:
    """Each entry's output from the fused ``result`` (casting decompresses)."""
    outs: list[Any] = []
    offset = 0
    for r, entry in zip(refs, entries, strict=True):
        n = math.prod(r.shape)
        if entry is None:
            outs.append(None)
        else:
            out = _output(entry, r)
            np.copyto(out, result[offset:offset + n].reshape(r.shape), casting="unsafe")
            outs.append(out)
        offset += n
    return outs


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


def _heartbeat(ref: weakref.ReferenceType, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        engine = ref()
        if engine is None:
            return
        engine.heartbeat()
        engine._inbox.put(("tick",))
        del engine
