"""The engine at the thread tier: n Engines over one loopback world (ringflow.testing.run_engines).

Each test is a function ``body(r, rf)`` run on every rank, ``rf`` being ringflow's public API
acting for rank ``r``. Rank ``r`` contributes ``r + 1`` (or a value derived from it), so every
expected result is a closed form in ``n``; errors are compared across ranks (one class and one
text everywhere). What needs real processes (a peer that dies or freezes, shutdown, the launcher,
the adapters, the transports ringflow-run picks) stays in ``tests/multiproc``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

import ringflow
from ringflow import submission
from ringflow.collectives import COMPARED
from ringflow.config import Config
from ringflow.devices import fake
from ringflow.errors import RankFailure, RingflowError
from ringflow.negotiation import EAGER_BYTES
from ringflow.ops import DTYPES
from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 3, 4, 7]
MULTI = [2, 3, 4, 7]  # what needs a second rank (a rank that disagrees, a rank that waits)
DEADLINE = 30.0
BIG = 100_003  # large and odd: uneven ring segments, more than the eager limit


def tri(n: int) -> int:
    return n * (n + 1) // 2


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def failure(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """(class name, text) of the RingflowError that ``fn`` raises; it must raise one."""
    try:
        value = fn(*args, **kwargs)
    except RingflowError as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} returned {value!r} instead of failing")


def one_error(results: list[dict[str, Any]], key: str) -> tuple[str, str]:
    """The error every rank recorded under ``key``: one class and one text on every rank."""
    seen = {res[key] for res in results}
    assert len(seen) == 1, f"{key}: the ranks saw different errors: {seen}"
    return seen.pop()


def ranks_text(ranks: list[int]) -> str:
    """How a mismatch message lists ranks: ``rank 2`` or ``ranks 0, 1``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# --- the harness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_each_rank_gets_its_own_engine_and_results_come_in_rank_order(n: int) -> None:
    def body(r, rf):
        seen_in_callback: list[tuple[int, int]] = []
        h = rf.allreduce_async(np.ones(1), name="h", op=rf.Sum)
        # A callback runs on an engine thread: rf acts for this rank there too.
        h.add_done_callback(lambda _: seen_in_callback.append((rf.rank(), rf.size())))
        h.wait()
        assert ringflow.rank() == r  # the rank's own thread is bound for the whole body
        if r == n - 1:
            rf.get_client().user_set("hello", f"from rank {r}")  # one store for all ranks
        greeting = rf.get_client().user_get("hello", DEADLINE)
        return rf.rank(), rf.size(), rf.engine.rank, seen_in_callback, greeting

    results = run_engines(n, body, deadline=DEADLINE)
    assert results == [(r, n, r, [(r, n)], f"from rank {n - 1}") for r in range(n)]
    assert not ringflow.is_initialized()  # nothing leaked into the test's own thread


@pytest.mark.parametrize("n", [2, 4])
def test_the_first_failure_is_named_and_the_other_ranks_are_released(n: int) -> None:
    released: dict[int, str] = {}

    def body(r, rf):
        if r == 1:
            time.sleep(0.05)  # let the others wait in the allreduce first
            raise ValueError("rank one is broken")
        try:
            rf.allreduce(np.ones(3), name="never.ready")  # rank 1 never submits it
        except RingflowError as exc:
            released[r] = type(exc).__name__
            raise

    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1: ValueError: rank one is broken") as info:
        run_engines(n, body, deadline=DEADLINE)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - start < 10  # released by the abort, not by a timeout
    assert sorted(released) == [r for r in range(n) if r != 1], released


def test_a_rank_stuck_past_the_deadline_is_named_with_its_stack() -> None:
    def body(r, rf):
        rf.allreduce(np.ones(1), name=f"only.rank.{r}")  # a deadlock: each waits for the other

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0: did not finish within 0.5s") as info:
        run_engines(2, body, deadline=0.5)
    assert 'name=f"only.rank.{r}"' in str(info.value)  # the line it was stuck in
    assert time.monotonic() - start < 10


def test_no_thread_outlives_the_run() -> None:
    before = set(threading.enumerate())

    def body(r, rf):
        return rf.allreduce(np.ones(2), name="x", op=rf.Sum).tolist()

    assert run_engines(4, body, deadline=DEADLINE) == [[4.0, 4.0]] * 4
    end = time.monotonic() + 5  # heartbeat threads notice their stop within a moment
    while (left := set(threading.enumerate()) - before) and time.monotonic() < end:
        time.sleep(0.01)
    assert not left, left


# --- ordering, the response cache, fusion ---------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_named_tensors_in_any_order_are_exact_then_travel_as_cache_bits(n: int) -> None:
    count = 200
    lengths = [(i * 7) % 23 for i in range(count)]  # 0, 1 and odd lengths among them
    dtypes = [np.float64, np.int32, np.float32, np.int64]

    def body(r, rf):
        rng = np.random.default_rng(1000 + r)  # a different order on every rank
        steps = []
        for step in range(3):
            before = rf.stats()
            handles = {}
            for i in rng.permutation(count):
                x = np.full(lengths[i], (r + 1) * (i + 1 + step), dtypes[i % 4])
                handles[int(i)] = rf.allreduce_async(x, name=f"grad.{i}", op=rf.Sum)
            for i, h in handles.items():
                got = h.wait(DEADLINE)
                want = np.full(lengths[i], tri(n) * (i + 1 + step), dtypes[i % 4])
                assert got.dtype == want.dtype and np.array_equal(got, want), (step, i, got)
            steps.append(delta(before, rf.stats()))
        return steps, rf.stats()

    results = run_engines(n, body, deadline=DEADLINE)
    for steps, stats in results:
        first, *steady = steps
        assert first["tensors"] == count and first["requests_sent"] == count, first
        for step in steps:
            assert 4 <= step["collectives"] <= count, step  # 4 dtypes never fuse together
        for step in steady:  # every name goes as its cache bit, none in full
            assert step["tensors"] == count, step
            # One rank: each cached call completes at once in the caller (Engine._solo).
            assert step["bits_sent" if n > 1 else "lane"] == count, step
            assert step["requests_sent"] == 0, step
        assert stats["cached_names"] == count
    coordinator = results[0][0]
    assert coordinator[0]["negotiated"] == count and coordinator[0]["cache_hits"] == 0
    for step in coordinator[1:]:
        assert step["negotiated"] == 0 and step["cache_hits"] == (count if n > 1 else 0), step


