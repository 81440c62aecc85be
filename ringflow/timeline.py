"""The job's timeline: one Chrome-trace (Perfetto) file, written by rank 0, with every rank on
rank 0's clock.

Horovod's ``HOROVOD_TIMELINE`` is one file from rank 0; ringflow's is too, and it also shows
what each rank did, which Horovod's does not. Open it in https://ui.perfetto.dev or
``chrome://tracing``.

Layout (``pid`` = a track, ``tid`` = a row of it, one row per tensor name):

* ``rank r`` (``pid`` r), for each operation of the rank, one after the other on its row:

  - ``NEGOTIATE_<KIND>`` (``NEGOTIATE_ALLREDUCE``, ...): from the call to the moment the plan
    reached the rank; nested in it, ``WAIT_FOR_OTHER_RANKS``: until the last member's request
    reached the coordinator (what the rank waited for others; the rest is protocol latency and
    the fusion window);
  - ``<KIND>`` (``ALLREDUCE``, ...): from the plan to completion, ``args.fused`` the tensors that
    shared the collective; nested in it, ``QUEUE`` (behind earlier plan items on the engine
    thread) and ``DATA_PLANE`` (packing, the algorithm on the transport, unpacking). Operations
    without a data plane (barriers, small allreduces that the coordinator reduced itself, errors)
    have neither.
* ``coordinator`` (``pid`` = the job's size): ``NEGOTIATE_<KIND>`` from the first rank's request
  to the plan, with a tick per rank when its request arrived (named by the rank, as Horovod's
  ticks are): who was early, who was late.
* ``step`` (a row of each rank's track), for each step of a DistributedOptimizer
  (:mod:`ringflow.overlap`): ``BACKWARD`` from the first gradient ready to the end of the
  backward pass, ``args`` the step's exchange in milliseconds and the fraction of it that was
  hidden under backward (``hidden``); ``EXPOSED`` from there until the step's last operation
  completed; and a counter ``exchange hidden`` (0-1) per rank, one value per step;
* metadata events on each rank's track: ``ringflow`` (``args.threads``: the rank's thread
  counts and where they come from, :mod:`ringflow.threads`) and ``process_labels``;
* ``CLOCK_SYNC`` instants on each rank's track: the clock offset used (``args.offset_us``, the
  rank's clock minus rank 0's) and the round trip it was measured with.

**Clock.** Each rank records ``time.perf_counter()``. Rank 0 estimates each rank's offset the
NTP way: a ``ClockProbe`` carries rank 0's time ``t0``; the rank answers at once with its time
``t``; rank 0 reads ``t1`` on arrival: ``offset = t - (t0 + t1) / 2``, wrong by at most half the
round trip ``t1 - t0``. Of a burst of :data:`PROBES` at the start, then one per heartbeat, the
sample of the smallest round trip among the last :data:`WINDOW` is used (on loopback TCP: ~50 us
round trips, so events of different ranks are ordered to within ~25 us). Ranks of one host share
the clock (offset ~0); other hosts' clocks are measured, not assumed.

**Transport of events.** Ranks other than 0 keep compact records of their finished operations
and send them to rank 0 (``TraceEvents``) with each heartbeat (every ``min(1 s, timeout_s / 4)``),
when 256 have piled up, and, marked last, when they stop the timeline or shut down; rank 0 waits
up to :data:`FINAL_WAIT_S` for those last ones when it closes the file, and for the first answer
of any rank it has not heard from (which says whether that rank records). Every event is a complete
(``X``) or instant (``i``) event, so a file is valid trace-event JSON even when a rank died
before sending its last records; the file is one JSON object per line inside an array, flushed
as written, so a crashed job's trace opens too. Records wait at rank 0 until their rank's clock
offset is known (the first burst: milliseconds).

Recording costs a few dictionary operations per operation on each rank and nothing when the
timeline is off. Start it with ``RINGFLOW_TIMELINE_PATH`` / ``HOROVOD_TIMELINE`` /
``ringflow-run --timeline-filename`` (every rank), or :func:`ringflow.start_timeline` called on
every rank (the path counts on rank 0; a rank that does not record has no track, and still its
ticks on the coordinator's).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from . import threads
from .messages import ClockProbe, ClockReply, TraceEvents
from .requests import Key

__all__ = ["FINAL_WAIT_S", "PROBES", "WINDOW", "Timeline", "TraceWriter", "answer_probe",
           "rank_metadata"]

#: Probes in the first burst to each rank (one after the other), and the samples kept after.
PROBES = 8
WINDOW = 32
#: How long rank 0 waits, when it closes the file, for the last records of the other ranks.
#: A rank on a loaded host can take seconds to reach its stop (2 s lost a rank's records in CI's
#: suite); only a rank that died without sending them costs the whole wait.
FINAL_WAIT_S = 10.0
#: Records a rank keeps before it sends them without waiting for the heartbeat.
_SEND_AT = 256
#: Readiness times kept per tensor name, to find the one of a rank's operation.
_READY_KEPT = 64

_clock: Callable[[], float] = time.perf_counter  # tests shift one rank's clock


def clock() -> float:
    """This rank's timeline clock (what :meth:`Timeline.span` takes)."""
    return _clock()

