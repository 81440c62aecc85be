"""How much of a step's gradient exchange was hidden under the backward pass.

An optimizer that submits gradients as they become ready (:mod:`ringflow.batching`) drives a
:class:`StepClock` through one step:

- :meth:`~StepClock.pass_started`: the first gradient of a backward pass is ready. Nothing can be
  submitted before it, so the window starts here (the rest of backward before it is
  irrelevant to what overlaps);
- :meth:`~StepClock.submitted`: an operation of the step starts; its end is taken from its handle
  (a done-callback, on the thread that completed it);
- :meth:`~StepClock.backward_ended`: the pass is over (torch: the autograd engine's final
  callback);
- :meth:`~StepClock.finish`: the step's exchange is complete (the optimizer's synchronize):
  its :class:`StepOverlap`.

The **exchange** is the time during which at least one of the step's operations was in flight
(the union of their ``[submitted, completed]`` spans: negotiation, queueing, data plane); the
**hidden** part is what of it falls inside ``[first gradient ready, end of backward]``. So
``hidden / exchange`` is the fraction of the exchange that the backward pass covered, and
``exchange - hidden`` is what the step waited for after backward (with one core per rank the
data plane's own work still takes CPU from backward: hiding it saves the waits -- for a peer, a
plan, a wake-up -- not the arithmetic). The optimizer keeps the last step's figures and the
timeline shows them (:mod:`ringflow.timeline`: a ``step`` row per rank, ``BACKWARD`` and
``EXPOSED`` spans and an ``exchange hidden`` counter).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

__all__ = ["StepClock", "StepOverlap", "hidden_time"]

_clock = time.perf_counter


@dataclasses.dataclass(frozen=True)
class StepOverlap:
    """One step's exchange against its backward pass (seconds, ``perf_counter`` times)."""

    start: float  # the first gradient of the last backward pass was ready
    backward_end: float  # that pass ended
    end: float  # every operation of the step had completed (synchronize returned)
    exchange_s: float  # time with an operation of the step in flight
    hidden_s: float  # of it, before backward_end
    operations: int
    early: int  # operations submitted before backward ended

    @property
    def fraction(self) -> float:
        """``hidden_s / exchange_s`` (1.0 for a step with no exchange)."""
        return self.hidden_s / self.exchange_s if self.exchange_s > 0 else 1.0

    def metrics(self) -> dict[str, Any]:
        """What the timeline shows, in milliseconds."""
        return {"exchange_ms": round(self.exchange_s * 1e3, 3),
                "hidden_ms": round(self.hidden_s * 1e3, 3),
                "exposed_ms": round((self.exchange_s - self.hidden_s) * 1e3, 3),
                "hidden": round(self.fraction, 4), "operations": self.operations,
                "early": self.early}


def hidden_time(spans: list[tuple[float, float]], start: float,
                end: float) -> tuple[float, float]:
    """(length of the union of ``spans``, the part of it within ``[start, end]``)."""
    total = hidden = 0.0
    lo = hi = None
    for a, b in sorted(spans):
        if hi is not None and a <= hi:
            hi = max(hi, b)
            continue
        if hi is not None:
            total += hi - lo
            hidden += max(0.0, min(hi, end) - max(lo, start))
        lo, hi = a, b
    if hi is not None:
        total += hi - lo
        hidden += max(0.0, min(hi, end) - max(lo, start))
    return total, hidden


class StepClock:
    """One optimizer's measurement of the step in progress (see the module doc)."""

    __slots__ = ("_end", "_ops", "_start")

    def __init__(self) -> None:
        self._start: float | None = None
        self._end: float | None = None
        self._ops: list[list[float | None]] = []

    def pass_started(self) -> None:
        self._start, self._end = _clock(), None

    def backward_ended(self) -> None:
        if self._end is None:
            self._end = _clock()

    def submitted(self, handle: Any) -> None:
        """An operation of this step (a ringflow Handle, or anything with ``core`` being one)."""
        core = getattr(handle, "core", handle)
        span: list[float | None] = [_clock(), None]
        self._ops.append(span)
        add = getattr(core, "add_done_callback", None)
        if add is not None:
            add(lambda _h: span.__setitem__(1, _clock()))

    def finish(self) -> StepOverlap | None:
        """The step's exchange is over: its figures (None without a backward pass), and a new
        step begins."""
        start, ops = self._start, self._ops
        now = _clock()
        end = self._end if self._end is not None else now
        self._start, self._end, self._ops = None, None, []
        if start is None:
            return None
        spans = [(a, b if b is not None else now) for a, b in ops]
        exchange, hidden = hidden_time(spans, start, end)
        early = sum(1 for a, _ in spans if a < end)
        return StepOverlap(start, end, now, exchange, hidden, len(spans), early)