# Fusion needs the names of a burst to be ready together; a wider window than the default 1 ms
# keeps that true on a loaded machine (the coordinator holds ready names only while others wait).
WIDE_WINDOW = Config(cycle_time_ms=20.0)


def small_tensors_body(r: int, rf: Any, count: int = 64) -> dict[str, Any]:
    """``count`` small allreduces twice (negotiated, then cached), then as one group."""
    n = rf.size()
    xs = [np.full(16, (r + 1) * (i + 1), np.float32) for i in range(count)]
    wants = [np.full(16, tri(n) * (i + 1), np.float32) for i in range(count)]
    out: dict[str, Any] = {}
    for label in ("first", "steady"):
        before = rf.stats()
        hs = [rf.allreduce_async(x, name=f"small.{i}", op=rf.Sum) for i, x in enumerate(xs)]
        for h, want in zip(hs, wants, strict=True):
            assert np.array_equal(h.wait(DEADLINE), want)
        out[label] = delta(before, rf.stats())
    before = rf.stats()
    got = rf.grouped_allreduce(xs, name="group", op=rf.Sum)
    out["grouped"] = delta(before, rf.stats())
    assert all(np.array_equal(g, w) for g, w in zip(got, wants, strict=True))
    fired: list[bool] = []
    group = rf.grouped_allreduce_async(xs, name="group.cb", op=rf.Sum)
    group.add_done_callback(lambda h: fired.append(h.poll()))
    group.wait(DEADLINE)
    end = time.monotonic() + 10
    while not fired and time.monotonic() < end:  # it runs on the thread that finished the last
        time.sleep(0.001)
    out["group_callback"] = fired
    return out


@pytest.mark.parametrize("n", SIZES)
def test_small_tensors_are_fused_and_a_group_is_one_collective(n: int) -> None:
    count = 64
    results = run_engines(n, small_tensors_body, WIDE_WINDOW, args=(count,), deadline=DEADLINE)
    for res in results:
        for label in ("first", "steady"):
            assert res[label]["tensors"] == count, (label, res[label])
            if n > 1:  # one rank has nothing to wait for: each op is planned at its call
                assert res[label]["collectives"] <= count // 4, (label, res[label])
        # A group is negotiated together and fits the fusion buffer: one collective.
        assert res["grouped"]["collectives"] == 1 and res["grouped"]["tensors"] == count, res
        assert res["group_callback"] == [True]  # once, when the whole group is done
    assert results[0]["grouped"]["fused_items"] == 1


@pytest.mark.parametrize("n", SIZES)
def test_fusion_threshold_zero_runs_one_collective_per_tensor(n: int) -> None:
    results = run_engines(n, small_tensors_body, Config(fusion_threshold_bytes=0),
                          deadline=DEADLINE)
    for res in results:
        for label in ("first", "steady", "grouped"):
            assert res[label]["collectives"] == res[label]["tensors"] == 64, (label, res[label])
    assert results[0]["grouped"]["fused_items"] == 0


@pytest.mark.parametrize("n", SIZES)
def test_cache_capacity_zero_negotiates_every_time(n: int) -> None:
    results = run_engines(n, small_tensors_body, Config(cache_capacity=0), deadline=DEADLINE)
    for res in results:
        assert res["steady"]["bits_sent"] == 0 and res["steady"]["requests_sent"] == 64, res
        assert res["steady"]["cached_names"] == 0 and res["steady"]["eager"] == 0, res
    assert results[0]["steady"]["negotiated"] == 64 and results[0]["steady"]["cache_hits"] == 0


# --- mismatches and local errors -----------------------------------------------------------------


def mismatch_cases(r: int, n: int, rf: Any) -> list[tuple[str, str, Any, str, str]]:
    """(field, tensor name, call, value on ranks 0..n-2, value on rank n-1) for every field the
    ranks must agree on; the last rank is the odd one."""
    last = r == n - 1
    x = np.arange(4, dtype=np.float32)
    gps = rf.global_process_set

    def raw(name: str, **fields: Any) -> Any:
        # A field the public API sets only through a group (group_size).
        return submission.submit("allreduce", x, name, gps, compression="none",
                                 **submission.scales(rf.Sum, 1.0, 1.0), **fields).wait()

    return [
        ("collective", "m.op", lambda: (rf.allgather if last else rf.allreduce)(x, name="m.op"),
         "'allreduce'", "'allgather'"),
        ("reduce_op", "m.reduce_op",
         lambda: rf.allreduce(x, name="m.reduce_op", op=rf.Max if last else rf.Sum), "1", "4"),
        ("dtype", "m.dtype",
         lambda: rf.allreduce(x.astype(np.float64 if last else np.float32), name="m.dtype"),
         "'float32'", "'float64'"),
        ("shape", "m.shape", lambda: rf.allreduce(np.zeros(5 if last else 4), name="m.shape"),
         "(4,)", "(5,)"),
        ("shape[1:]", "m.gather",
         lambda: rf.allgather(np.zeros((2, 4 if last else 3)), name="m.gather"), "(3,)", "(4,)"),
        ("root", "m.root", lambda: rf.broadcast(x, 1 if last else 0, name="m.root"), "0", "1"),
        ("prescale", "m.prescale",
         lambda: rf.allreduce(x, name="m.prescale", prescale_factor=2.0 if last else 1.0),
         "1.0", "2.0"),
        ("postscale", "m.postscale",
         lambda: rf.allreduce(x, name="m.postscale", postscale_factor=0.5 if last else 1.0),
         "1.0", "0.5"),
        ("compression", "m.compression",
         lambda: rf.allreduce(x, name="m.compression",
                              compression=rf.Compression.fp16 if last else rf.Compression.none),
         "'none'", "'fp16'"),
        # The stand-in device (ringflow.devices.fake): the request names the device kind.
        ("device", "m.device",
         lambda: rf.allreduce(fake.to_fake(x) if last else x, name="m.device", op=rf.Sum),
         "'cpu'", "'fake'"),
        ("group", "m.group.0",
         lambda: rf.allreduce(x, name="m.group.0") if last
         else rf.grouped_allreduce([x], name="m.group"), "'m.group'", "''"),
        # The odd rank's group size must not exceed the group's names (a larger one waits for
        # names that never come; see test_groups_of_different_sizes_fail_rather_than_stall).
        ("group_size", "m.gs.0",
         lambda: raw("m.gs.0", group="m.gs", group_size=0) if last
         else rf.grouped_allreduce([x], name="m.gs", op=rf.Sum), "1", "0"),
    ]


