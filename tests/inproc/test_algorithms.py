"""Collectives of ringflow.algorithms on N ranks as threads, over loopback and real TCP.

Rank ``r`` contributes values derived from ``r`` and the element index ``i``, so every expected
result is a formula in ``n`` and ``i`` (e.g. SUM of ``r + 1 + i % 5`` is ``n(n+1)/2 + n (i % 5)``).
Every rank's result is checked, and results that must agree are compared bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringflow import algorithms
from ringflow.algorithms import buffers
from ringflow.errors import (
    ProtocolError,
    RankFailure,
    RingflowTimeoutError,
    TensorError,
)
from ringflow.ops import DTYPES, ReduceOp
from ringflow.testing import run_ranks
from ringflow.transport.loopback import LoopbackWorld

pytestmark = pytest.mark.timeout(300)
DEADLINE = 30.0  # per run_ranks call; the slowest takes ~0.4 s on 2 shared cores

SIZES = [1, 2, 3, 4, 7]
BIG = 100_003  # large and odd: uneven segments, a remainder for the lowest ranks
ALL_DTYPES = list(DTYPES.values())
REDUCE_OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
RTOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}


@pytest.fixture(params=["loopback", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def lengths(n: int, big: int = BIG) -> list[int]:
    return [*sorted({0, 1, n - 1}), big]


def signed(dtype: np.dtype) -> bool:
    return dtype.kind in "if" or dtype.name == "bfloat16"


# --- closed forms for reductions --------------------------------------------------------------


def contribution(r: int, n: int, length: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    i = np.arange(length)
    if dtype == np.bool_:
        return (i + r) % 3 == 0
    if op == ReduceOp.PRODUCT:
        p = -2 if signed(dtype) else 2
        return np.where(i % (n + 1) == r, p, 1).astype(dtype)
    sign = np.where(i % 2 == 1, -1, 1) if signed(dtype) else 1
    return (sign * (r + 1 + i % 5)).astype(dtype)


def expected(n: int, length: int, dtype: np.dtype, op: ReduceOp, postscale: float = 1.0):
    i = np.arange(length)
    if dtype == np.bool_:
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            return (-i) % 3 < n  # some rank r < n has (i + r) % 3 == 0
        return (i % 3 == 0) & (n == 1)  # MIN, PRODUCT: every rank must have it
    if op == ReduceOp.PRODUCT:
        p = -2 if signed(dtype) else 2
        return np.where(i % (n + 1) < n, p, 1).astype(dtype)
    m = i % 5
    sign = np.where(i % 2 == 1, -1, 1) if signed(dtype) else np.ones(length, int)
    if op == ReduceOp.MIN:
        return np.where(sign > 0, 1 + m, -(n + m)).astype(dtype)
    if op == ReduceOp.MAX:
        return np.where(sign > 0, n + m, -(1 + m)).astype(dtype)
    total = n * (n + 1) // 2 + n * m  # of the magnitudes
    scale = postscale / n if op == ReduceOp.AVERAGE else postscale
    if dtype.kind in "iu":  # computed in float64, truncated toward zero
        return (sign * np.trunc(total * scale)).astype(dtype)
    return (sign * total * scale).astype(np.float64)


def check_reduced(got: np.ndarray, want: np.ndarray, dtype: np.dtype, what: str) -> None:
    assert got.dtype == dtype, what
    if dtype.name in RTOL:
        np.testing.assert_allclose(
            got.astype(np.float64), want, rtol=RTOL[dtype.name], atol=0, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def ops_for(dtype: np.dtype) -> list[ReduceOp]:
    return [op for op in REDUCE_OPS if not (dtype == np.bool_ and op == ReduceOp.AVERAGE)]


def same_bits(results: list[np.ndarray], what: str) -> None:
    first = results[0].tobytes()
    for rank, res in enumerate(results):
        assert res.tobytes() == first, f"{what}: rank {rank} differs from rank 0"


# --- allreduce --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_allreduce(transport: str, n: int, dtype: np.dtype) -> None:
    cases = [(length, op) for length in lengths(n) for op in ops_for(dtype)]

    def body(t):
        out = []
        for length, op in cases:
            buf = contribution(t.rank, n, length, dtype, op)
            algorithms.allreduce(t, buf, op)
            out.append(buf)
        return out

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, (length, op) in enumerate(cases):
        what = f"allreduce {op.name} n={n} length={length} {dtype}"
        for rank in range(n):
            check_reduced(results[rank][k], expected(n, length, dtype, op), dtype, what)
        same_bits([res[k] for res in results], what)


@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "bool"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_out_of_place_ring_gives_the_in_place_bits_and_keeps_its_input(
        monkeypatch: pytest.MonkeyPatch, n: int, dtype: str, chunk: int | None) -> None:
    # The copy of the input is folded into the reduce-scatter (ring.allreduce(src=...)).
    from ringflow.algorithms import ring

    if chunk:
        monkeypatch.setattr(buffers, "CHUNK_BYTES", chunk)  # many chunks per segment
    dt = DTYPES[dtype]
    cases = [(length, op, ps) for length in lengths(n, 10_007) for op in ops_for(dt)
             for ps in ((1.0, 3.0) if dt != np.bool_ else (1.0,))]

    def body(t):
        out = []
        for length, op, ps in cases:
            src = contribution(t.rank, n, length, dt, op)
            keep = src.copy()
            into = np.full(length, 7, dt)  # stale contents must not leak into the result
            ring.allreduce(t, into, op, ps, src=src)
            assert src.tobytes() == keep.tobytes(), "the input was modified"
            ring.allreduce(t, src, op, ps)
            out.append((into, src))
        return out

    results = run_ranks(n, body, deadline=DEADLINE)
    for k, (length, op, ps) in enumerate(cases):
        what = f"out of place {op.name} x{ps} n={n} length={length} {dtype}"
        for rank in range(n):
            into, inplace = results[rank][k]
            assert into.tobytes() == inplace.tobytes(), f"{what}: rank {rank}"
        if ps == 1.0 or op in (ReduceOp.SUM, ReduceOp.AVERAGE):  # the closed forms
            for rank in range(n):
                check_reduced(results[rank][k][0], expected(n, length, dt, op, ps), dt, what)
        same_bits([res[k][0] for res in results], what)


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d != np.bool_], ids=str)
@pytest.mark.parametrize("n", [1, 3, 4])
def test_allreduce_postscale(n: int, dtype: np.dtype) -> None:
    cases = [(op, ps) for op in (ReduceOp.SUM, ReduceOp.AVERAGE) for ps in (0.5, 3.0)]
    length = 2 * n + 3

    def body(t):
        out = []
        for op, ps in cases:
            buf = contribution(t.rank, n, length, dtype, op)
            algorithms.allreduce(t, buf, op, postscale=ps)
            out.append(buf)
        return out

    results = run_ranks(n, body)
    for k, (op, ps) in enumerate(cases):
        what = f"allreduce {op.name} postscale={ps} n={n} {dtype}"
        want = expected(n, length, dtype, op, ps)  # magnitudes stay below 127: no wrapping
        for rank in range(n):
            check_reduced(results[rank][k], want, dtype, what)
        same_bits([res[k] for res in results], what)


def test_allreduce_float16_average_does_not_overflow() -> None:
    # A naive float16 ring reaches 80000 > 65504 (inf) after the second addition.
    def body(t):
        half = np.full(7, 40000.0, np.float16)
        algorithms.allreduce(t, half, ReduceOp.AVERAGE)
        near_max = np.full(5, 64000.0 / 4, np.float16)
        algorithms.allreduce(t, near_max, ReduceOp.SUM)
        bf = np.full(3, 3.0e38, DTYPES["bfloat16"])
        algorithms.allreduce(t, bf, ReduceOp.AVERAGE)
        return half, near_max, bf

    for half, near_max, bf in run_ranks(4, body):
        assert half.tolist() == [40000.0] * 7
        assert near_max.tolist() == [64000.0] * 5
        assert np.all(np.isfinite(bf.astype(np.float32)))
        np.testing.assert_allclose(bf.astype(np.float32), 3.0e38, rtol=1e-2)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64], ids=str)
def test_integer_average_truncates_toward_zero(dtype) -> None:
    def body(t):
        buf = np.array([-3, 3, -1, 1], dtype) if t.rank == 0 else np.array([-4, 4, 0, 0], dtype)
        algorithms.allreduce(t, buf, ReduceOp.AVERAGE)
        return buf

    for res in run_ranks(2, body):
        assert res.tolist() == [-3, 3, 0, 0]  # -7/2 -> -3 (floor would give -4)


def test_bool_average_raises_on_every_rank() -> None:
    def body(t):
        with pytest.raises(TensorError, match="dtype bool, which cannot be averaged") as info:
            algorithms.allreduce(t, np.ones(3, bool), ReduceOp.AVERAGE)
        return str(info.value)

    assert len(run_ranks(3, body)) == 3


def test_adasum_is_rejected() -> None:
    t = LoopbackWorld(1).transport(0)
    with pytest.raises(TensorError, match="ADASUM is not supported"):
        algorithms.allreduce(t, np.ones(2), ReduceOp.ADASUM)


# --- reducescatter ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_reducescatter(transport: str, n: int, dtype: np.dtype) -> None:
    cols = 2
    cases = [(rows, op) for rows in lengths(n, BIG // 2) for op in ops_for(dtype)]

    def body(t):
        out = []
        for rows, op in cases:
            buf = contribution(t.rank, n, rows * cols, dtype, op).reshape(rows, cols)
            before = buf.copy()
            out.append(algorithms.reducescatter(t, buf, op))
            np.testing.assert_array_equal(buf, before)  # the input is left alone
        return out

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, (rows, op) in enumerate(cases):
        full = expected(n, rows * cols, dtype, op).reshape(rows, cols)
        for rank, (lo, hi) in enumerate(buffers.even_split(rows, n)):
            what = f"reducescatter {op.name} n={n} rows={rows} {dtype} rank {rank}"
            assert results[rank][k].shape == (hi - lo, cols), what
            check_reduced(results[rank][k], full[lo:hi], dtype, what)


def test_reducescatter_splits_5_rows_over_3_ranks_as_2_2_1() -> None:
    def body(t):
        buf = np.arange(10, dtype=np.int32).reshape(5, 2) * (t.rank + 1)
        return algorithms.reducescatter(t, buf, ReduceOp.SUM)

    parts = run_ranks(3, body)
    assert [p.shape for p in parts] == [(2, 2), (2, 2), (1, 2)]
    np.testing.assert_array_equal(np.concatenate(parts), np.arange(10).reshape(5, 2) * 6)


# --- allgather --------------------------------------------------------------------------------


def block(r: int, rows: int, dtype: np.dtype, cols: int = 3) -> np.ndarray:
    j = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    values = (r * 7 + j * 3 + c) % (2 if dtype == np.bool_ else 100)
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_allgather(transport: str, n: int, dtype: np.dtype) -> None:
    # Odd ranks have half as many rows: first dims differ, and are 0 when length is 1.
    cases = [[length if q % 2 == 0 else length // 2 for q in range(n)]
             for length in lengths(n, BIG // 3)]

    def body(t):
        return [algorithms.allgather(t, block(t.rank, counts[t.rank], dtype), counts)
                for counts in cases]

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, counts in enumerate(cases):
        what = f"allgather n={n} counts={counts} {dtype}"
        want = np.concatenate([block(q, counts[q], dtype) for q in range(n)])
        for rank in range(n):
            assert results[rank][k].dtype == dtype, what
            np.testing.assert_array_equal(results[rank][k], want, err_msg=what)
        same_bits([res[k] for res in results], what)


def test_allgather_with_empty_ranks() -> None:
    counts = [0, 3, 0, 1]

    def body(t):
        return algorithms.allgather(t, np.full((counts[t.rank], 2), t.rank, np.int16), counts)

    for res in run_ranks(4, body):
        assert res.tolist() == [[1, 1]] * 3 + [[3, 3]]


# --- gather / scatter -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_gather_and_scatter(transport: str, n: int, dtype: np.dtype) -> None:
    # Ragged first dimensions (odd ranks half as many rows), every root in turn.
    cases = [([length if q % 2 == 0 else length // 2 for q in range(n)], (length + 1) % n)
             for length in lengths(n, BIG // 3)]

    def body(t):
        got = []
        for counts, root in cases:
            mine = block(t.rank, counts[t.rank], dtype)
            gathered = algorithms.gather(t, mine, counts, root)
            full = np.concatenate([block(q, counts[q], dtype) for q in range(n)])
            piece = algorithms.scatter(t, full if t.rank == root else None, counts, root,
                                       full.shape[1:], full.dtype)
            got.append((gathered, piece))
        return got

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, (counts, root) in enumerate(cases):
        what = f"gather/scatter root={root} n={n} counts={counts} {dtype}"
        want = np.concatenate([block(q, counts[q], dtype) for q in range(n)])
        for rank in range(n):
            gathered, piece = results[rank][k]
            if rank == root:
                np.testing.assert_array_equal(gathered, want, err_msg=what)
            else:
                assert gathered is None, what
            np.testing.assert_array_equal(piece, block(rank, counts[rank], dtype), err_msg=what)
            assert piece.dtype == dtype, what


def test_gather_talks_only_to_the_root() -> None:
    def body(t):
        return algorithms.gather(t, np.full((2, 3), t.rank, np.int32), [2] * 4, 2), t.world

    results = run_ranks(4, body)
    assert results[2][0][:, 0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    world = results[0][1]
    used = {pair for pair, (messages, _) in world.sent.items() if messages}
    assert used == {(0, 2), (1, 2), (3, 2)}


# --- broadcast --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_broadcast(transport: str, n: int, dtype: np.dtype) -> None:
    cases = [(length, (length + 1) % n) for length in lengths(n)]

    def body(t):
        out = []
        for length, root in cases:
            buf = block(root, length, dtype, 1).reshape(-1)
            if t.rank != root:
                buf[...] = 0
            algorithms.broadcast(t, buf, root)
            out.append(buf)
        return out

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, (length, root) in enumerate(cases):
        what = f"broadcast root={root} n={n} length={length} {dtype}"
        for rank in range(n):
            np.testing.assert_array_equal(
                results[rank][k], block(root, length, dtype, 1).reshape(-1), err_msg=what
            )
        same_bits([res[k] for res in results], what)


# --- alltoall ---------------------------------------------------------------------------------


def a2a_rows(src: int, dst: int, rows: int, dtype: np.dtype) -> np.ndarray:
    k = np.arange(rows)[:, None]
    c = np.arange(2)[None, :]
    return ((src * 11 + dst * 5 + k + c) % (2 if dtype == np.bool_ else 97)).astype(dtype)


def a2a_splits(src: int, n: int, scale: int) -> list[int]:
    return [((src + 2 * dst) % 3) * scale for dst in range(n)]  # uneven, with zeros


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_alltoall(transport: str, n: int, dtype: np.dtype) -> None:
    scales = lengths(n, 3001)

    def body(t):
        out = []
        for scale in scales:
            splits = a2a_splits(t.rank, n, scale)
            rows = [a2a_rows(t.rank, d, splits[d], dtype) for d in range(n)]
            out.append(algorithms.alltoall(t, np.concatenate(rows), splits))
        return out

    results = run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for k, scale in enumerate(scales):
        for rank in range(n):
            what = f"alltoall n={n} scale={scale} {dtype} rank {rank}"
            got, got_splits = results[rank][k]
            want_splits = [a2a_splits(q, n, scale)[rank] for q in range(n)]
            assert got_splits == want_splits, what
            want = np.concatenate([a2a_rows(q, rank, want_splits[q], dtype) for q in range(n)])
            assert got.dtype == dtype, what
            np.testing.assert_array_equal(got, want, err_msg=what)


def test_alltoall_splits_must_cover_the_tensor() -> None:
    def body(t):
        with pytest.raises(TensorError, match=r"add up to 3 rows but the tensor has 4"):
            algorithms.alltoall(t, np.zeros((4, 2)), [1, 2])

    run_ranks(2, body)


# --- barrier ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_barrier(transport: str, n: int) -> None:
    events: list[str] = []
    lock = threading.Lock()

    def body(t):
        for round_ in range(3):
            with lock:
                events.append(f"in{round_}")
            algorithms.barrier(t)
            with lock:
                events.append(f"out{round_}")

    run_ranks(n, body, deadline=DEADLINE, transport=transport)
    for round_ in range(3):
        last_in = max(k for k, e in enumerate(events) if e == f"in{round_}")
        first_out = min(k for k, e in enumerate(events) if e == f"out{round_}")
        assert last_in < first_out, events


# --- pipelining and structure -----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 7])
def test_ring_allreduce_talks_only_to_next_rank(n: int) -> None:
    length = 10 * n + 3  # every segment non-empty and one chunk

    def body(t):
        algorithms.allreduce(t, np.full(length, t.rank + 1, np.float32), ReduceOp.SUM)
        return t.world

    world = run_ranks(n, body)[0]
    seg = [hi - lo for lo, hi in buffers.even_split(length, n)]
    for r in range(n):
        for d in range(n):
            messages, nbytes = world.sent[(r, d)]
            if d == (r + 1) % n:
                assert messages == 2 * (n - 1), (r, d)
                # every segment but its own (reduce-scatter) and the next rank's (allgather)
                assert nbytes == 4 * (2 * length - seg[r] - seg[(r + 1) % n]), (r, d)
            else:
                assert (messages, nbytes) == (0, 0), (r, d)


@pytest.mark.parametrize("dtype", ["float64", "float16", "int8", "bool"])
@pytest.mark.parametrize("n", [3, 4])
def test_small_chunks_pipeline(monkeypatch: pytest.MonkeyPatch, n: int, dtype) -> None:
    dtype = DTYPES[dtype]
    monkeypatch.setattr(buffers, "CHUNK_BYTES", 16)
    length = 1001
    op = ReduceOp.SUM

    def body(t):
        a = contribution(t.rank, n, length, dtype, op)
        algorithms.allreduce(t, a, op)
        rs = algorithms.reducescatter(t, contribution(t.rank, n, length, dtype, op), op)
        ag = algorithms.allgather(t, block(t.rank, 50 + t.rank, dtype), [50 + q for q in range(n)])
        bc = block(1, length, dtype, 1).reshape(-1) if t.rank == 1 else np.zeros(length, dtype)
        algorithms.broadcast(t, bc, 1)
        return a, rs, ag, bc, t.world

    results = run_ranks(n, body)
    want = expected(n, length, dtype, op)
    bounds = buffers.even_split(length, n)
    for rank, (a, rs, ag, bc, _) in enumerate(results):
        check_reduced(a, want, dtype, f"allreduce rank {rank}")
        check_reduced(rs, want[slice(*bounds[rank])], dtype, f"reducescatter rank {rank}")
        np.testing.assert_array_equal(ag, np.concatenate([block(q, 50 + q, dtype)
                                                          for q in range(n)]))
        np.testing.assert_array_equal(bc, block(1, length, dtype, 1).reshape(-1))
    same_bits([res[0] for res in results], "allreduce")
    per = 16 // dtype.itemsize
    world = results[0][4]
    assert world.sent[(0, 1)][0] > 2 * (n - 1) * (length // n // per)  # really many chunks


# --- loopback transport contract --------------------------------------------------------------


def test_loopback_size_mismatch_is_a_protocol_error() -> None:
    world = LoopbackWorld(2, timeout=5)
    t0, t1 = world.transport(0), world.transport(1)
    t0.isend(memoryview(bytes(8)), 1).wait()
    with pytest.raises(ProtocolError, match=r"receive of 4 bytes from rank 0, but rank 0 sent 8"):
        t1.irecv(memoryview(bytearray(4)), 0).wait()


def test_loopback_receive_timeout_names_the_peer() -> None:
    world = LoopbackWorld(3, timeout=0.05)
    with pytest.raises(RingflowTimeoutError, match=r"rank 1 waited .* from rank 2"):
        world.transport(1).irecv(memoryview(bytearray(4)), 2).wait()


def test_loopback_receives_match_sends_in_posting_order() -> None:
    world = LoopbackWorld(2)
    t0, t1 = world.transport(0), world.transport(1)
    a, b = bytearray(1), bytearray(1)
    first, second = t1.irecv(memoryview(a), 0), t1.irecv(memoryview(b), 0)
    t0.isend(memoryview(b"x"), 1)
    t0.isend(memoryview(b"y"), 1)
    second.wait()  # waited out of order, still gets the second message
    first.wait()
    assert (a, b) == (bytearray(b"x"), bytearray(b"y"))


def test_failure_inside_a_collective_names_the_rank() -> None:
    def body(t):
        if t.rank == 2:
            raise ValueError("bad gradient")
        algorithms.allreduce(t, np.ones(10), ReduceOp.SUM)

    with pytest.raises(RankFailure, match="rank 2: ValueError: bad gradient"):
        run_ranks(4, body, deadline=30)
