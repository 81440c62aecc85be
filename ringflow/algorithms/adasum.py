"""Adasum: adaptive summation of gradients, over any :class:`~ringflow.transport.Link`.

Adasum is from Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021
(arXiv:2006.02924). Two gradients ``a`` and ``b`` combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its squared norm is below ``sqrt(DBL_MIN)``): orthogonal gradients add,
parallel ones average. ``n = 2^k`` ranks combine as a binary tree whose leaves are the ranks in
order: level 1 combines ranks 2i and 2i+1, level 2 combines those results pairwise, ...; the
lower half of each pair is ``a``. Each tensor of a fused buffer is combined on its own (its own
dot product and norms). This is the arithmetic of Horovod 0.28's CPU Adasum
(``horovod/common/ops/adasum/adasum.h``): dot products and squared norms accumulate in float64;
float32 and float64 elements are combined in float64, 16-bit ones in float32, and rounded once.

Steps (vector halving, distance doubling), rank ``r``, levels ``l = 1, 2, 4, ... < n``:

1. The partner is ``r ^ l``; both hold the same segment of the buffer. The rank whose bit ``l`` is
   clear keeps the first half (``floor(m / 2)`` elements), the other the second; each sends the
   half it gives up and receives the partner's copy of the half it keeps. Of that half, the rank
   with bit ``l`` clear holds ``a`` (its group's vector), the other ``b``.
2. Per tensor, the partial ``a.b``, ``|a|^2`` and ``|b|^2`` over the kept half are summed over the
   ``2l`` ranks whose segments together cover this level's pair of vectors (ranks that agree on
   the bits above ``l``), by recursive doubling, so every one of them gets the same sums.
3. The rank combines its half with those coefficients.

After the last level every rank holds ``1/n`` of the result; the levels are undone in reverse
order, each rank sending its part to the level's partner, so every rank ends with all of it. Each
element is computed by exactly one rank, so the results are bitwise identical everywhere.

Cost per rank, buffer of ``B`` bytes: ``2 (n-1)/n B`` bytes in ``2 log2 n`` messages, plus
``sum_l log2(2l)`` messages of ``24`` bytes per tensor for the dot products.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np

from ..errors import TensorError
from ..ops import is_float16ish
from ..transport.base import Link
from .buffers import as_bytes, chunk_elems, chunk_ranges

__all__ = ["adasum"]

_TINY = math.sqrt(sys.float_info.min)


def adasum(t: Link, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Replace the 1-d float buffer ``buf`` -- the tensors of ``counts`` elements, concatenated --
    by the Adasum of every rank's buffer, in place.

    Raises:
        TensorError: ``t.size`` is not a power of two, or ``buf`` is not floating point.
    """
    n, r = t.size, t.rank
    if n & (n - 1):
        raise TensorError(f"Adasum needs a power of two ranks, got {n}")
    if buf.dtype.kind != "f":
        raise TensorError(f"Adasum combines floating-point tensors, got {buf.dtype}")
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    scratch = np.empty((buf.size + 1) // 2, buf.dtype)
    lo, hi = 0, buf.size
    given: list[tuple[int, int, int]] = []  # (level, lo, hi) of what went to each partner
    level = 1
    while level < n:
        partner, mid = r ^ level, lo + (hi - lo) // 2
        left = not r & level
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        got = scratch[:keep[1] - keep[0]]
        _exchange(t, buf[give[0]:give[1]], got, partner)
        mine = buf[keep[0]:keep[1]]
        a, b = (mine, got) if left else (got, mine)
        spans = _spans(starts, keep)
        sums = _group_sum(t, _dots(a, b, spans), level)
        _combine(mine, a, b, spans, sums)
        given.append((level, *give))
        lo, hi = keep
        level <<= 1
    for level, glo, ghi in reversed(given):
        _exchange(t, buf[lo:hi], buf[glo:ghi], r ^ level)
        lo, hi = min(lo, glo), max(hi, ghi)


def _exchange(t: Link, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it; empty sides are skipped
    (both sides know every size, and no transport message is ever empty)."""
    work = [t.irecv(as_bytes(recv), peer)] if recv.size else []
    if send.size:
        work.append(t.isend(as_bytes(send), peer))
    for w in work:
        w.wait()


def _spans(starts: np.ndarray, keep: tuple[int, int]) -> list[tuple[int, int]]:
    """Each tensor's part of ``keep``, as ranges relative to ``keep[0]`` (empty ones included)."""
    lo, hi = keep
    return [(int(min(max(s, lo), hi)) - lo, int(min(max(e, lo), hi)) - lo)
            for s, e in itertools.pairwise(starts)]


def _dots(a: np.ndarray, b: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Per tensor (a.b, |a|^2, |b|^2) over its span, in float64, chunk by chunk."""
    out = np.zeros((len(spans), 3))
    per = chunk_elems(8)
    for i, (s, e) in enumerate(spans):
        for c0, c1 in chunk_ranges(s, e, per):
            x = a[c0:c1].astype(np.float64)
            y = b[c0:c1].astype(np.float64)
            out[i] += (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return out.reshape(-1)


def _group_sum(t: Link, values: np.ndarray, level: int) -> np.ndarray:
    """The sum of ``values`` over the ``2 * level`` ranks that agree with this one on the bits
    above ``level`` (recursive doubling; two operands add the same either way round, so every
    rank of the group ends with the same bits)."""
    got = np.empty_like(values)
    d = 1
    while d <= level:
        _exchange(t, values, got, t.rank ^ d)
        values = values + got
        d <<= 1
    return values


def _combine(out: np.ndarray, a: np.ndarray, b: np.ndarray, spans: list[tuple[int, int]],
             sums: np.ndarray) -> None:
    """``out = ca * a + cb * b`` per tensor (``out`` is ``a`` or ``b``, element by element)."""
    wide = np.float32 if is_float16ish(out.dtype) else np.float64
    per = chunk_elems(8)
    for i, (s, e) in enumerate(spans):
        dot, aa, bb = sums[3 * i:3 * i + 3]
        ca = wide(1.0 - dot / aa * 0.5 if aa >= _TINY else 1.0)
        cb = wide(1.0 - dot / bb * 0.5 if bb >= _TINY else 1.0)
        for c0, c1 in chunk_ranges(s, e, per):
            acc = np.multiply(a[c0:c1], ca, dtype=wide)
            acc += np.multiply(b[c0:c1], cb, dtype=wide)
            np.copyto(out[c0:c1], acc, casting="unsafe")