@pytest.mark.parametrize("n", MULTI)
def test_every_mismatch_fails_on_every_rank_with_one_text_and_the_next_op_works(n: int) -> None:
    def body(r, rf):
        out = {}
        for field, name, call, _, _ in mismatch_cases(r, n, rf):
            out[field] = (name, *failure(call))
            got = rf.allreduce(np.full(3, r + 1.0), name=f"after.{field}", op=rf.Sum)
            assert np.array_equal(got, np.full(3, float(tri(n)))), (field, got)
        # A cached name whose request changes on one rank is negotiated again, and disagrees.
        for _ in range(2):
            rf.allreduce(np.ones(4), name="m.cached", op=rf.Sum)
        out["cached"] = ("m.cached", *failure(rf.allreduce, np.ones(5 if r == n - 1 else 4),
                                              name="m.cached"))
        got = rf.allreduce(np.ones(4), name="m.cached", op=rf.Sum)
        assert np.array_equal(got, np.full(4, float(n))), got
        # Different first dimensions are fine for allgather.
        got = rf.allgather(np.full((r + 1, 3), r), name="ok.gather")
        assert np.array_equal(got, np.concatenate([np.full((q + 1, 3), q) for q in range(n)]))
        return out

    results = run_engines(n, body, deadline=DEADLINE)
    cases = {c[0]: c[3:] for c in mismatch_cases(0, n, ringflow)}
    cases["cached"] = ("(4,)", "(5,)")
    compared = {"collective" if f == "kind" else f for f in COMPARED}
    assert compared | {"shape", "shape[1:]"} <= set(cases), "a compared field has no case"
    for field, (common, odd) in cases.items():
        seen = {res[field] for res in results}
        assert len(seen) == 1, f"{field}: the ranks saw different errors: {seen}"
        ((name, kind, text),) = seen
        assert kind == "MismatchError", (field, kind, text)
        shown = "shape" if field == "cached" else field
        assert f"ranks disagree on {shown} of tensor {name!r}: " in text, text
        assert f"{common} on {ranks_text(list(range(n - 1)))}" in text, text
        assert f"{odd} on rank {n - 1}" in text, text


@pytest.mark.parametrize("n", MULTI)
def test_unnamed_ops_in_swapped_order_are_a_mismatch_that_says_pass_name(n: int) -> None:
    def body(r, rf):
        shapes = [(3,), (5,)] if r < n - 1 else [(5,), (3,)]
        handles = [rf.allreduce_async(np.zeros(s)) for s in shapes]
        out = [failure(h.wait, DEADLINE) for h in handles]
        got = rf.allreduce(np.full(2, r + 1.0), op=rf.Sum)  # unnamed ops pair again afterwards
        assert np.array_equal(got, np.full(2, float(tri(n)))), got
        return out

    results = run_engines(n, body, deadline=DEADLINE)
    for i, (a, b) in enumerate([("(3,)", "(5,)"), ("(5,)", "(3,)")]):
        ((kind, text),) = {res[i] for res in results}
        assert kind == "MismatchError"
        assert (f"shape of tensor 'allreduce.noname.{i}': {a} on {ranks_text(list(range(n - 1)))}"
                f"; {b} on rank {n - 1}") in text, text
        assert "pass name=" in text


@pytest.mark.parametrize("n", SIZES)
def test_a_local_validation_failure_reaches_every_rank_and_the_next_op_works(n: int) -> None:
    bad = n - 1  # the rank whose tensor cannot take part

    def body(r, rf):
        out = {}
        x = np.ones(4, np.float32)
        out["dtype"] = failure(rf.allreduce, np.ones(4, np.complex64) if r == bad else x,
                               name="l.dtype")
        rf.allreduce(x, name="l.after1")
        out_buf = np.empty(8, np.float32)[::2] if r == bad else np.empty(4, np.float32)
        out["out"] = failure(rf.allreduce, x, name="l.out", out=out_buf)
        rf.allreduce(x, name="l.after2")
        out["bool"] = failure(rf.allreduce, np.ones(3, bool), name="l.bool", op=rf.Average)
        out["root"] = failure(rf.broadcast, x, n, name="l.root")
        out["splits"] = failure(rf.alltoall, np.ones((3, 2)), splits=[4] + [0] * (n - 1),
                                name="l.splits")
        out["rows"] = failure(rf.reducescatter, np.float32(1.0), name="l.rows")
        out["grouped rows"] = failure(rf.grouped_reducescatter, [np.ones((n, 2)), np.float32(1)],
                                      name="l.grows")
        if n > 1:  # without splits the rows must divide evenly among the ranks (Horovod's rule)
            out["even"] = failure(rf.alltoall, np.ones((n + 1, 2)), name="l.even")
        rows, splits = rf.alltoall(np.full((2 * n, 1), r), name="l.even.ok")
        assert np.array_equal(rows, np.repeat(np.arange(n), 2)[:, None]), rows
        assert list(splits) == [2] * n, splits
        got = rf.allreduce(np.full(4, r + 1.0), name="l.after3", op=rf.Sum)
        assert np.array_equal(got, np.full(4, float(tri(n)))), got
        return out

    results = run_engines(n, body, deadline=DEADLINE)
    expected = {
        "dtype": f"rank {bad}: tensor 'l.dtype' has dtype complex64, which ringflow cannot",
        "out": f"rank {bad}: the output for 'l.out' must be a C-contiguous array of shape (4,)",
        "bool": "rank 0: tensor 'l.bool' has dtype bool, which cannot be averaged or scaled",
        "root": f"rank 0: broadcast of 'l.root': root rank {n} is outside 0..{n - 1}",
        "splits": f"rank 0: alltoall of 'l.splits': splits [4{', 0' * (n - 1)}] must be {n}",
        "rows": "rank 0: reducescatter of 'l.rows' splits the first dimension and needs at least",
        "grouped rows": "rank 0: reducescatter of 'l.grows.1' splits the first dimension",
        "even": (f"rank 0: alltoall of 'l.even': splits not provided, but the first dimension "
                 f"of the tensor ({n + 1}) is not an even multiple of the number of ranks ({n})"),
    }
    if n == 1:
        del expected["even"]
    for key, fragment in expected.items():
        kind, text = one_error(results, key)
        assert kind == "TensorError" and fragment in text, (key, kind, text)


