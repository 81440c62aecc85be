"""The negotiation logic without I/O: readiness, validation, fusion, the response cache."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from ringflow.negotiation import (
    EAGER_BYTES,
    ONCE,
    CachedAllreduce,
    Coordinator,
    Request,
    Response,
    ResponseCache,
    validate,
)

pytestmark = pytest.mark.timeout(30)


def coordinator(size: int = 3, threshold: int = 1 << 20, capacity: int = 64,
                sets: dict[int, list[int]] | None = None) -> Coordinator:
    members = {0: list(range(size)), **(sets or {})}
    return Coordinator(size, lambda ps: members.get(ps, []), threshold, ResponseCache(capacity))


def ar(name: str, n: int = 4, dtype: str = "float32", **fields: object) -> Request:
    return Request(name=name, kind="allreduce", dtype=dtype, shape=(n,), **fields)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_name_is_ready_once_every_rank_submitted_it_in_any_order(order) -> None:
    c = coordinator()
    for i, rank in enumerate(order):
        assert c.plan() == [], f"ready after only {order[:i]}"
        c.submit(rank, [ar("x")], [])
    (item,) = c.plan()
    assert isinstance(item, Response) and item.names == ("x",) and not item.error
    assert c.plan() == [] and c.stats["negotiated"] == 1


def test_names_submitted_in_different_orders_on_each_rank_are_all_planned() -> None:
    c = coordinator()
    names = [f"t{i}" for i in range(10)]
    for rank in range(3):
        c.submit(rank, [ar(n) for n in names[rank:] + names[:rank]], [])
    planned = [name for item in c.plan() for name in item.names]
    assert sorted(planned) == names


@pytest.mark.parametrize(("field", "odd", "shown"), [
    ("dtype", {"dtype": "float64"}, "'float32' on ranks 0, 1; 'float64' on rank 2"),
    ("shape", {"n": 5}, "(4,) on ranks 0, 1; (5,) on rank 2"),
    ("reduce_op", {"reduce_op": 4}, "1 on ranks 0, 1; 4 on rank 2"),
    ("prescale", {"prescale": 2.0}, "1.0 on ranks 0, 1; 2.0 on rank 2"),
    ("compression", {"compression": "fp16"}, "'none' on ranks 0, 1; 'fp16' on rank 2"),
    ("device", {"device": "cuda:0"}, "'cpu' on ranks 0, 1; 'cuda:0' on rank 2"),
])
def test_a_disagreement_is_one_error_naming_tensor_field_and_values(field, odd, shown) -> None:
    c = coordinator()
    c.submit(0, [ar("g")], [])
    c.submit(2, [ar("g", **odd)], [])
    c.submit(1, [ar("g")], [])
    (item,) = c.plan()
    assert item.error_type == "MismatchError"
    assert item.error == f"ranks disagree on {field} of tensor 'g': {shown}"


def test_allgather_compares_only_the_dimensions_after_the_first() -> None:
    rows = {r: Request("g", "allgather", "int32", (r + 1, 3)) for r in range(3)}
    assert validate("g", rows) is None
    rows[1] = Request("g", "allgather", "int32", (2, 4))
    assert validate("g", rows) == (
        "MismatchError", "ranks disagree on shape[1:] of tensor 'g': (3,) on ranks 0, 2; "
        "(4,) on rank 1")


def test_a_local_failure_of_one_rank_fails_the_name_for_all() -> None:
    c = coordinator()
    c.submit(0, [ar("x")], [])
    c.submit(1, [ar("x", error="tensor 'x' has dtype complex64")], [])
    c.submit(2, [ar("x")], [])
    (item,) = c.plan()
    assert item.error_type == "TensorError"
    assert item.error == "rank 1: tensor 'x' has dtype complex64"


def test_unnamed_mismatch_hints_at_names() -> None:
    problem = validate("allreduce.noname.0", {0: ar("a", 3), 1: ar("a", 5)})
    assert problem is not None and "pass name=" in problem[1]


def submit_all(c: Coordinator, requests: list[Request], size: int = 3) -> list:
    for rank in range(size):
        c.submit(rank, requests, [])
    return c.plan()


def test_fusion_packs_neighbours_up_to_the_threshold() -> None:
    c = coordinator(threshold=128)  # two 64-byte tensors per buffer
    items = submit_all(c, [ar(f"t{i}", 16) for i in range(5)])
    assert [item.names for item in items] == [("t0", "t1"), ("t2", "t3"), ("t4",)]
    assert c.stats["fused_items"] == 2


def test_fusion_keeps_different_dtypes_ops_and_scales_apart() -> None:
    c = coordinator()
    reqs = [ar("a"), ar("b", dtype="float64"), ar("c", reduce_op=4), ar("d", postscale=0.5),
            ar("e"), Request("f", "broadcast", "float32", (4,), root=0)]
    items = submit_all(c, reqs)
    assert sorted(item.names for item in items) == [
        ("a", "e"), ("b",), ("c",), ("d",), ("f",)]


def test_fusion_threshold_zero_disables_fusion() -> None:
    c = coordinator(threshold=0)
    items = submit_all(c, [ar(f"t{i}") for i in range(4)])
    assert [item.names for item in items] == [("t0",), ("t1",), ("t2",), ("t3",)]


def test_a_group_waits_for_all_its_names_and_fuses() -> None:
    c = coordinator()
    group = [ar(f"g.{i}", group="g", group_size=3) for i in range(3)]
    for rank in range(3):
        c.submit(rank, group[:2], [])
    assert c.plan() == []
    for rank in range(3):
        c.submit(rank, group[2:], [])
    (item,) = c.plan()
    assert item.names == ("g.0", "g.1", "g.2")


def test_joined_ranks_count_as_ready_for_allreduce_and_fail_allgather() -> None:
    c = coordinator()
    c.submit(2, [Request("join", "join")], [])
    c.submit(0, [ar("x"), Request("g", "allgather", "int8", (2, 3))], [])
    c.submit(1, [ar("x"), Request("g", "allgather", "int8", (1, 3))], [])
    items = {item.names: item for item in c.plan()}
    assert items[("x",)].joined == (2,) and not items[("x",)].error
    assert items[("g",)].error_type == "TensorError"  # Horovod's rule
    assert items[("g",)].error.startswith("Allgather is not supported with Join at this time")


def record(cache: ResponseCache, items: list) -> None:
    for item in items:
        cache.record(item, lambda key: None)


def test_cache_bits_are_identical_on_two_independent_caches() -> None:
    c = coordinator()
    plans = [submit_all(c, [ar(f"p{step}.{i}", 1 + i) for i in range(6)]) for step in range(3)]
    a, b = ResponseCache(64), ResponseCache(64)
    for plan in plans:
        record(a, plan)
    for plan in plans:
        b.record(plan[0], lambda key: ar(key[1]))  # what each rank submitted does not matter
        record(b, plan[1:])
    assert a.bit_of == b.bit_of and len(a.bit_of) == 18
    assert a.key_of == [k for plan in plans for item in plan for k in (r.key for r in
                                                                        item.requests)]


def test_cache_capacity_limits_the_names_cached() -> None:
    cache = ResponseCache(2)
    reqs = [ar(f"c{i}") for i in range(3)]
    cache.record(Response("allreduce", 0, tuple(reqs)), {r.key: r for r in reqs}.get)
    assert cache.key_of == [(0, "c0"), (0, "c1")]
    assert cache.lookup(reqs[0]) == 0 and cache.lookup(reqs[2]) is None
    assert cache.lookup(ar("c0", 5)) is None  # a changed request goes in full
    assert ResponseCache(0).lookup(reqs[0]) is None


def test_names_used_once_never_take_a_cache_bit():
    cache = ResponseCache(4)
    reqs = [ar(f"{ONCE}torch.pg0.{i}") for i in range(6)] + [ar("mine")]
    cache.record(Response("allreduce", 0, tuple(reqs)), {r.key: r for r in reqs}.get)
    assert cache.key_of == [reqs[-1].key]  # the user's name still gets the first bit
    assert cache.lookup(reqs[0]) is None and cache.lookup(reqs[-1]) == 0


def test_cached_names_take_the_fast_path() -> None:
    c = coordinator()
    reqs = [ar(f"w{i}") for i in range(4)]
    first = submit_all(c, reqs)
    for item in first:
        c.cache.record(item, {r.key: r for r in reqs}.get)
    bits = [c.cache.lookup(r) for r in reqs]
    assert bits == [0, 1, 2, 3]
    for rank in range(3):
        c.submit(rank, [], bits[::-1] if rank else bits)
    (item,) = c.plan()
    assert item == CachedAllreduce((0, 1, 2, 3))
    assert c.stats["cache_hits"] == 4 and c.stats["negotiated"] == 4


def cached_coordinator(reqs: list[Request], **kwargs: object) -> tuple[Coordinator, list[int]]:
    c = coordinator(**kwargs)
    for item in submit_all(c, reqs):
        c.cache.record(item, {r.key: r for r in reqs}.get)
    return c, [c.cache.lookup(r) for r in reqs]


def test_small_cached_allreduces_sent_with_data_are_reduced_by_the_coordinator() -> None:
    reqs = [ar("e0", 3), ar("e1", 2)]
    c, bits = cached_coordinator(reqs)
    for rank in range(3):
        data = [np.full(3, rank + 1.0, np.float32), np.full(2, 10.0 * rank, np.float32)]
        c.submit(rank, [], bits, data)
    (item,) = c.plan()
    assert item == CachedAllreduce((0, 1)) and item.result.dtype == np.float32
    assert item.result.tolist() == [6.0, 6.0, 6.0, 30.0, 30.0]  # fused: e0 then e1
    assert not c.payload


def test_eager_average_and_postscale_are_applied_once_in_rank_order() -> None:
    reqs = [ar("a", 2, reduce_op=0, postscale=2.0), ar("i", 1, dtype="int32", postscale=0.5)]
    c, bits = cached_coordinator(reqs)
    for rank in range(3):
        c.submit(rank, [], bits, [np.full(2, rank, np.float32), np.full(1, rank + 1, np.int32)])
    items = c.plan()
    got = {it.bits: it.result.tolist() for it in items}
    assert got == {(0,): [2.0, 2.0], (1,): [3]}  # mean 1 x 2; ints: 6 x 0.5 in float64


def test_eager_needs_data_from_every_member_and_respects_its_size_limit() -> None:
    n = EAGER_BYTES // 4
    reqs = [ar("m"), ar("big1", n), ar("big2", n)]
    c, bits = cached_coordinator(reqs)
    for rank in range(3):
        data = [None if rank == 2 else np.ones(4, np.float32)]  # rank 2 sends only the bit
        c.submit(rank, [], bits[:1], data)
    (item,) = c.plan()
    assert item == CachedAllreduce((0,)) and item.result is None  # the data plane runs it
    for rank in range(3):
        c.submit(rank, [], bits[1:], [np.ones(n, np.float32)] * 2)
    items = c.plan()
    # Each fits alone; together they exceed EAGER_BYTES: two eager items, not one.
    assert [it.bits for it in items] == [(1,), (2,)]
    assert all(it.result.tolist() == [3.0] * n for it in items)


def test_fusion_window_holds_ready_names_while_others_are_still_coming() -> None:
    c = coordinator(threshold=1000)
    for rank in range(3):
        c.submit(rank, [ar("lone")], [])
    assert [i.names for i in c.plan(hold=60.0)] == [("lone",)]  # nothing else pending: at once
    for rank in range(3):
        c.submit(rank, [ar("a")], [])
    c.submit(0, [ar("b")], [])  # b still waits for ranks 1 and 2
    assert c.plan(hold=60.0) == [] and c.holding
    for rank in (1, 2):
        c.submit(rank, [ar("b")], [])
    (item,) = c.plan(hold=60.0)  # nothing is waiting any more: one fused item
    assert item.names == ("a", "b") and not c.holding


def test_fusion_window_ends_after_hold_or_when_the_buffer_is_full() -> None:
    c = coordinator(threshold=1000)
    for rank in range(3):
        c.submit(rank, [ar("a")], [])
    c.submit(0, [ar("late")], [])
    assert c.plan(hold=0.05) == [] and c.holding
    time.sleep(0.06)
    assert [i.names for i in c.plan(hold=0.05)] == [("a",)]
    for rank in range(3):
        c.submit(rank, [ar("big", 300)], [])  # 1200 bytes >= the threshold: no waiting
    assert [i.names for i in c.plan(hold=60.0)] == [("big",)]


def test_a_stall_names_the_tensor_and_the_missing_ranks() -> None:
    c = coordinator()
    c.submit(0, [ar("s")], [])
    c.submit(2, [ar("s")], [])
    c.first_seen[(0, "s")] -= 100.0
    warnings, fatal = c.stalled(warn_after=10, fail_after=0)
    assert len(warnings) == 1 and "tensor 's'" in warnings[0] and "missing ranks [1]" in warnings[0]
    warnings, fatal = c.stalled(warn_after=10, fail_after=50)
    assert "missing ranks [1]" in fatal and "RINGFLOW_STALL_SHUTDOWN_S" in fatal


def test_a_deadlock_fails_once_nothing_changed_for_its_limit() -> None:
    c = coordinator()
    c.submit(0, [ar("a")], [])
    c.submit(2, [ar("a")], [])
    c.submit(1, [ar("b")], [])  # rank 1 waits in 'b'; ranks 0 and 2 wait for it in 'a'
    assert c.plan() == []
    assert c.stalled(warn_after=0, fail_after=0, deadlock_after=5) == ([], "")  # just changed
    c.last_change -= 10.0
    _, fatal = c.stalled(warn_after=0, fail_after=0, deadlock_after=5)
    assert fatal.startswith("deadlock: ") and "RINGFLOW_DEADLOCK_SHUTDOWN_S" in fatal
    assert "'a' submitted by ranks [0, 2], missing ranks [1]" in fatal
    assert "'b' submitted by ranks [1], missing ranks [0, 2]" in fatal


def test_a_rank_busy_elsewhere_is_a_stall_not_a_deadlock() -> None:
    c = coordinator()
    for rank in (0, 2):
        c.submit(rank, [ar("a")], [])  # rank 1 has submitted nothing: it may be computing
    c.last_change -= 100.0
    assert c.stalled(warn_after=0, fail_after=0, deadlock_after=5) == ([], "")


def test_a_subset_process_set_needs_only_its_members() -> None:
    c = coordinator(size=4, sets={1: [1, 3]})
    c.submit(1, [ar("s", process_set=1)], [])
    assert c.plan() == []
    c.submit(3, [ar("s", process_set=1)], [])
    (item,) = c.plan()
    assert item.process_set == 1 and not item.error


def test_a_stall_names_where_each_rank_called_and_what_the_missing_rank_waits_in() -> None:
    c = coordinator()
    c.submit(0, [ar("s", site="train.py:12")], [])
    c.submit(2, [ar("s", site="train.py:12")], [])
    c.submit(1, [ar("b", site="eval.py:7")], [])
    c.first_seen[(0, "s")] -= 100.0
    warnings, _ = c.stalled(warn_after=10, fail_after=0)
    assert warnings == ["tensor 's' has waited 100 s: submitted by ranks [0, 2], missing ranks "
                        "[1] (ranks 0, 2 called at train.py:12; rank 1 waits in 'b' submitted at "
                        "eval.py:7)"]
    c.submit(2, [ar("t", site="other.py:3")], [])  # rank 2 is now also waiting in 't'
    # first_seen stays in time order, as it is in use (stalled() relies on it): 'b', seen
    # between 's' and 't', has waited as long.
    c.first_seen[(0, "b")] -= 100.0
    c.first_seen[(0, "t")] -= 100.0
    c.warned.clear()
    warnings, _ = c.stalled(warn_after=10, fail_after=0)
    assert "tensor 't' has waited 100 s: submitted by ranks [2], missing ranks [0, 1] (rank 2 " \
           "called at other.py:3; rank 0 waits in 's' submitted at train.py:12; rank 1 waits in " \
           "'b' submitted at eval.py:7)" in warnings


def test_a_cached_name_stalls_with_the_site_of_its_negotiation_and_sites_differ() -> None:
    c = coordinator(size=2)
    for rank in (0, 1):
        c.submit(rank, [ar("w", site=f"rank{rank}.py:1")], [])
    (item,) = c.plan()
    c.cache.record(item, lambda key: item.requests[0])
    assert c.cache.lookup(ar("w", site="elsewhere.py:9")) == 0  # the site is not compared
    c.submit(1, [], [0])  # the next step: rank 1 sends the bit alone; rank 0 never comes
    c.first_seen[(0, "w")] -= 100.0
    warnings, _ = c.stalled(warn_after=10, fail_after=0)
    assert warnings == ["tensor 'w' has waited 100 s: submitted by ranks [1], missing ranks [0] "
                        "(rank 1 called at rank1.py:1; rank 0 has submitted nothing pending (busy "
                        "before its call))"]
    c.submit(0, [ar("v", site="a.py:1")], [])
    c.submit(1, [ar("v", site="b.py:2")], [])  # different lines: each rank's is named
    (item,) = c.plan()
    assert item.names == ("v",)
    c.submit(1, [ar("u", site="b.py:3")], [])
    c.submit(0, [ar("x", site="a.py:5")], [])
    c.first_seen[(0, "u")] -= 100.0  # in time order, as in use: 'u' was seen before 'x'
    c.first_seen[(0, "x")] -= 100.0
    warnings, _ = c.stalled(warn_after=10, fail_after=0)
    assert "rank 1 waits in 'w' submitted at rank1.py:1 (and 1 more)" in warnings[-1], warnings


def test_many_stalled_names_give_a_few_reports_and_a_count() -> None:
    c = coordinator()
    for i in range(12):
        c.submit(0, [ar(f"n{i}")], [])
    for key in c.first_seen:
        c.first_seen[key] -= 100.0
    warnings, _ = c.stalled(warn_after=10, fail_after=0)
    assert len(warnings) == 6 and warnings[-1] == "7 more tensors have waited more than 10 s"
    assert all("missing ranks [1, 2]" in w for w in warnings[:5]), warnings
    assert c.stalled(warn_after=10, fail_after=0) == ([], "")  # each name is reported once


def test_names_made_ready_by_a_departure_are_planned_without_a_new_submission() -> None:
    c = coordinator()
    for rank in (0, 1):
        c.submit(rank, [ar("d")], [])
    assert c.plan() == []  # rank 2 has not submitted: plan() remembers it looked at 'd'
    c.rank_gone(2, "it called shutdown()")
    (item,) = c.plan()
    assert item.error and "rank 2 left the job" in item.error, item
