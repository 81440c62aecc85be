"""Metrics over every rank's samples, exact: :class:`Sum`, :class:`Mean`, :class:`Accuracy`.

Each rank updates a metric with its own samples (numbers, numpy arrays, or framework tensors:
anything with ``.numpy()``, after ``.detach().cpu()`` where those exist); :meth:`Metric.compute`
combines every rank's state and returns the same value on every rank. ``local()`` is this
rank's value alone.

Exactness: the result does not depend on how the samples were split among the ranks, nor on
their order, so it equals what the same metric computes in one process over all the samples,
bit for bit:

- counts (correct predictions, samples) are Python integers, and a ratio of two of them is
  Python's correctly rounded ``int / int``: an accuracy equals ``correct / total`` computed in
  one process to the last digit;
- float sums are exact: each float64 ``x = M * 2**(e - 53)`` (``M, e`` from ``frexp``) is
  added into one Python integer as ``M << (e + 1074)``, the sum scaled by ``2**1127`` (the
  smallest subnormal becomes ``1 << 1``), vectorised per exponent with numpy; the result is
  rounded once, by ``int / int``. NaN and infinities are summed apart (as floats) and win.

What a rank sends (``compute``, one ``allgather_object`` over ``process_set``): its integer sum
(at most ~2100 bits however many samples), its count and any non-finite sum; a few hundred bytes.

``compute`` is a collective: every rank of ``process_set`` calls it, in the same order. Alone
(one rank) or inside :func:`ringflow.single_process_scope` it is ``local()``, with no
communication. Under a launcher and before ``ringflow.init()`` it initialises ringflow.

Why this matters: torch's ``DistributedSampler`` pads the last shard by repeating samples, and
averaging per-rank accuracies weights ranks equally; either skews a global accuracy. With
``DistributedSampler(..., pad=False)`` (every sample on exactly one rank) and :class:`Accuracy`
the global accuracy is the single-process one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .process_sets import ProcessSet, global_process_set

__all__ = ["Accuracy", "Mean", "Metric", "Sum", "global_sum"]

#: ``x * 2**_SCALE`` is an integer for every finite float64 (the smallest subnormal is 2**-1074).
_SCALE = 1127
_LOW_BITS = 26  # a mantissa (< 2**53) is split in two parts that int64 sums cannot overflow


def _numpy(values: Any) -> np.ndarray:
    """``values`` as a numpy array; framework tensors through ``.detach().cpu().numpy()``."""
    if not isinstance(values, (np.ndarray, int, float, bool, Sequence)):
        for step in ("detach", "cpu", "numpy"):
            method = getattr(values, step, None)
            if callable(method):
                values = method()
    return np.asarray(values)


class _ExactSum:
    """An exact sum of numbers: an integer scaled by ``2**_SCALE``, plus a float of the
    non-finite values, plus the count of values and whether they were all integers."""

    def __init__(self) -> None:
        self.scaled = 0
        self.special = 0.0
        self.count = 0
        self.integral = True

    def add(self, values: Any) -> None:
        x = _numpy(values).reshape(-1)
        self.count += int(x.size)
        if x.dtype.kind in "biu":
            # Python ints, exact for any size (np.sum would wrap around past 2**63).
            self.scaled += int(sum(x.tolist())) << _SCALE
            return
        if x.dtype.kind != "f":
            raise TypeError(f"ringflow.metrics: cannot sum values of dtype {x.dtype}; pass "
                            "numbers (int, float or bool arrays or tensors)")
        self.integral = False
        x = x.astype(np.float64, copy=False)
        finite = np.isfinite(x)
        if not finite.all():
            self.special += float(np.sum(x[~finite]))
            x = x[finite]
        if not x.size:
            return
        mantissa, exponent = np.frexp(x)
        m = (mantissa * 2.0**53).astype(np.int64)  # exact: 53 significant bits
        shift = exponent.astype(np.int64) + (_SCALE - 53)
        order = np.argsort(shift, kind="stable")
        shift, m = shift[order], m[order]
        starts = np.flatnonzero(np.diff(shift, prepend=shift[0] - 1))
        high = np.add.reduceat(m >> _LOW_BITS, starts)
        low = np.add.reduceat(m & ((1 << _LOW_BITS) - 1), starts)
        for s, h, lo in zip(shift[starts].tolist(), high.tolist(), low.tolist(), strict=True):
            self.scaled += ((h << _LOW_BITS) + lo) << s

    def state(self) -> tuple[int, float, int, bool]:
        return self.scaled, self.special, self.count, self.integral

    @staticmethod
    def merge(states: Sequence[tuple[int, float, int, bool]]) -> _ExactSum:
        total = _ExactSum()
        for scaled, special, count, integral in states:
            total.scaled += scaled
            total.special += special
            total.count += count
            total.integral &= integral
        return total

    def ratio(self, denominator: int) -> float:
        """The sum divided by ``denominator``, rounded once (NaN for 0 / 0)."""
        if self.special != 0.0:  # an infinity, or NaN (which is != 0 too)
            return self.special / denominator if denominator else float("nan")
        if denominator == 0:
            return float("nan")
        try:
            return self.scaled / (denominator << _SCALE)  # correctly rounded
        except OverflowError:
            return float("inf") if self.scaled > 0 else float("-inf")


class Metric:
    """A metric each rank updates with its samples; :meth:`compute` gives the global value.

    ``process_set``: the ranks whose samples count (all by default).
    """

    def __init__(self, process_set: ProcessSet = global_process_set) -> None:
        self.process_set = process_set
        self.reset()

    def reset(self) -> None:
        raise NotImplementedError

    def _state(self) -> Any:
        raise NotImplementedError

    def _value(self, states: Sequence[Any]) -> Any:
        raise NotImplementedError

    def local(self) -> Any:
        """The value over this rank's samples only."""
        return self._value([self._state()])

    def compute(self) -> Any:
        """The value over every rank's samples, the same on every rank (a collective)."""
        from . import runtime
        from ._adapter import allgather_object
        from .single_process import in_single_process_scope

        if in_single_process_scope() or self.process_set.size() == 1:
            return self.local()
        if self.process_set is global_process_set:
            runtime.init()  # nothing to do when initialized
        states = allgather_object(self._state(), name="ringflow.metrics",
                                  process_set=self.process_set)
        return self._value(states)