@pytest.mark.parametrize("n", MULTI)
def test_a_name_submitted_again_while_in_flight_raises_at_the_call(n: int) -> None:
    def body(r, rf):
        dup = None
        if r == 0:  # the others submit it only after the barrier: it cannot be done by then
            first = rf.allreduce_async(np.full(4, r + 1.0), name="l.dup", op=rf.Sum)
            dup = failure(rf.allreduce_async, np.ones(4), name="l.dup")
        rf.barrier()
        if r != 0:
            first = rf.allreduce_async(np.full(4, r + 1.0), name="l.dup", op=rf.Sum)
        assert np.array_equal(first.wait(DEADLINE), np.full(4, float(tri(n))))  # it goes on
        # A group is refused as a whole: none of it is taken.
        if r == 0:
            pending = rf.allreduce_async(np.ones(2), name="g.1", op=rf.Sum)
            group = failure(rf.grouped_allreduce_async, [np.ones(2)] * 3, name="g")
            assert rf.engine._pending.keys() == {(0, "g.1")}  # g.0 and g.2 were not taken
        rf.barrier()
        if r != 0:
            pending = rf.allreduce_async(np.ones(2), name="g.1", op=rf.Sum)
        pending.wait(DEADLINE)
        return dup, group if r == 0 else None

    results = run_engines(n, body, deadline=DEADLINE)
    kind, text = results[0][0]
    assert kind == "TensorError"
    assert text.startswith("tensor 'l.dup' was submitted again while it was in flight")
    kind, text = results[0][1]
    assert kind == "TensorError" and text.startswith("tensor 'g.1' was submitted again")


@pytest.mark.parametrize("odd", ["coordinator", "worker"])
def test_groups_of_different_sizes_fail_rather_than_stall(odd: str) -> None:
    """One rank groups two tensors where the others group one: every rank should get one
    MismatchError naming group_size, and nothing should stay pending (or end the job)."""
    n = 3
    odd_rank = 0 if odd == "coordinator" else n - 1

    def body(r, rf):
        k = 2 if r == odd_rank else 1
        error = failure(rf.grouped_allreduce, [np.ones(3)] * k, name="g", op=rf.Sum)
        left = sorted(name for _, name in rf.engine._pending)
        got = rf.allreduce(np.ones(2), name="after", op=rf.Sum)
        return error, left, got.tolist()

    results = run_engines(n, body, Config(deadlock_shutdown_s=1.0), deadline=DEADLINE)
    kind, text = one_error([{"e": res[0]} for res in results], "e")
    assert kind == "MismatchError" and "group_size" in text, text
    assert all(res[1] == [] and res[2] == [n, n] for res in results), results


# --- stalls ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", MULTI)
def test_a_stall_past_its_limit_fails_the_job_with_one_text(n: int) -> None:
    others_failed = threading.Event()

    def body(r, rf):
        rf.allreduce(np.ones(2), name="st.ok")
        if r == n - 1:  # skips the collective until the others have given up on it
            assert others_failed.wait(DEADLINE)
            return failure(rf.allreduce, np.ones(2), name="st.skipped")
        error = failure(rf.allreduce, np.ones(2), name="st.skipped")
        others_failed.set()
        return error

    results = run_engines(n, body, Config(stall_shutdown_s=1.0), deadline=DEADLINE)
    kind, text = one_error([{"e": e} for e in results], "e")
    assert kind == "StallError", text
    assert "tensor 'st.skipped'" in text and f"missing ranks [{n - 1}]" in text, text
    assert "RINGFLOW_STALL_SHUTDOWN_S" in text


@pytest.mark.parametrize("n", MULTI)
def test_ranks_waiting_in_different_collectives_fail_as_a_deadlock(n: int) -> None:
    def body(r, rf):
        name = "dl.first" if r == 0 else "dl.second"  # nobody can go on
        return failure(rf.allreduce, np.ones(2), name=name)

    results = run_engines(n, body, Config(deadlock_shutdown_s=0.5), deadline=DEADLINE)
    kind, text = one_error([{"e": e} for e in results], "e")
    assert kind == "StallError" and text.startswith("deadlock: every rank"), text
    assert "'dl.first' submitted by ranks [0], missing ranks " in text, text
    assert "RINGFLOW_DEADLOCK_SHUTDOWN_S" in text


# --- join ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_join_with_uneven_steps_returns_the_last_rank(n: int) -> None:
    steps = [2 + 3 * q for q in range(n)]  # rank n-1 does the most steps, so it joins last

    def body(r, rf):
        for s in range(steps[r]):
            got = rf.allreduce(np.full(6, r + 1, np.float64), name=f"j.{s}", op=rf.Sum)
            want = sum(q + 1 for q in range(n) if steps[q] > s)  # joined ranks add zeros
            assert np.array_equal(got, np.full(6, float(want))), (s, got, want)
        last = rf.join()
        got = rf.allreduce(np.full(2, r + 1.0), name="j.after", op=rf.Sum)
        assert np.array_equal(got, np.full(2, float(tri(n)))), got
        return last

    assert run_engines(n, body, deadline=DEADLINE) == [n - 1] * n


