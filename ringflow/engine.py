"""The background engine: queue -> negotiate -> fuse -> compress -> execute -> complete.

One daemon thread per process owns all communication. Framework threads call :meth:`Engine.enqueue`
and get a :class:`~ringflow.handles.Handle` back at once. The thread wakes on every enqueue and
every control message (and at least every ``cycle_time_ms`` while work is pending), then:

1. sends this rank's new requests to the coordinator (rank 0) in one message — full requests for
   new names, bare cache bits for names whose request is unchanged (:mod:`ringflow.negotiation`);
2. on rank 0, feeds them to the :class:`~ringflow.negotiation.Coordinator` and broadcasts the
   resulting plan to every rank;
3. executes each plan item in order: packs the tensors into a reusable fusion buffer of the wire
   dtype (casting compresses), runs the algorithm, unpacks (casting decompresses), and completes
   the handles.

Failures: a plan item that carries an error fails its handles on every rank with the same class
and text. A fatal condition (a peer died or went silent for ``timeout_s``, a stall past
``stall_shutdown_s``, a data-plane error) is reported to the coordinator, which broadcasts one text
that every rank uses; every pending handle fails with it and later calls raise ShutdownError
naming it. A heartbeat thread exchanges a small message between each rank and rank 0 every
``min(1 s, timeout_s / 4)``, so a frozen process is found even while nothing is pending.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from . import algorithms, errors
from .config import Config
from .errors import PeerError, RingflowError, ShutdownError
from .handles import Handle
from .negotiation import CachedAllreduce, Coordinator, Request, Response, ResponseCache
from .ops import DTYPES, ReduceOp
from .timeline import Timeline, path_for_rank
from .transport import Subset

__all__ = ["Engine", "Entry"]

log = logging.getLogger(__name__)

Key = tuple[int, str]


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
        self.stats = {"collectives": 0, "tensors": 0, "bits_sent": 0, "requests_sent": 0}
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._pending: dict[Key, Entry] = {}
        self._submitted: dict[Key, Request] = {}
        self._fusion: dict[str, np.ndarray] = {}
        self._subsets: dict[int, Any] = {}
        self._fatal: BaseException | None = None
        # Once set, enqueue() fails at once with this error. Checked and set under _gate, and the
        # inbox is drained after setting it, so no entry can slip in behind the final drain.
        self._refuse: BaseException | None = None
        self._gate = threading.Lock()
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

    # framework side ----------------------------------------------------------------------------
    def enqueue(self, request: Request, array: np.ndarray | None = None, out: Any = None) -> Handle:
        handle = Handle(request.name)
        with self._gate:
            refuse = self._refuse
            if refuse is None:
                self._inbox.put(("enqueue", Entry(request, array, out, handle)))
        if refuse is not None:
            handle._finish(error=_clone(refuse))
        return handle

    def shutdown(self) -> None:
        """Fail what is pending, stop the threads, and close the transport (with a goodbye)."""
        with self._gate:
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
        self._inbox.put(("timeline", path))

    def _set_timeline(self, path: str | None) -> None:
        if self._timeline is not None:
            self._timeline.close()
        self._timeline = Timeline(path_for_rank(path, self.rank), self.rank) if path else None

    # callbacks from transport reader threads (must not block) ------------------------------------
    def _on_ctrl(self, src: int, payload: bytes) -> None:
        self._last_heard[src] = time.monotonic()
        msg = pickle.loads(payload)
        if msg[0] != "hb":
            self._inbox.put(("ctrl", src, msg))

    def _on_peer_failure(self, peer: int, error: BaseException) -> None:
        self._inbox.put(("peer", peer, error))

    # the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        wait = self.config.cycle_time_ms / 1000.0
        while True:
            try:
                item = self._inbox.get(timeout=wait if self._pending else self._hb_interval)
                items = [item]
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
            except queue.Empty:
                items = []
            try:
                if self._step(items):
                    break
            except RingflowError as exc:
                self._fail_job(exc)
            except Exception as exc:  # a bug must not leave handles hanging
                log.exception("ringflow engine failed")
                self._fail_job(ShutdownError(f"internal error in the engine: {exc!r}"))
        self._close(ShutdownError("ringflow was shut down while this op was pending"))

    def _step(self, items: list[tuple]) -> bool:
        """Handle one batch of inbox items. Returns True when the thread should stop."""
        requests: list[Request] = []
        bits: list[int] = []
        plans: list[list] = []
        departed: list[tuple] = []
        stop = False
        for item in items:
            kind = item[0]
            if kind == "enqueue":
                self._accept(item[1], requests, bits)
            elif kind == "ctrl":
                self._on_message(item[1], item[2], plans)
            elif kind == "peer" and isinstance(item[2], ShutdownError):
                # A peer that shut down on purpose sent its last plans before its goodbye:
                # execute them first (they may hold this rank's results or errors).
                departed.append(item)
            elif kind == "peer":
                self._on_peer(item[1], item[2])
            elif kind == "timeline":
                self._set_timeline(item[1])
            elif kind == "stop":
                stop = True
        if self._fatal is not None:
            return stop
        if requests or bits:
            self._submit(requests, bits)
        if self.coordinator is not None:
            plan = self.coordinator.plan()
            if plan:
                self._broadcast(("plan", plan))
                plans.append(plan)
        for plan in plans:
            self._execute(plan)
        for _, peer, error in departed:
            self._on_peer(peer, error)
        self._check_liveness()
        return stop

    def _accept(self, entry: Entry, requests: list[Request], bits: list[int]) -> None:
        req = entry.request
        if req.key in self._pending:
            why = (f"tensor {req.name!r} was submitted again while it was in flight; wait for "
                   "the first handle or use another name")
            entry.handle._finish(error=errors.TensorError(why))
            requests.append(_with_error(req, why))
            return
        self._pending[req.key] = entry
        if self._timeline is not None:
            self._timeline.begin(req.name, f"NEGOTIATE_{req.op.upper()}")
        bit = None if req.error else self.cache.lookup(req)
        if bit is None:
            requests.append(req)
        else:
            bits.append(bit)
        self._submitted[req.key] = req

    def _submit(self, requests: list[Request], bits: list[int]) -> None:
        self.stats["requests_sent"] += len(requests)
        self.stats["bits_sent"] += len(bits)
        if self.coordinator is not None:
            self.coordinator.submit(0, requests, bits)
        else:
            self._send(0, ("submit", requests, bits))

    def _on_message(self, src: int, msg: tuple, plans: list[list]) -> None:
        kind = msg[0]
        if kind == "submit" and self.coordinator is not None:
            self.coordinator.submit(src, msg[1], msg[2])
        elif kind == "plan":
            plans.append(msg[1])
        elif kind == "fatal":
            self._fail_job(getattr(errors, msg[1])(msg[2]), report=False)
        elif kind == "abort" and self.coordinator is not None:
            self._fail_job(getattr(errors, msg[1])(msg[2]))

    def _on_peer(self, peer: int, error: BaseException) -> None:
        if isinstance(error, ShutdownError):
            if self.coordinator is not None:
                self.coordinator.rank_gone(peer, "it called shutdown()")
            elif peer == 0:
                self._close(ShutdownError("rank 0 (the coordinator) has shut down"))
            return
        self._fail_job(error)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for peer, heard in self._last_heard.items():
            if now - heard > self.config.timeout_s:
                self._fail_job(PeerError(
                    f"rank {peer} has not responded for {now - heard:.1f} s: it is frozen or "
                    "overloaded (RINGFLOW_TIMEOUT_S sets this limit)"))
                return
        if self.coordinator is not None:
            warnings, fatal = self.coordinator.stalled(
                self.config.stall_warning_s, self.config.stall_shutdown_s)
            for text in warnings:
                log.warning("ringflow stall: %s", text)
            if fatal:
                self._fail_job(errors.StallError(fatal))

    # failure -----------------------------------------------------------------------------------
    def _fail_job(self, error: BaseException, report: bool = True) -> None:
        """Make ``error`` the job's fatal error on this rank (rank 0: on every rank)."""
        if self._fatal is not None:
            return
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
        with self._gate:
            if self._refuse is None:
                self._refuse = error
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            entry.handle._finish(error=_clone(error))
        keep = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "enqueue":
                item[1].handle._finish(error=_clone(error))
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

    # execution ---------------------------------------------------------------------------------
    def _members(self, ps: int) -> list[int]:
        return self.process_sets.get(ps, [])

    def _transport_for(self, ps: int) -> Any:
        if ps == 0:
            return self.transport
        sub = self._subsets.get(ps)
        if sub is None:
            sub = self._subsets[ps] = Subset(self.transport, self.process_sets[ps])
        return sub

    def _execute(self, plan: list[Response | CachedAllreduce]) -> None:
        for item in plan:
            if isinstance(item, CachedAllreduce):
                refs = tuple(self.cache.ref[b] for b in item.bits)
                item = Response("allreduce", refs[0].process_set, refs,
                                joined=())  # cached items never carry joined ranks
                self._run_item(item)
                continue
            mine = {r.key: self._submitted.get(r.key) for r in item.requests}
            self._run_item(item)
            self.cache.record(item, mine.get)

    def _run_item(self, item: Response) -> None:
        ps = item.process_set
        members = self.process_sets.get(ps)
        if item.op == "add_process_set" and not item.error:
            self.process_sets[item.value] = list(item.requests[0].shape)
        elif item.op == "remove_process_set" and not item.error:
            self.process_sets.pop(item.requests[0].root, None)
            self._subsets.pop(item.requests[0].root, None)
        entries = [self._pending.pop(r.key, None) for r in item.requests]
        for r in item.requests:
            self._submitted.pop(r.key, None)
        tl = self._timeline
        traced = [r for r, e in zip(item.requests, entries, strict=True) if e is not None]
        if tl is not None:
            for r in traced:
                tl.end(r.name, f"NEGOTIATE_{r.op.upper()}")
        if item.op == "join":
            entry = self._pending.pop((0, "join"), None)
            if entry is not None:
                entry.handle._finish(item.value)
            return
        if item.error:
            for entry in entries:
                if entry is not None:
                    entry.handle._finish(error=getattr(errors, item.error_type,
                                                       errors.RingflowError)(item.error))
            return
        if (members is None and item.op != "remove_process_set") or (
            members is not None and self.rank not in members
        ):
            return
        if tl is not None:
            for r in traced:
                tl.begin(r.name, r.op.upper(), fused=len(entries))
        try:
            results = self._collective(item, entries)
        except RingflowError:
            # A data-plane failure is the job's: back to pending, so that the handles fail with
            # the one text rank 0 announces (_fail_job), not with this rank's view of it.
            for req, entry in zip(item.requests, entries, strict=True):
                if entry is not None:
                    self._pending[req.key] = entry
            raise
        if tl is not None:
            for r in traced:
                tl.end(r.name, r.op.upper())
        self.stats["collectives"] += 1
        self.stats["tensors"] += len(entries)
        for entry, result in zip(entries, results, strict=True):
            if entry is not None:
                entry.handle._finish(result)

    def _collective(self, item: Response, entries: list[Entry | None]) -> list[Any]:
        op = item.op
        t = self._transport_for(item.process_set)
        if op == "allreduce":
            return self._allreduce(t, item, entries)
        if op == "allgather":
            return self._allgather(t, item, entries)
        (entry,) = entries
        req = item.requests[0]
        if op == "broadcast":
            out = _output(entry, req)
            if out is not entry.array:
                np.copyto(out, entry.array)
            algorithms.broadcast(t, out.reshape(-1), req.root)
            return [out]
        if op == "alltoall":
            # Splits differ by rank: each rank sends by its own request, not the reference one.
            return [algorithms.alltoall(t, entry.array, list(entry.request.splits))]
        if op == "reducescatter":
            buf = entry.array
            if req.prescale != 1.0:
                buf = _scaled(buf, req.prescale, buf.dtype)
            return [algorithms.reducescatter(t, buf, ReduceOp(req.reduce_op), req.postscale)]
        if op in ("add_process_set", "remove_process_set"):
            return [item.value]
        return [None]  # barrier

    def _allreduce(self, t: Any, item: Response, entries: list[Entry | None]) -> list[Any]:
        refs = item.requests
        ref = refs[0]
        wire = ref.wire_dtype
        reduce_op = ReduceOp(ref.reduce_op)
        sizes = [math.prod(r.shape) for r in refs]
        total = sum(sizes)
        # The ranks of one host reduce in shared memory (transport/shm.py), at every size.
        shm = getattr(t, "shm", None)
        e0 = entries[0]
        if len(refs) == 1 and e0 is not None and e0.array is not None and e0.array.dtype == wire:
            out = _output(e0, ref)
            if shm is not None:
                src = e0.array.reshape(-1)
                if ref.prescale != 1.0:
                    src = shm.input_view(total, wire)
                    np.multiply(e0.array.reshape(-1), ref.prescale, out=src, casting="unsafe")
                shm.allreduce(src, out.reshape(-1), reduce_op, ref.postscale)
                return [out]
            if ref.prescale != 1.0:
                np.multiply(e0.array, ref.prescale, out=out, casting="unsafe")
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
                np.multiply(entry.array.reshape(-1), ref.prescale, out=view, casting="unsafe")
            else:
                np.copyto(view, entry.array.reshape(-1), casting="unsafe")
            offset += n
        if shm is not None:
            shm.allreduce(buf, buf, reduce_op, ref.postscale)
        else:
            _allreduce_on(t, buf, reduce_op, ref.postscale)
        results: list[Any] = []
        offset = 0
        for entry, r, n in zip(entries, refs, sizes, strict=True):
            if entry is None:
                results.append(None)
            else:
                out = _output(entry, r)
                np.copyto(out, buf[offset:offset + n].reshape(r.shape), casting="unsafe")
                results.append(out)
            offset += n
        return results

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
    np.multiply(array, factor, out=out, casting="unsafe")
    return out


def _with_error(req: Request, why: str) -> Request:
    return dataclasses.replace(req, error=why)


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