#: A finished operation: (process set, name, kind, called, planned, data plane start or None,
#: done, tensors fused, error text); or an optimizer's step: ("step", first gradient ready,
#: backward's end, exchange's end, metrics).
Record = tuple[int, str, str, float, float, float | None, float, int, str] | tuple[
    str, float, float, float, dict] | tuple[str, str, str, float, float]


def rank_metadata() -> dict[str, Any]:
    """What this process's track says about it: its thread plan (:mod:`ringflow.threads`)."""
    plan = threads.current()
    return {"threads": plan.metadata()} if plan is not None else {}


def answer_probe(probe: ClockProbe, recording: bool) -> ClockReply:
    """A rank's answer to rank 0's probe: its clock, now."""
    return ClockReply(probe.t, _clock(), recording)


class Timeline:
    """One rank's recorder; rank 0's also writes the file (:class:`TraceWriter`).

    The engine calls the operation hooks under its control lock; :meth:`on_message` runs on
    transport reader threads and :meth:`beat` on the heartbeat thread.
    """

    def __init__(self, path: str, rank: int, size: int,
                 send: Callable[[int, Any], None]) -> None:
        self.rank = rank
        self._send = send
        self._lock = threading.Lock()
        self._open: dict[Key, list[Any]] = {}  # key -> [called, planned, started]
        self._records: list[Record] = []
        self.writer = TraceWriter(path, size, send) if rank == 0 else None
        if rank != 0:  # rank 0 waits for this rank's last records; the metadata goes first
            send(0, TraceEvents([], False, rank_metadata()))

    # operations (under the engine's lock) -----------------------------------------------------
    def submitted(self, key: Key) -> None:
        self._open[key] = [_clock(), None, None]

    def planned(self, key: Key) -> None:
        times = self._open.get(key)
        if times is not None and times[1] is None:
            times[1] = _clock()

    def started(self, key: Key) -> None:
        times = self._open.get(key)
        if times is not None:
            times[2] = _clock()

    def completed(self, key: Key, kind: str, fused: int, error: str = "") -> None:
        times = self._open.pop(key, None)
        if times is None:  # submitted before this timeline started
            return
        now = _clock()
        self._add((key[0], key[1], kind, times[0], times[1] or now, times[2], now, fused, error))

    def step(self, overlap: Any) -> None:
        """An optimizer's step (:class:`ringflow.overlap.StepOverlap`)."""
        self._add(("step", overlap.start, overlap.backward_end, overlap.end, overlap.metrics()))

    def span(self, row: str, label: str, start: float, end: float) -> None:
        """A span of work outside the engine on row ``row`` (the compressed exchange's
        COMPRESS / EXCHANGE / DECOMPRESS, :mod:`ringflow.compressed`); times of :func:`clock`."""
        self._add(("span", row, label, start, end))

    def _add(self, record: Record) -> None:
        if self.writer is not None:
            self.writer.records(0, [record])
            return
        with self._lock:
            self._records.append(record)
            full = len(self._records) >= _SEND_AT
        if full:
            self._ship(False)

    # the coordinator (rank 0) ------------------------------------------------------------------
    def arrived(self, src: int, requests: Sequence[Any], bits: Sequence[int], cache: Any) -> None:
        """``src``'s requests reached the coordinator (full ones, and cache bits)."""
        if self.writer is not None:
            keys = [(r.key, r.kind) for r in requests]
            keys += [(cache.key_of[b], cache.ref[b].kind) for b in bits]
            self.writer.arrived(src, keys)

    def negotiated(self, items: Sequence[Any], cache: Any) -> None:
        """The coordinator planned ``items`` (Responses and CachedAllreduces)."""
        if self.writer is None:
            return
        keys = []
        for item in items:
            if hasattr(item, "bits"):
                keys += [(cache.key_of[b], "allreduce") for b in item.bits]
            else:
                keys += [(r.key, item.kind) for r in item.requests]
        self.writer.negotiated(keys)

    # messages, heartbeats, the end -------------------------------------------------------------
    def on_message(self, src: int, msg: Any) -> None:
        if isinstance(msg, ClockProbe):
            self._send(src, answer_probe(msg, True))
        elif self.writer is not None:
            self.writer.on_message(src, msg)

    def beat(self) -> None:
        if self.writer is not None:
            self.writer.probe_all()
        else:
            self._ship(False)

    def close(self) -> None:
        """Stop recording: send the last records (rank 0: finish the file)."""
        if self.writer is not None:
            self.writer.close(FINAL_WAIT_S)
        else:
            self._ship(True)

    def _ship(self, last: bool) -> None:
        with self._lock:
            records, self._records = self._records, []
        if records or last:
            self._send(0, TraceEvents(records, last))