@pytest.mark.parametrize("n", SIZES)
def test_join_every_rank_first_with_cached_and_new_names(n: int) -> None:
    # Horovod's test_horovod_join_allreduce, widened: each rank joins first in turn while the
    # others run allreduce and barrier (the collectives that go on past a join; allgather and
    # broadcast fail, and the next operation works), under names every rank negotiated before
    # (their requests travel as cache bits, the small allreduce with its data) and under new
    # names. A plan of cache bits while a rank had joined used to make rank 0 forget that
    # rank's request, and the rank's next bit for the name ended the job ("internal error in
    # the engine: KeyError(0)").
    def ops(r: int, rf: Any, prefix: str, first: int | None) -> None:
        others = tri(n) - (0 if first is None else first + 1)  # a joined rank adds zeros
        got = rf.allreduce(np.full(5, r + 1, np.int32), name=f"{prefix}.small", op=rf.Sum)
        assert np.array_equal(got, np.full(5, others)), (prefix, first, got)
        got = rf.allreduce(np.full(BIG, r + 1.0), name=f"{prefix}.big", op=rf.Average)
        assert np.allclose(got, others / n), (prefix, first, got[:3])  # still over n ranks
        if first is None:
            got = rf.allgather(np.full((r + 1, 2), r), name=f"{prefix}.gather")
            want = np.concatenate([np.full((q + 1, 2), q) for q in range(n)])
            assert np.array_equal(got, want), (prefix, got)
            got = rf.broadcast(np.full(3, r), 0, name=f"{prefix}.bcast")
            assert np.array_equal(got, np.full(3, 0)), (prefix, got)
        else:
            for kind, call in (("Allgather", lambda: rf.allgather(np.ones((1, 2)),
                                                                  name=f"{prefix}.gather")),
                               ("Broadcast", lambda: rf.broadcast(np.ones(3), (first + 1) % n,
                                                                  name=f"{prefix}.bcast"))):
                _, text = failure(call)
                assert f"{kind} is not supported with Join" in text, text
        rf.barrier()

    def body(r, rf):
        lasts = []
        for first in range(n):
            for warm in (False, True):
                if warm:  # every rank takes part: the next submissions are cache bits
                    ops(r, rf, "cached", None)
                if r != first:
                    ops(r, rf, "cached", first)
                    ops(r, rf, f"new.{first}.{warm}", first)
                lasts.append(rf.join())
        return lasts

    results = run_engines(n, body, deadline=DEADLINE)
    # join() returns the last rank to join: the same on every rank, never the first one.
    for i, lasts in enumerate(zip(*results, strict=True)):
        assert len(set(lasts)) == 1 and (n == 1 or lasts[0] != i // 2), (i, lasts)


@pytest.mark.parametrize("n", MULTI)
def test_unnamed_operations_pair_up_after_a_join(n: int) -> None:
    # Rank 0 joins at once and skips the unnamed calls the others make meanwhile; join() is
    # where every rank counts unnamed names afresh. Counted on, rank 0's next barrier paired
    # with the others' second one, and the job deadlocked.
    def body(r, rf):
        if r != 0:
            rf.barrier()
            got = rf.allreduce(np.full(2, r + 1.0), op=rf.Sum)
            assert np.array_equal(got, np.full(2, tri(n) - 1.0)), got
        rf.join()
        rf.barrier()
        return rf.allreduce(np.full(2, r + 1.0), op=rf.Sum).tolist()

    assert run_engines(n, body, deadline=10.0) == [[float(tri(n))] * 2] * n


@pytest.mark.parametrize("n", MULTI)
def test_joined_ranks_take_part_in_allreduce_and_barrier_only(n: int) -> None:
    # Horovod 0.28's rule: after a join only allreduce (and barrier) go on; every other
    # collective fails on every rank that called it (test_horovod_join_allgather and
    # test_horovod_join_broadcast expect the error), and the next operation works.
    def body(r, rf):
        if r == 0:
            return rf.join(), None
        out: dict[str, Any] = {}
        got = rf.allreduce(np.full(3, r + 1.0), name="jo.sum", op=rf.Sum)
        assert np.array_equal(got, np.full(3, tri(n) - 1.0)), got  # rank 0 adds zeros
        got = rf.allreduce(np.full(3, r + 1.0), name="jo.avg", op=rf.Average)
        assert np.allclose(got, (tri(n) - 1.0) / n), got  # the mean is still over n ranks
        rf.barrier()
        out["allgather"] = failure(rf.allgather, np.full((r, 2), r), name="jo.gather")
        out["broadcast"] = failure(rf.broadcast, np.full(4, r), n - 1, name="jo.bcast")
        out["reducescatter"] = failure(rf.reducescatter, np.ones((n, 2)), name="jo.rs")
        out["alltoall"] = failure(rf.alltoall, np.ones((n - 1, 2)),
                                  splits=[0] + [1] * (n - 1), name="jo.a2a")
        if r < n - 1:
            return rf.join(), out
        # Rank n-1 joins last: this allreduce is ready only once every other rank has joined.
        got = rf.allreduce(np.full(1, 5.0), name="jo.alone", op=rf.Sum)
        assert np.array_equal(got, [5.0]), got
        return rf.join(), out

    results = run_engines(n, body, deadline=DEADLINE)
    assert [last for last, _ in results] == [n - 1] * n
    workers = [out for _, out in results[1:]]
    for kind_name in ("allgather", "broadcast", "reducescatter", "alltoall"):
        kind, text = one_error(workers, kind_name)
        assert kind == "TensorError", text
        assert f"{kind_name.capitalize()} is not supported with Join at this time" in text, text
        assert f"ranks [0] have joined, so they cannot take part in {kind_name}" in text, text


# --- process sets --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_process_sets_add_run_collectives_within_and_remove(n: int) -> None:
    half = (n + 1) // 2
    groups = [list(range(half)), list(range(half, n))] if n > 1 else [[0]]

    def body(r, rf):
        out: dict[str, Any] = {}
        sets = [rf.add_process_set(g) for g in groups]
        out["ids"] = [ps.process_set_id for ps in sets]
        mine = next(ps for ps in sets if ps.included())
        members = mine.ranks
        assert mine.size() == len(members) and mine.rank() == members.index(r)
        hs = [rf.allreduce_async(np.full(5, (r + 1) * (i + 1), np.int64), name=f"ps.{i}",
                                 op=rf.Sum, process_set=mine) for i in range(20)]
        for i, h in enumerate(hs):
            want = sum(q + 1 for q in members) * (i + 1)
            assert np.array_equal(h.wait(DEADLINE), np.full(5, want)), (i, want)
        got = rf.allgather(np.full(1, r), name="ps.gather", process_set=mine)
        assert got.tolist() == members, got
        root = members[-1]  # a global rank, as in Horovod
        got = rf.broadcast(np.full(2, r), root, name="ps.bcast", process_set=mine)
        assert got.tolist() == [root] * 2, got
        got = rf.reducescatter(np.full((len(members), 2), r + 1), name="ps.rs", op=rf.Sum,
                               process_set=mine)
        assert got.tolist() == [[sum(q + 1 for q in members)] * 2], got
        rf.barrier(process_set=mine)
        outsider = next((q for q in range(n) if q not in members), None)
        if outsider is not None:
            out["root"] = failure(rf.broadcast, np.ones(2), outsider, name="ps.root",
                                  process_set=mine)
        others = [ps for ps in sets if not ps.included()]
        if others:
            out["non_member"] = failure(rf.allreduce, np.ones(2), name="ps.outsider",
                                        process_set=others[0])
        got = rf.allreduce(np.full(2, r + 1), name="ps.global", op=rf.Sum)
        assert got.tolist() == [tri(n)] * 2, got
        # Only rank 0 submits this one; removing the set fails it instead of leaving it waiting.
        orphan = None
        if r == 0 and len(groups[0]) > 1:
            orphan = rf.allreduce_async(np.ones(2), name="ps.orphan", process_set=sets[0])
        out["removed"] = [rf.remove_process_set(ps) for ps in sets]
        if orphan is not None:
            out["orphan"] = failure(orphan.wait, DEADLINE)
        out["after_remove"] = failure(rf.allreduce, np.ones(2), name="ps.gone",
                                      process_set=mine)
        again = rf.add_process_set(list(range(1, n)) if n > 1 else [0])
        if again.included():
            got = rf.allreduce(np.full(2, r), name="ps.again", op=rf.Sum, process_set=again)
            assert got.tolist() == [sum(again.ranks)] * 2, got
        rf.barrier()
        return out

    results = run_engines(n, body, deadline=DEADLINE)
    assert len({tuple(res["ids"]) for res in results}) == 1  # every rank has the same ids
    for r, res in enumerate(results):
        assert res["removed"] == [True] * len(groups)
        kind, text = res["after_remove"]
        assert kind == "TensorError" and "has not been added; call add_process_set()" in text
        if "non_member" in res:
            kind, text = res["non_member"]
            assert kind == "TensorError" and f"rank {r} is not a member of ProcessSet(" in text
    if len(groups[0]) > 1:
        kind, text = results[0]["orphan"]
        assert kind == "TensorError"
        assert "process set 1 was removed while 'ps.orphan' was pending" in text, text
    for group in groups:
        if len(group) < n:  # each member of the set sees one text
            kind, text = one_error([results[q] for q in group], "root")
            assert kind == "TensorError" and "is not a member of the process set" in text
            assert "root_rank is a global rank" in text, text


# --- coordinator-reduced small tensors (eager) ----------------------------------------------------


def eager_cases() -> list[tuple[Any, int, Any, float, float, Any]]:
    """(dtype, length, op, prescale, postscale, compression), around the eager limit."""
    none, sum_, avg = ringflow.Compression.none, ringflow.Sum, ringflow.Average
    cases = []
    for dtype in (np.float32, np.float64, np.float16, np.int32):
        limit = EAGER_BYTES // np.dtype(dtype).itemsize
        for length in (0, 1, 5, 1001, limit, limit + 1):
            cases.append((dtype, length, sum_, 1.0, 1.0, none))
        cases.append((dtype, 333, avg, 1.0, 1.0, none))
        cases.append((dtype, 333, sum_, 0.5, 3.0, none))
    cases.append((np.float32, 777, avg, 2.0, 1.0, ringflow.Compression.fp16))
    cases.append((np.float64, 777, sum_, 1.0, 0.25, ringflow.Compression.bf16))
    return cases


def eager_input(rank: int, i: int, dtype: Any, length: int) -> np.ndarray:
    rng = np.random.default_rng(7919 * i + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, length).astype(dtype)
    return rng.standard_normal(length).astype(dtype)


@pytest.mark.parametrize("shm", [False, True], ids=["ring", "shm"])
@pytest.mark.parametrize("n", SIZES)
def test_small_cached_allreduces_are_reduced_by_the_coordinator(n: int, shm: bool) -> None:
    """Each name runs negotiated (a data-plane collective), then cached (eager when small).

    Random inputs (fixed seeds): every rank computes every rank's input, so the closed form is a
    sum in rank order. On shared memory, which adds in rank order as the coordinator does, the
    two rounds give the same bits; the ring adds in segment order (equal to a rounding).
    """
    cases = eager_cases()

    def body(r, rf):
        results: dict[int, bytes] = {}
        eager = {}
        for attempt in ("negotiated", "cached"):
            before = rf.stats()
            handles = [rf.allreduce_async(eager_input(r, i, dtype, length), name=f"e.{i}", op=op,
                                          prescale_factor=pre, postscale_factor=post,
                                          compression=comp)
                       for i, (dtype, length, op, pre, post, comp) in enumerate(cases)]
            for i, (h, (dtype, length, op, pre, post, comp)) in enumerate(
                    zip(handles, cases, strict=True)):
                got = h.wait(DEADLINE)
                parts = [eager_input(q, i, dtype, length).astype(np.float64) * pre
                         for q in range(n)]
                if np.dtype(dtype).kind == "i":
                    parts = [np.trunc(p) for p in parts]  # the prescaled input is cast back
                want = np.sum(parts, axis=0) * post / (n if op == rf.Average else 1)
                tol = 2e-2 if np.dtype(dtype) == np.float16 or comp is not rf.Compression.none \
                    else 1e-5
                if np.dtype(dtype).kind == "i":
                    want = np.trunc(want)
                assert got.dtype == np.dtype(dtype) and got.shape == (length,), (i, got)
                assert np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * n), (
                    attempt, i, got[:3], want[:3])
                if attempt == "negotiated":
                    results[i] = got.tobytes()
                elif shm:
                    assert got.tobytes() == results[i], f"e.{i}: the cached result differs"
            eager[attempt] = delta(before, rf.stats())["eager"]
        return eager

    results = run_engines(n, body, deadline=DEADLINE, shm=shm)
    for eager in results:
        assert eager["negotiated"] == 0, eager  # the first round negotiates: no data travels
        if n == 1:  # a job of one rank completes every cached call in the caller
            assert eager["cached"] == 0, eager
            continue
        # Fused: fewer eager items than cases; the largest cases are not eager at all.
        assert 1 <= eager["cached"] < len(cases), eager


