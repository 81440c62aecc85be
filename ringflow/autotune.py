"""The autotuner: the engine's tunable parameters, chosen online from the measured step rate.

``ringflow-run --autotune`` (``RINGFLOW_AUTOTUNE=1``; Horovod's ``--autotune`` and
``HOROVOD_AUTOTUNE=1`` are read as that) tunes, on rank 0, the values of :class:`Params`:

========================== ======================= =============================================
parameter                  default                 tried                          (who uses it)
========================== ======================= =============================================
``bucket_bytes``           4 MiB                   0 (no overlap), 1 MiB, 25 MiB  every rank's
                                                                                  optimizer
``fusion_threshold_bytes`` 128 MiB                 0, 8 MiB, 32 MiB               the coordinator
``chunk_bytes``            0 (the built-in 1 MiB)  256 KiB, 4 MiB                 each plan item
``cycle_time_ms``          1                       0.2, 5                         the coordinator
``wire_compression``       none                    ``--autotune-compression``     each plan item
                                                   only (fp16 or bf16)
========================== ======================= =============================================

A knob set in the environment (``RINGFLOW_FUSION_THRESHOLD_BYTES``, ``--fusion-threshold-mb``,
``HOROVOD_CYCLE_TIME``, ...) is the user's and stays as set (Horovod's "fixed" parameters).

**The score** is the step rate. A *step* is found without the framework's help, as Horovod finds
it: the coordinator plans the same names every step, so the first name larger than the eager
limit (64 KiB: such a name never takes the same-host lane, so rank 0 plans every instance of it)
that it plans a second time is the *marker*, and each plan that holds the marker again ends a
step. A *sample* is ``steps_per_sample`` steps (default 4) after one step that is not counted
(the step in flight when the values changed mixes both); its score is ``1 / median step time``
(robust to one slow step on a shared host).

**The search**: one parameter at a time, in the order of the table, each of its values is measured
with the others at the best so far, between two samples of the best (``B v1 B v2 B``), and scored
against the mean of the two: a drift of the host's load hits a value and its reference alike. The
value of the highest ratio replaces the best when that ratio exceeds ``1 + MARGIN`` (2%) and twice
the noise: the median change between the two samples of the best around each value so far (on a
shared host, samples of one setting moved by 10-30%; a value that only looks better by that much is
the load, not the value). Then, if the result differs from the start (the defaults, or what the user
fixed), the two alternate for three samples each (ABBAAB): the result is kept only if it beats the
start in each of the three adjacent pairs and its median by ``MARGIN``, else the start is. So the
tuner ends at the start's rate or above, short of noise that wins three interleaved pairs in a row
(1 in 8 for a setting no better). At the defaults (5 steps a sample) that is about 115 steps when
nothing beats the start and 175 at most when every parameter moves and compression is allowed
(tests/unit/test_autotune_search.py); then the engine drops the tuner, which costs nothing from
then on.

**Agreement.** Every value is decided by rank 0 and applied where ranks cannot disagree:
the fusion threshold and the cycle time are rank 0's alone (the coordinator plans for everyone);
the chunk size and the wire compression travel on each plan item (``Response.chunk``,
``.wire``; :func:`ringflow.negotiation.on_the_wire`), so every rank runs an item with the same
values, whenever it received the change; the bucket size travels with the plan (``Plan.params``)
and each rank's optimizer reads it when a backward pass starts (buckets need no agreement: they
decide only what is submitted together). A Request keeps the compression its call asked for, so
requests never disagree because of the tuner.

**Compression changes results**: 16-bit gradients round. The tuner tries it only when the user
allows one format (``--autotune-compression fp16``, ``RINGFLOW_AUTOTUNE_COMPRESSION``), and then
only on float32 Sum/Average allreduces of host arrays larger than 64 KiB whose call asked for no
compression (for a DistributedOptimizer: its large gradients; also any such allreduce of the
program). Chosen, it is pinned as ``RINGFLOW_WIRE_COMPRESSION``.

**The log** (``--autotune-log-file``, ``RINGFLOW_AUTOTUNE_LOG_FILE``, Horovod's
``HOROVOD_AUTOTUNE_LOG``), written by rank 0: CSV with the header ::

    step,phase,fusion_threshold_bytes,cycle_time_ms,bucket_bytes,chunk_bytes,wire_compression,steps_per_s

one row per sample (``phase``: ``warmup``, ``search``, ``confirm``), then a ``chosen`` row (its
``steps_per_s``: the median of its confirmation samples, or of its search sample), then one line
``# pin: RINGFLOW_...=... ...``: the variables that run later jobs with the chosen values (also
logged at INFO). Horovod's log has one row per score with its own columns (hierarchical and
cache switches, cycle time, fusion threshold, bytes per microsecond): ringflow has none of its
switches to tune, and scores steps, not bytes.

**Where it differs from Horovod's** (``horovod/common/parameter_manager.cc``,
``optim/bayesian_optimization.cc``): Horovod scores bytes reduced per microsecond over samples of
10 steps, takes the median of 5 samples per score after 3 warm-up scores, and explores fusion
threshold (0-64 MB) and cycle time (1-100 ms) jointly by Bayesian optimisation (a Gaussian
process, expected improvement, up to 20 scores), then its categorical switches one by one: some
1,350 steps at its defaults, and it ends at the best score it saw, a single noisy sample that the
start's may have beaten. Here: discrete values known to matter on this engine, one sample per
value, a confirmation against the start, about 140 steps; and no collective of its own (Horovod
broadcasts its parameters with a ``Bcast`` at the same response list on every rank; here they
ride on the plans).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from .config import Config

__all__ = ["MARGIN", "SPACE", "Params", "Tuner", "fixed_knobs"]

log = logging.getLogger(__name__)

_MIB = 1 << 20
#: A value must beat the best so far (and the result the start) by this fraction to be taken.
MARGIN = 0.02
#: What the search tries for each parameter (besides the start's value), in search order.
SPACE: dict[str, tuple[Any, ...]] = {
    "bucket_bytes": (0, _MIB, 25 * _MIB),
    "fusion_threshold_bytes": (0, 8 * _MIB, 32 * _MIB),
    "chunk_bytes": (256 * 1024, 4 * _MIB),
    "cycle_time_ms": (0.2, 5.0),
    "wire_compression": (),  # the format the user allowed, if any
}
#: Horovod's variables that fix a parameter when set.
_HOROVOD_FIXES = {"fusion_threshold_bytes": "HOROVOD_FUSION_THRESHOLD",
                  "cycle_time_ms": "HOROVOD_CYCLE_TIME"}
_CSV = ("step,phase,fusion_threshold_bytes,cycle_time_ms,bucket_bytes,chunk_bytes,"
        "wire_compression,steps_per_s")


@dataclasses.dataclass(frozen=True)
class Params:
    """The engine's tunable values (their meaning: :class:`ringflow.config.Config`)."""

    fusion_threshold_bytes: int
    cycle_time_ms: float
    bucket_bytes: int
    chunk_bytes: int
    wire_compression: str

    @classmethod
    def of(cls, config: Config) -> Params:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def pin(self) -> str:
        """The environment that runs a later job with these values."""
        return " ".join(f"RINGFLOW_{f.name.upper()}={getattr(self, f.name)}"
                        for f in dataclasses.fields(self))

    def row(self) -> str:
        return ",".join(str(getattr(self, f.name)) for f in dataclasses.fields(self))


