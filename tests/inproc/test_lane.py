"""The same-host lane (ringflow.lane) at the thread tier: n engines on shared memory.

Small cached allreduces submitted while a rank is idle are posted on the lane (a job of one rank:
its engine, which completes every cached call at once); the lane must give
the bits the coordinator's eager path gives, and every situation where the ranks do not all post
the same name at about the same time (other orders, a late rank, a mismatch, joined ranks,
operations in flight) must end on the normal path with its usual result or error.
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from ringflow.config import Config
from ringflow.errors import RingflowError
from ringflow.lane import LINE, Lane
from ringflow.negotiation import EAGER_BYTES
from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(120)

SIZES = [2, 3, 4]
DEADLINE = 30.0
LANE = Config(timeout_s=2 * DEADLINE)
# Threads of one process share a GIL: a long wait keeps most cached operations on the lane.
PATIENT = Config(timeout_s=2 * DEADLINE, lane_wait_us=200_000)
NO_LANE = Config(timeout_s=2 * DEADLINE, lane_wait_us=0)
LENGTHS = [0, 1, 7, 1001, EAGER_BYTES // 8]  # up to the largest eager float64 tensor


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def contribution(r: int, i: int, dtype: str, length: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * r + i)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, length).astype(dtype)
    return (rng.standard_normal(length) * 3).astype(dtype)


CASES = [  # dtype, op, prescale, postscale, compression
    ("float32", "Sum", 1.0, 1.0, "none"),
    ("float64", "Average", 1.0, 1.0, "none"),
    ("float32", "Average", 0.5, 3.0, "none"),
    ("int32", "Sum", 1.0, 1.0, "none"),
    ("int64", "Average", 1.0, 1.0, "none"),
    ("float16", "Sum", 1.0, 1.0, "none"),
    ("float32", "Sum", 1.0, 1.0, "fp16"),
    ("float64", "Min", 1.0, 1.0, "none"),
    ("float32", "Max", 1.0, 1.0, "none"),
    ("float64", "Product", 1.0, 1.0, "none"),
]


def run_cases(n: int, config: Config) -> list[tuple[dict, list[bytes]]]:
    """Every case at every length, negotiated once, then twice from the cache (synchronously,
    as a training loop calls them); per rank: the stats of the cached rounds and the results."""

    def body(r, rf):
        comp = {"none": rf.Compression.none, "fp16": rf.Compression.fp16}
        out: list[bytes] = []
        stats = None
        for attempt in range(3):
            before = rf.stats()
            for i, (dtype, op, pre, post, c) in enumerate(CASES):
                for length in LENGTHS:
                    x = contribution(r, i, dtype, length)
                    got = rf.allreduce(x, name=f"c{i}.{length}", op=getattr(rf, op),
                                       prescale_factor=pre, postscale_factor=post,
                                       compression=comp[c])
                    assert got.dtype == x.dtype and got.shape == x.shape
                    if attempt == 2:
                        out.append(got.tobytes())
            if attempt:
                stats = delta(before, rf.stats()) if stats is None else {
                    k: v + delta(before, rf.stats())[k] for k, v in stats.items()}
        return stats, out

    return run_engines(n, body, config, deadline=DEADLINE, shm=True)


@pytest.mark.parametrize("n", [1, *SIZES])
def test_the_lane_gives_the_eager_paths_bits_and_the_closed_form(n: int) -> None:
    lane = run_cases(n, PATIENT)
    eager = run_cases(n, NO_LANE)
    for r in range(n):
        assert lane[r][1] == eager[r][1], f"rank {r}: the lane and the eager path differ"
        assert lane[r][1] == lane[0][1], f"rank {r}'s results differ from rank 0's"
        assert eager[r][0]["lane"] == 0
    # Cached operations take the lane (not necessarily all: a rank that is descheduled for
    # longer than lane_wait_us sends the others to the coordinator, which is allowed).
    cached = 2 * len(CASES) * len(LENGTHS)
    assert sum(s["lane"] for s, _ in lane) > 0, [s for s, _ in lane]
    assert all(s["collectives"] == cached for s, _ in lane)
    if n == 1:  # a job of one rank: nobody to wait for, every cached operation (Engine._solo)
        assert lane[0][0]["lane"] == cached
    # The closed form, from the last round's bytes on rank 0.
    k = 0
    for i, (dtype, op, pre, post, c) in enumerate(CASES):
        for length in LENGTHS:
            got = np.frombuffer(lane[0][1][k], dtype)
            k += 1
            parts = [contribution(r, i, dtype, length).astype(np.float64) * pre for r in range(n)]
            if np.dtype(dtype).kind == "i":
                parts = [np.trunc(p) for p in parts]
            want = {"Sum": np.sum, "Average": np.sum, "Min": np.min, "Max": np.max,
                    "Product": np.prod}[op](parts, axis=0) if length else np.zeros(0)
            want = want * post / (n if op == "Average" else 1)
            if np.dtype(dtype).kind == "i":
                want = np.trunc(want)
            tol = 2e-2 if "16" in dtype or c == "fp16" else 1e-5
            assert np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * n), (i, length)


@pytest.mark.parametrize("n", SIZES)
def test_other_orders_late_ranks_and_ops_in_flight_end_on_the_normal_path(n: int) -> None:
    names = [f"o{i}" for i in range(6)]

    def body(r, rf):
        for name in names:  # negotiate and cache every name
            rf.allreduce(np.full(3, r + 1.0), name=name, op=rf.Sum)
        want = np.full(3, n * (n + 1) / 2)
        before = rf.stats()
        # Every rank its own order, asynchronously: posts of different names are withdrawn.
        order = names[r:] + names[:r]
        handles = [rf.allreduce_async(np.full(3, r + 1.0), name=m, op=rf.Sum) for m in order]
        assert all(np.array_equal(h.wait(DEADLINE), want) for h in handles)
        # A late rank: the others' posts give up after lane_wait_us and go to rank 0.
        if r == n - 1:
            time.sleep(0.05)
        assert np.array_equal(rf.allreduce(np.full(3, r + 1.0), name="o0", op=rf.Sum), want)
        # An operation in flight on one rank (a name the others submit later) keeps the
        # others off the lane.
        if r == 0:
            h = rf.allreduce_async(np.full(3, 1.0), name="o1", op=rf.Sum)
            got = rf.allreduce(np.full(3, r + 1.0), name="o2", op=rf.Sum)
            h.wait(DEADLINE)
        else:
            got = rf.allreduce(np.full(3, r + 1.0), name="o2", op=rf.Sum)
            rf.allreduce(np.full(3, 1.0), name="o1", op=rf.Sum)
        assert np.array_equal(got, want)
        return delta(before, rf.stats())

    for stats in run_engines(n, body, LANE, deadline=DEADLINE, shm=True):
        assert stats["tensors"] == len(names) + 3, stats


@pytest.mark.parametrize("n", SIZES)
def test_a_mismatch_after_caching_is_reported_alike_on_every_rank(n: int) -> None:
    def body(r, rf):
        for _ in range(3):
            rf.allreduce(np.ones(5), name="m", op=rf.Sum)
        try:
            rf.allreduce(np.ones(6 if r == n - 1 else 5), name="m", op=rf.Sum)
        except RingflowError as exc:
            return type(exc).__name__, str(exc)
        return None

    seen = set(run_engines(n, body, LANE, deadline=DEADLINE, shm=True))
    assert len(seen) == 1, seen
    kind, text = seen.pop()
    assert kind == "MismatchError" and "shape" in text and "'m'" in text, text


@pytest.mark.parametrize("n", SIZES)
def test_joined_ranks_count_as_zeros_while_others_use_cached_names(n: int) -> None:
    def body(r, rf):
        rf.allreduce(np.full(4, r + 1.0), name="j", op=rf.Sum)
        if r == 0:
            last = rf.join()
            return None, last
        got = rf.allreduce(np.full(4, r + 1.0), name="j", op=rf.Sum)
        return got.tolist(), rf.join()

    results = run_engines(n, body, LANE, deadline=DEADLINE, shm=True)
    for r, (got, last) in enumerate(results):
        if r:
            assert got == [n * (n + 1) / 2 - 1] * 4, got
        assert last == results[0][1]


def test_an_output_array_and_poll_drive_a_posted_operation() -> None:
    def body(r, rf):
        x = np.full(8, r + 1.0, np.float32)
        rf.allreduce(x, name="p", op=rf.Sum)
        out = np.empty_like(x)
        h = rf.allreduce_async(x, name="p", op=rf.Sum, out=out)
        deadline = time.monotonic() + DEADLINE
        while not h.poll():  # poll() alone moves it on (lane or, after withdrawing, rank 0)
            assert time.monotonic() < deadline
        assert h.wait() is out and np.array_equal(out, np.full(8, 3.0, np.float32))
        return rf.stats()["lane"]

    run_engines(2, body, LANE, deadline=DEADLINE, shm=True)


class _Segment:
    """A slot's shared mapping, as ringflow.algorithms.shm gives the lane one."""

    def __init__(self) -> None:
        self.map = mmap.mmap(-1, LINE + EAGER_BYTES)
        self.array = np.frombuffer(self.map, np.uint8)


def test_a_busy_rank_behind_in_the_plan_stream_is_waited_for_one_level_with_it_is_not(
        tmp_path) -> None:
    # A busy rank still finishing plans this rank has finished will be idle soon: posting waits
    # for it. One busy with as much of the stream has operations the coordinator must order.
    segments = [_Segment(), _Segment()]
    with open(tmp_path / "lock", "w") as lock:
        me, other = Lane(0, segments, lock.fileno()), Lane(1, segments, lock.fileno())
        me.took_in(5)
        other.took_in(4)
        other.set_busy(True)
        assert not me.blocked() and not me.hopeless()
        other.took_in(5)
        assert me.blocked() and me.hopeless()
        other.set_busy(False)
        assert not me.blocked()
        assert me.post(7, np.ones(4), time.perf_counter() + 1)
        assert not me.hopeless() and not me.committed()
        assert other.post(8, np.ones(4), time.perf_counter() + 1)  # another name: no commit
        assert me.hopeless() and not me.committed()
        me.close()
        other.close()