@pytest.mark.parametrize("n", SIZES)
def test_an_eager_allreduce_sends_no_data_plane_message(n: int) -> None:
    def body(r, rf):
        x = np.full(100, r + 1.0)
        rf.allreduce(x, name="tiny", op=rf.Sum)  # negotiated: the ring
        rf.barrier()
        if r == 0:
            rf.world.reset_counts()
        rf.barrier()
        before = rf.stats()["eager"]
        got = rf.allreduce(x, name="tiny", op=rf.Sum)  # cached: the coordinator reduces it
        assert np.array_equal(got, np.full(100, float(tri(n))))
        after = rf.stats()["eager"]
        rf.barrier()
        return after - before, sum(m for m, _ in rf.world.sent.values())

    # Without the lane (a job of one rank would complete the cached call in the caller).
    results = run_engines(n, body, Config(timeout_s=2 * DEADLINE, lane_wait_us=0),
                          deadline=DEADLINE)
    assert all(eager == 1 and data_messages == 0 for eager, data_messages in results), results


# --- callbacks, barrier, groups ------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_a_done_callback_may_submit_the_next_op(n: int) -> None:
    def body(r, rf):
        chained: list[Any] = []
        first = rf.allreduce_async(np.full(3, r + 1.0), name="cb.first", op=rf.Sum)
        first.add_done_callback(lambda h: chained.append(
            rf.allreduce_async(h.wait() * 2, name="cb.second", op=rf.Sum)))
        first.wait(DEADLINE)
        end = time.monotonic() + 10
        while not chained and time.monotonic() < end:  # on an engine thread, after the wait
            time.sleep(0.001)
        assert len(chained) == 1, "the callback did not run"
        got = chained[0].wait(DEADLINE)
        assert np.array_equal(got, np.full(3, 2.0 * tri(n) * n)), got
        # Registered on a finished handle: it runs at once, on this thread.
        ran_on: list[str] = []
        first.add_done_callback(lambda h: ran_on.append(threading.current_thread().name))
        assert ran_on == [threading.current_thread().name]
        # A blocking collective from inside a callback would wait for the thread that runs
        # the callback; a chain of async ones goes on.
        values: list[float] = []

        def step(h: Any) -> None:
            values.append(float(h.wait()[0]))
            if len(values) < 5:
                rf.allreduce_async(h.wait(), name=f"cb.chain.{len(values)}",
                                   op=rf.Sum).add_done_callback(step)

        rf.allreduce_async(np.ones(1), name="cb.chain.0", op=rf.Sum).add_done_callback(step)
        end = time.monotonic() + 10
        while len(values) < 5 and time.monotonic() < end:
            time.sleep(0.001)
        return values

    assert run_engines(n, body, deadline=DEADLINE) == [[float(n ** k) for k in range(1, 6)]] * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_failing_done_callback_fails_neither_its_op_nor_the_job(n: int) -> None:
    def body(r, rf):
        hs = [rf.allreduce_async(np.ones(3), name=f"cbx.{i}", op=rf.Sum) for i in range(4)]
        hs[0].add_done_callback(lambda h: 1 / 0)
        got = [h.wait(1).tolist() for h in hs]  # hangs today: the others are never finished
        return got, rf.allreduce(np.ones(1), name="cbx.next", op=rf.Sum).tolist()

    assert run_engines(n, body, deadline=DEADLINE) == [([[n] * 3] * 4, [n])] * n