def fixed_knobs(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The parameters the user set (in the environment, which ringflow-run's flags write)."""
    env = os.environ if environ is None else environ
    return frozenset(
        f.name for f in dataclasses.fields(Params)
        if env.get(f"RINGFLOW_{f.name.upper()}") or env.get(_HOROVOD_FIXES.get(f.name, "-")))


@dataclasses.dataclass
class _Trial:
    params: Params
    phase: str
    skip: int
    times: list[float] = dataclasses.field(default_factory=list)
    score: float = 0.0


class Tuner:
    """Rank 0's search (pure logic but for the log file): :meth:`planned` is told what each plan
    holds and answers with new values when the engine must switch to them."""

    def __init__(self, start: Params, *, allowed_compression: str = "none",
                 fixed: frozenset[str] = frozenset(), warmup_samples: int = 2,
                 steps_per_sample: int = 4, log_path: str = "", marker_bytes: int = 64 * 1024,
                 clock: Any = time.monotonic) -> None:
        self.start = start
        self.best = start
        self.per_sample = steps_per_sample
        self.marker_bytes = marker_bytes
        self._clock = clock
        self.space = {k: tuple(v for v in values if v != getattr(start, k))
                      for k, values in SPACE.items() if k not in fixed}
        if "wire_compression" in self.space and allowed_compression != "none" \
                and start.wire_compression == "none":
            self.space["wire_compression"] = (allowed_compression,)
        self.space = {k: v for k, v in self.space.items() if v}
        self.marker: Any = None
        self._seen: set[Any] = set()
        self._last: float | None = None
        self.steps = 0
        self.done = False
        self.chosen: Params | None = None
        self._queue: list[_Trial] = [_Trial(start, "warmup", 1)
                                     for _ in range(warmup_samples)]
        self._round: list[_Trial] = []  # the current parameter's trials, baseline first
        self._round_end: _Trial | None = None  # the previous round's last sample of the best
        self._dims = list(self.space)
        self._confirm: list[_Trial] = []
        self._current = start
        self._scores: dict[Params, float] = {}  # the last score of each values measured
        self._drift: list[float] = []  # |log| of the change between two samples of the best
        self._file: IO[str] | None = None
        if log_path:
            self._file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
            self._file.write(_CSV + "\n")
            self._file.flush()
        self._next_round()

    # input -------------------------------------------------------------------------------------
    def planned(self, names: Sequence[tuple[Any, int]]) -> Params | None:
        """The coordinator planned these (name, bytes); new values to switch to, or None."""
        if self.done:
            return None
        if self.marker is None:
            for name, nbytes in names:
                if nbytes > self.marker_bytes:
                    if name in self._seen:
                        self.marker = name
                        log.info("autotune: steps are counted at %r", name[1])
                        break
                    self._seen.add(name)
            if self.marker is None:
                return None
        elif not any(name == self.marker for name, _ in names):
            return None
        return self.step()

    def step(self, now: float | None = None) -> Params | None:
        """A step ended (the marker again)."""
        now = self._clock() if now is None else now
        last, self._last = self._last, now
        if last is None:
            return None
        self.steps += 1
        trial = self._queue[0]
        if trial.skip:
            trial.skip -= 1
            return None
        trial.times.append(now - last)
        if len(trial.times) < self.per_sample:
            return None
        trial.score = 1.0 / statistics.median(trial.times)
        self._write(trial.phase, trial.params, trial.score)
        self._queue.pop(0)
        if not self._queue:
            self._advance()
        if self.done:
            return self.chosen if self.chosen != self._current else None
        nxt = self._queue[0]
        if nxt.params != self._current:
            self._current = nxt.params
            return nxt.params
        nxt.skip = 0  # nothing changes: no step in flight mixes two settings
        return None

    # the search --------------------------------------------------------------------------------
    def _next_round(self) -> None:
        """Queue the next parameter's trials: each of its values between two samples of the
        best (B v1 B v2 B ...), so that each value is compared with the best measured just
        before and just after it: a drift of the host's load hits both alike."""
        if not self._dims:
            self._begin_confirmation()
            return
        dim = self._dims.pop(0)
        trials = [] if self._round_end is not None else [_Trial(self.best, "search", 1)]
        if self._round_end is not None:
            trials.append(self._round_end)  # the last sample of the best is this round's first
        for v in self.space[dim]:
            trials += [_Trial(dataclasses.replace(self.best, **{dim: v}), "search", 1),
                       _Trial(self.best, "search", 1)]
        self._round = trials
        self._queue += trials[1:] if self._round_end is not None else trials

    def _advance(self) -> None:
        if self._round:
            trials, self._round = self._round, []
            ratios = []
            for i in range(1, len(trials), 2):
                before, value, after = trials[i - 1], trials[i], trials[i + 1]
                base = (before.score + after.score) / 2
                ratios.append((value.score / base if base > 0 else 0.0, value))
                if before.score > 0 and after.score > 0:
                    self._drift.append(abs(math.log(after.score / before.score)))
            ratio, top = max(ratios, key=lambda rt: rt[0])
            if ratio > self.threshold():
                self.best, self._round_end = top.params, None
            else:
                self._round_end = trials[-1]
            self._next_round()
        elif self._confirm:
            trials, self._confirm = self._confirm, []
            starts = [t.score for t in trials if t.params == self.start]
            bests = [t.score for t in trials if t.params == self.best]
            # ABBAAB: three adjacent pairs; the result must win each, and by the margin overall.
            wins = sum(b > a for a, b in zip(starts, bests, strict=True))
            score = statistics.median(bests)
            if wins < len(bests) or score <= statistics.median(starts) * (1 + MARGIN):
                self.best, score = self.start, statistics.median(starts)
            self._finish(score)
        else:
            self._next_round()

    def threshold(self) -> float:
        """The ratio a value must beat to replace the best: ``1 + MARGIN``, or more where the
        best's own samples (two around each value) moved more than that: twice their median
        change, so that a value is not taken for what the host's load did meanwhile."""
        noise = statistics.median(self._drift) if self._drift else 0.0
        return max(1 + MARGIN, math.exp(2 * noise))

    def _begin_confirmation(self) -> None:
        if self.best == self.start:
            self._finish(self._last_score(self.start))
            return
        order = [self.start, self.best, self.best, self.start, self.start, self.best]
        self._confirm = [_Trial(p, "confirm", 1) for p in order]
        self._queue += self._confirm

    def _last_score(self, params: Params) -> float:
        return self._scores.get(params, 0.0)

    def _finish(self, score: float) -> None:
        self.done = True
        self.chosen = self.best
        self._write("chosen", self.best, score)
        if self._file is not None:
            self._file.write(f"# pin: {self.best.pin()}\n")
            self._file.close()
            self._file = None
        log.info("autotune: chose %s after %d steps (%.3g steps/s); pin it with %s",
                 self.best, self.steps, score, self.best.pin())

    # output ------------------------------------------------------------------------------------
    def _write(self, phase: str, params: Params, score: float) -> None:
        if phase != "chosen":
            self._scores[params] = score
            log.debug("autotune: %s %s: %.4g steps/s", phase, params, score)
        if self._file is not None:
            self._file.write(f"{self.steps},{phase},{params.row()},{score:.6g}\n")
            self._file.flush()

    def close(self) -> None:
        """The job ends before the tuner did (the log keeps what it measured)."""
        if self._file is not None:
            self._file.close()
            self._file = None
