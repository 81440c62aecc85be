"""Adasum (ringflow.algorithms.adasum) on 1, 2, 4 and 8 ranks as threads, against a numpy tree.

The reference combines the ranks' vectors pairwise as the paper's binary tree does (level 1:
ranks 2i and 2i+1, ...), each tensor of the buffer with its own coefficients, in float64; the
collective must match it closely on every rank and be bitwise identical across ranks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringflow import algorithms
from ringflow.errors import RankFailure
from ringflow.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def vector(r: int, total: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``r``'s buffer: partly shared direction, partly its own, so the coefficients vary."""
    i = np.arange(total)
    return (np.cos(i * 0.37 + r) + 0.5 * np.sin(i * (r + 1) * 0.11) + (i % 3 == r % 3)).astype(
        dtype)


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = a @ b, a @ a, b @ b
    ca = 1.0 - dot / (2 * aa) if aa >= np.sqrt(np.finfo(np.float64).tiny) else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= np.sqrt(np.finfo(np.float64).tiny) else 1.0
    return ca * a + cb * b


def reference(vectors: list[np.ndarray], counts: list[int]) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    out = []
    for s, e in itertools.pairwise(starts):
        level = [v[s:e].astype(np.float64) for v in vectors]
        while len(level) > 1:
            level = [combine(level[k], level[k + 1]) for k in range(0, len(level), 2)]
        out.append(level[0])
    return np.concatenate(out) if out else np.zeros(0)


CASES = [(n, counts, dtype, "loopback") for n in (1, 2, 4, 8)
         for counts in ([0], [1], [5], [3, 0, 7], [1001, 17])
         for dtype in (np.float64, np.float32, np.float16)]
CASES += [(n, counts, np.float32, "tcp") for n in (2, 4) for counts in ([3, 0, 7], [1001, 17])]


@pytest.mark.parametrize(("n", "counts", "dtype", "transport"), CASES)
def test_adasum_matches_the_tree(n: int, counts: list[int], dtype: type,
                                 transport: str) -> None:
    total = sum(counts)

    def rank(t):
        buf = vector(t.rank, total, np.dtype(dtype))
        algorithms.adasum(t, buf, counts)
        return buf

    results = run_ranks(n, rank, deadline=30, transport=transport)
    want = reference([vector(r, total, np.dtype(dtype)) for r in range(n)], counts)
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}[dtype]
    for r, got in enumerate(results):
        assert got.tobytes() == results[0].tobytes(), f"rank {r} differs from rank 0"
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


def test_orthogonal_vectors_add_and_parallel_ones_average() -> None:
    def rank(t):
        buf = np.eye(2)[t.rank].copy() if t.size == 2 else None
        algorithms.adasum(t, buf, [2])
        same = np.full(3, 4.0)
        algorithms.adasum(t, same, [3])
        return buf, same

    for buf, same in run_ranks(2, rank, deadline=30):
        np.testing.assert_array_equal(buf, [1.0, 1.0])
        np.testing.assert_array_equal(same, [4.0, 4.0, 4.0])


def test_adasum_needs_a_power_of_two_and_floats() -> None:
    def rank(t):
        algorithms.adasum(t, np.ones(4), [4])

    with pytest.raises(RankFailure, match="power of two ranks, got 3"):
        run_ranks(3, rank, deadline=30)
    with pytest.raises(RankFailure, match="floating-point"):
        run_ranks(1, lambda t: algorithms.adasum(t, np.ones(4, np.int32), [4]), deadline=30)