@pytest.mark.parametrize("n", SIZES)
def test_barrier_returns_only_once_every_rank_has_called_it(n: int) -> None:
    arrived: list[int] = []
    lock = threading.Lock()

    def body(r, rf):
        seen = []
        for round_ in range(3):
            time.sleep(0.002 * ((r + round_) % n))  # arrive in a different order each round
            with lock:
                arrived.append(r)
            rf.barrier()
            with lock:
                seen.append(len(arrived))
            rf.barrier()  # nobody arrives for the next round before everyone has looked
        return seen

    results = run_engines(n, body, deadline=DEADLINE)
    assert results == [[n, 2 * n, 3 * n]] * n


@pytest.mark.parametrize("n", SIZES)
def test_grouped_ops_are_exact_and_each_group_is_one_collective(n: int) -> None:
    def body(r, rf):
        out = {}
        xs = [np.full(3 + i, (r + 1) * (i + 1), np.float64) for i in range(5)]
        before = rf.stats()
        got = rf.grouped_allreduce(xs, name="gar", op=rf.Sum)
        out["allreduce"] = delta(before, rf.stats())["collectives"]
        assert all(np.array_equal(g, np.full(3 + i, tri(n) * (i + 1.0)))
                   for i, g in enumerate(got))
        before = rf.stats()
        got = rf.grouped_allgather([np.full((r + i, 2), r) for i in range(4)], name="gag")
        out["allgather"] = delta(before, rf.stats())["collectives"]
        for i, g in enumerate(got):
            assert np.array_equal(g, np.concatenate([np.full((q + i, 2), q) for q in range(n)]))
        got = rf.grouped_reducescatter([np.full((n * (i + 1), 2), r + 1) for i in range(3)],
                                       name="grs", op=rf.Sum)
        assert all(np.array_equal(g, np.full((i + 1, 2), tri(n))) for i, g in enumerate(got))
        # Unnamed groups are numbered by call order, like unnamed tensors.
        got = rf.grouped_allreduce([np.full(2, r + 1)] * 2, op=rf.Sum)
        assert all(g.tolist() == [tri(n)] * 2 for g in got)
        return out

    results = run_engines(n, body, WIDE_WINDOW, deadline=DEADLINE)
    assert all(res == {"allreduce": 1, "allgather": 1} for res in results), results