class _Clock:
    """Rank 0's estimate of one rank's clock offset (see the module doc)."""

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)
        self.count = 0
        self.best: tuple[float, float] | None = None  # (round trip, offset)

    def add(self, rtt: float, offset: float) -> bool:
        """Add a sample; whether the estimate changed."""
        self.samples.append((rtt, offset))
        self.count += 1
        best = min(self.samples)
        changed = best != self.best
        self.best = best
        return changed

    @property
    def offset(self) -> float:
        return self.best[1] if self.best is not None else 0.0


class TraceWriter:
    """Rank 0: the file, the other ranks' clocks, and the coordinator's view."""

    def __init__(self, path: str, size: int, send: Callable[[int, Any], None]) -> None:
        self.path = path
        self.size = size
        self._send = send
        self._cond = threading.Condition()
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._file.write("[\n")
        self._t0 = _clock()
        self._rows: dict[tuple[int, str], int] = {}
        self._clocks: dict[int, _Clock] = {r: _Clock() for r in range(1, size)}
        self._held: dict[int, list[Record]] = {r: [] for r in range(1, size)}
        self._arrivals: dict[Key, list[float]] = {}  # first and last request at the coordinator
        self._ready: dict[Key, collections.deque[float]] = {}
        self.recording: set[int] = set()
        self.finished: set[int] = set()
        with self._cond:
            for r in range(size):
                self._meta(r, "process_name", {"name": f"rank {r}"})
                self._meta(r, "process_sort_index", {"sort_index": r})
            self.metadata(0, rank_metadata())
            self._meta(size, "process_name", {"name": "coordinator (negotiation, rank 0)"})
            self._meta(size, "process_sort_index", {"sort_index": size})
            self._instant(0, 0, "CLOCK_SYNC", self._t0, {"offset_us": 0.0, "rtt_us": 0.0})
            self._flush()
        for r in range(1, size):
            send(r, ClockProbe(_clock()))

    # input -------------------------------------------------------------------------------------
    def records(self, rank: int, records: Sequence[Record]) -> None:
        with self._cond:
            clock = self._clocks.get(rank)
            if clock is not None and clock.count < PROBES:
                self._held[rank].extend(records)
                return
            offset = clock.offset if clock is not None else 0.0
            for record in records:
                self._record(rank, record, offset)
            self._flush()

    def metadata(self, rank: int, meta: dict[str, Any]) -> None:
        """Rank ``rank``'s metadata (:func:`rank_metadata`): ``ringflow`` metadata events on its
        track, and its thread count among the track's labels."""
        with self._cond:
            threads = meta.get("threads")
            if threads:
                n = threads["threads"]
                self._meta(rank, "process_labels", {"labels": f"{n} thread{'s' * (n != 1)}"})
            self._meta(rank, "ringflow", meta)
            self._flush()

    def arrived(self, src: int, keys: Sequence[tuple[Key, str]]) -> None:
        now = _clock()
        with self._cond:
            for key, kind in keys:
                times = self._arrivals.setdefault(key, [now, now])
                times[1] = now
                self._instant(self.size, self._row(self.size, key[1]), str(src), now,
                              {"rank": src, "kind": kind})
            self._flush()

    def negotiated(self, keys: Sequence[tuple[Key, str]]) -> None:
        now = _clock()
        with self._cond:
            for key, kind in keys:
                times = self._arrivals.pop(key, None)
                if times is None:
                    continue
                self._complete(self.size, self._row(self.size, key[1]),
                               f"NEGOTIATE_{kind.upper()}", times[0], now, {})
                self._ready.setdefault(key, collections.deque(maxlen=_READY_KEPT)).append(
                    times[1])
            self._flush()

    def on_message(self, src: int, msg: Any) -> None:
        if isinstance(msg, ClockReply):
            self._on_reply(src, msg)
        elif isinstance(msg, TraceEvents):
            with self._cond:
                self.recording.add(src)
                if msg.last:
                    self.finished.add(src)
                else:
                    self.finished.discard(src)
                self._cond.notify_all()
            if msg.meta:
                self.metadata(src, msg.meta)
            if msg.records:
                self.records(src, msg.records)

    def _on_reply(self, src: int, reply: ClockReply) -> None:
        now = _clock()
        clock = self._clocks.get(src)
        if clock is None:
            return
        rtt = now - reply.t
        offset = reply.t_peer - (reply.t + now) / 2
        with self._cond:
            if self._file is None:
                return
            if reply.recording:
                self.recording.add(src)
            changed = clock.add(rtt, offset)
            self._cond.notify_all()  # close() may wait for this rank's first answer
            burst = clock.count < PROBES
            if clock.count == PROBES or (changed and not burst):
                rtt_best, off = clock.best or (rtt, offset)
                self._instant(src, 0, "CLOCK_SYNC", now, {
                    "offset_us": round(off * 1e6, 3), "rtt_us": round(rtt_best * 1e6, 3),
                    "samples": clock.count})
            if clock.count == PROBES:
                held, self._held[src] = self._held[src], []
                for record in held:
                    self._record(src, record, clock.offset)
            self._flush()
        if burst:
            self._send(src, ClockProbe(_clock()))

    def probe_all(self) -> None:
        """One probe to each rank whose first burst is over (the heartbeat)."""
        for rank, clock in self._clocks.items():
            if clock.count >= PROBES:
                self._send(rank, ClockProbe(_clock()))

    def _waiting(self) -> bool:
        """Whether a rank may still send records: it records and has not sent its last ones, or
        it has not been heard from at all (its answer to the first probe says whether it
        records: a rank that started recording before rank 0 did announced it to nobody)."""
        return bool(self.recording - self.finished) or any(
            c.count == 0 and r not in self.recording for r, c in self._clocks.items())

    def close(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for every recording rank's last records; finish the file."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._waiting() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._file is None:
                return
            for rank, held in self._held.items():
                for record in held:
                    self._record(rank, record, self._clocks[rank].offset)
                held.clear()
            self._file.write(json.dumps({"name": "trace_end", "ph": "i", "s": "g", "pid": 0,
                                         "tid": 0, "ts": self._us(_clock())}) + "\n]\n")
            self._file.close()
            self._file = None

    # output (under the condition's lock) -------------------------------------------------------
    def _record(self, rank: int, record: Record, offset: float) -> None:
        if record[0] == "step":
            self._step(rank, record, offset)
            return
        if record[0] == "span":
            _, row, label, start, end = record
            start, end = (max(t - offset, self._t0) for t in (start, end))
            self._complete(rank, self._row(rank, row), label, start, end, {})
            return
        ps, name, kind, called, planned, started, done, fused, error = record
        # Before the file was started (another rank's first call, made before rank 0 was up)
        # counts from its start: a trace's times are never negative.
        called, planned, done = (max(t - offset, self._t0) for t in (called, planned, done))
        row = self._row(rank, name)
        op = kind.upper()
        self._complete(rank, row, f"NEGOTIATE_{op}", called, planned, {})
        ready = self._ready_time((ps, name), called, planned)
        if ready is not None and ready > called:
            self._complete(rank, row, "WAIT_FOR_OTHER_RANKS", called, min(ready, planned), {})
        args: dict[str, Any] = {"fused": fused}
        if error:
            args["error"] = error
        self._complete(rank, row, op, planned, done, args)
        if started is not None:
            started = max(started - offset, self._t0)
            if started > planned:
                self._complete(rank, row, "QUEUE", planned, started, {})
            self._complete(rank, row, "DATA_PLANE", max(started, planned), done, {"fused": fused})

    def _step(self, rank: int, record: Record, offset: float) -> None:
        _, start, backward_end, end, metrics = record
        start, backward_end, end = (max(t - offset, self._t0) for t in (start, backward_end, end))
        row = self._row(rank, "step")
        self._complete(rank, row, "BACKWARD", start, backward_end, metrics)
        if end > backward_end:
            self._complete(rank, row, "EXPOSED", backward_end, end,
                           {"exposed_ms": metrics["exposed_ms"]})
        self._emit({"name": "exchange hidden", "ph": "C", "pid": rank, "ts": self._us(end),
                    "args": {"hidden": metrics["hidden"]}})

    def _ready_time(self, key: Key, called: float, planned: float) -> float | None:
        """When ``key`` became ready at the coordinator, for an operation of this span."""
        slack = 1e-3  # clock error: half a round trip, far below this
        for t in reversed(self._ready.get(key, ())):
            if called - slack <= t <= planned + slack:
                return t
        return None

    def _row(self, pid: int, name: str) -> int:
        row = self._rows.get((pid, name))
        if row is None:
            row = self._rows[(pid, name)] = len(self._rows) + 1
            self._meta(pid, "thread_name", {"name": name}, row)
        return row

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _meta(self, pid: int, name: str, args: dict, tid: int = 0) -> None:
        self._emit({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args})

    def _complete(self, pid: int, tid: int, name: str, start: float, end: float,
                  args: dict) -> None:
        ts = self._us(start)  # the end rounded as the start is: adjacent spans never overlap
        self._emit({"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
                    "dur": round(max(self._us(end) - ts, 0.0), 3), "args": args})

    def _instant(self, pid: int, tid: int, name: str, t: float, args: dict) -> None:
        self._emit({"name": name, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": self._us(t),
                    "args": args})

    def _emit(self, event: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()