class Sum(Metric):
    """The exact sum of every value given to :meth:`update`: an ``int`` when every value was an
    integer or bool, else a correctly rounded ``float``."""

    def reset(self) -> None:
        self._sum = _ExactSum()

    def update(self, values: Any) -> None:
        self._sum.add(values)

    def _state(self) -> Any:
        return self._sum.state()

    def _value(self, states: Sequence[Any]) -> int | float:
        total = _ExactSum.merge(states)
        if total.integral:
            return total.scaled >> _SCALE
        return total.ratio(1)


class Mean(Metric):
    """The mean of every value given to :meth:`update` (each element counts once): the exact
    sum divided by the count, rounded once. NaN before any value."""

    def reset(self) -> None:
        self._sum = _ExactSum()

    def update(self, values: Any) -> None:
        self._sum.add(values)

    def _state(self) -> Any:
        return self._sum.state()

    def _value(self, states: Sequence[Any]) -> float:
        total = _ExactSum.merge(states)
        return total.ratio(total.count)


class Accuracy(Metric):
    """The fraction of correct predictions: ``correct / total`` over every rank's samples.

    :meth:`update` takes ``(output, target)``: ``output`` holds class scores (one more
    dimension than ``target``: the argmax over the last one is the prediction) or the
    predictions themselves (the shape of ``target``). ``correct`` and ``total`` are the counts
    behind the last value returned (global after :meth:`compute`). NaN before any sample.
    """

    def reset(self) -> None:
        self.correct = 0
        self.total = 0
        self._correct = 0
        self._total = 0

    def update(self, output: Any, target: Any) -> None:
        out, tgt = _numpy(output), _numpy(target)
        if out.ndim == tgt.ndim + 1:
            out = out.argmax(axis=-1)
        if out.shape != tgt.shape:
            raise ValueError(f"Accuracy.update: output of shape {out.shape} does not match "
                             f"target of shape {tgt.shape}; pass class scores (N, C) or "
                             "predictions (N,) for targets (N,)")
        self._correct += int(np.count_nonzero(out == tgt))
        self._total += int(tgt.size)

    def _state(self) -> Any:
        return self._correct, self._total

    def _value(self, states: Sequence[Any]) -> float:
        self.correct = sum(c for c, _ in states)
        self.total = sum(t for _, t in states)
        return self.correct / self.total if self.total else float("nan")


def global_sum(values: Any, process_set: ProcessSet = global_process_set) -> int | float:
    """The exact sum of every rank's ``values`` (all elements), on every rank: Jittor's
    ``mpi_all_reduce`` of a count, without its rounding. A collective."""
    metric = Sum(process_set)
    metric.update(values)
    return metric.compute()  # type: ignore[no-any-return]