# --- dtypes, ops, lengths ------------------------------------------------------------------------

LENGTHS = [0, 1, 7, BIG]
OPS = ["Sum", "Min", "Max", "Product", "Average"]


def expected(dtype: np.dtype, op: str, n: int) -> tuple[Any, Any]:
    """(rank r's value as a function, the result) of an allreduce where rank r gives r + 1."""
    if dtype == np.bool_:  # rank 0 gives True, the others False
        return (lambda r: r == 0), {"Sum": True, "Max": True}.get(op, n == 1)
    want = {"Sum": tri(n), "Min": 1, "Max": n, "Product": math.factorial(n),
            "Average": (n + 1) / 2}[op]
    if op == "Average" and dtype.kind in "iu":
        want = int(tri(n) / n)  # integers: the mean rounded toward zero
    return (lambda r: r + 1), want


@pytest.mark.parametrize("shm", [False, True], ids=["ring", "shm"])
@pytest.mark.parametrize("n", SIZES)
def test_allreduce_of_every_dtype_op_and_length_is_exact(n: int, shm: bool) -> None:
    """Every dtype of ringflow.ops.DTYPES with every op (Sum also at a large odd length), twice:
    negotiated (the ring or shared memory), then cached (the coordinator for the small ones)."""
    cases = []
    for dtype in DTYPES.values():
        for op in OPS:
            if dtype == np.bool_ and op == "Average":
                continue  # refused: see the local validation test
            for length in LENGTHS if op == "Sum" else LENGTHS[:-1]:
                cases.append((dtype, op, length))

    def body(r, rf):
        for attempt in ("negotiated", "cached"):
            handles = []
            for dtype, op, length in cases:
                value, _ = expected(dtype, op, n)
                x = np.full(length, value(r), dtype)
                handles.append(rf.allreduce_async(x, name=f"d.{dtype.name}.{op}.{length}",
                                                  op=getattr(rf, op)))
            for h, (dtype, op, length) in zip(handles, cases, strict=True):
                got = h.wait(DEADLINE)
                want = np.full(length, expected(dtype, op, n)[1]).astype(dtype)
                assert got.dtype == dtype and got.shape == (length,), (dtype, op, length, got)
                assert np.array_equal(got, want), (attempt, dtype, op, length, got[:3], want[:3])
        return len(cases)

    assert run_engines(n, body, WIDE_WINDOW, deadline=DEADLINE, shm=shm) == [len(cases)] * n


@pytest.mark.parametrize("n", SIZES)
def test_compression_round_trips_and_16_bit_overflow(n: int) -> None:
    def body(r, rf):
        for comp in (rf.Compression.fp16, rf.Compression.bf16):
            for dtype in (np.float32, np.float64):
                # Every partial sum an integer below 256 (at most 8 * 28 at n = 7): exact in
                # bfloat16's 8 significant bits.
                base = np.arange(33, dtype=dtype) % 9
                for _ in range(2):  # negotiated, then cached
                    got = rf.allreduce(base * (r + 1), name=f"c.{comp.name}.{base.dtype.name}",
                                       op=rf.Sum, compression=comp)
                    assert got.dtype == dtype
                    assert np.array_equal(got, base * tri(n)), got[:4]
            got = rf.allgather(np.full(2, r + 0.5, np.float32), name=f"c.{comp.name}.gather")
            assert got.tolist() == [q + 0.5 for q in range(n) for _ in range(2)], got
        # Every rank 40000 (< 65504): a sum of 40000 n overflows float16 midway unless the
        # reduction guards it; the average is 40000 again, to a 16-bit rounding (the ring's
        # partial sums travel in 16 bits: at n = 7 they round, and the mean is 39968).
        for label, x, comp in (
                ("fp16 wire", np.full(9, 40000.0, np.float32), rf.Compression.fp16),
                ("float16", np.full(9, 40000.0, np.float16), rf.Compression.none)):
            for _ in range(2):  # negotiated, then cached
                got = rf.allreduce(x, name=f"o.{label}", op=rf.Average, compression=comp)
                assert got.dtype == x.dtype and np.all(np.isfinite(got)), (label, got[:3])
                assert np.allclose(got, 40000.0, rtol=2.0 ** -10, atol=0), (label, got[:3])

    run_engines(n, body, deadline=DEADLINE)


@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter_at_every_length(n: int) -> None:
    def body(r, rf):
        for length in LENGTHS:
            for dtype in (np.float32, np.int64):
                tag = f"{length}.{np.dtype(dtype).name}"
                # allgather: uneven first dimensions, some ranks with no rows
                rows = [length if q % 2 == 0 else length // 2 for q in range(n)]
                got = rf.allgather(np.full((rows[r], 2), r, dtype), name=f"ag.{tag}")
                want = np.concatenate([np.full((rows[q], 2), q, dtype) for q in range(n)])
                assert got.dtype == dtype and np.array_equal(got, want), ("allgather", tag)
                # broadcast from every root
                for root in range(n):
                    got = rf.broadcast(np.full(length, r, dtype), root, name=f"bc.{root}.{tag}")
                    assert np.array_equal(got, np.full(length, root, dtype)), ("bcast", tag)
                # alltoall: rank q sends splits[q][d] rows of value 100 q + d to rank d
                splits = [[(q + d + length) % 3 for d in range(n)] for q in range(n)]
                x = np.concatenate([np.full((splits[r][d], 1), 100 * r + d, dtype)
                                    for d in range(n)])
                got, got_splits = rf.alltoall(x, splits=splits[r], name=f"a2a.{tag}")
                want = np.concatenate([np.full((splits[q][r], 1), 100 * q + r, dtype)
                                       for q in range(n)])
                assert np.array_equal(got, want), ("alltoall", tag, got, want)
                assert list(got_splits) == [splits[q][r] for q in range(n)], got_splits
                # reducescatter: rows split as evenly as possible, lower ranks first
                got = rf.reducescatter(np.full((length, 1), r + 1, dtype), name=f"rs.{tag}",
                                       op=rf.Sum)
                mine = length // n + (1 if r < length % n else 0)
                assert np.array_equal(got, np.full((mine, 1), tri(n), dtype)), ("rs", tag)

    run_engines(n, body, deadline=DEADLINE)
