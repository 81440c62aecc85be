"""The gradient batching policy both adapters share (ringflow.batching), on its own."""

from __future__ import annotations

import pytest

from ringflow.batching import (
    AT_END,
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Batch,
    BucketPolicy,
    GradientBatcher,
    split_groups,
)

KIB = 1024
MIB = 1024 * KIB


@pytest.mark.parametrize(("n", "parts", "want"), [
    (5, 2, [[0, 1, 2], [3, 4]]), (3, 7, [[0], [1], [2]]), (4, 1, [[0, 1, 2, 3]]), (0, 3, []),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
])
def test_split_groups_is_horovods_split_list(n: int, parts: int, want: list[list[int]]) -> None:
    assert split_groups(list(range(n)), parts) == want


def test_buckets_close_at_their_cap_the_first_one_sooner() -> None:
    b = GradientBatcher("abcdefgh", policy=BucketPolicy(4 * MIB))
    assert b.ready("a", 10 * KIB) == []  # the first bucket: 1 MiB
    assert b.holding
    assert b.ready("b", MIB) == [Batch(("a", "b"), False)]
    assert not b.holding
    assert b.ready("c", 2 * MIB) == []  # later buckets: 4 MiB
    assert b.ready("d", 2 * MIB) == [Batch(("c", "d"), False)]
    assert b.ready("e", 5 * MIB) == [Batch(("e",), False)]  # larger than a bucket: at once
    assert b.ready("f", None) == [Batch(("f",), False)]  # unknown size or sparse: alone
    assert b.ready("g", 0) == []
    assert b.flush() == [Batch(("g",), False)]
    assert not b.holding and b.flush() == []
    # The next pass starts with a first bucket again.
    assert b.ready("a", MIB) == [Batch(("a",), False)]


def test_many_small_gradients_make_first_then_full_buckets() -> None:
    b = GradientBatcher(range(40))
    step = 300 * KIB
    got = [batch for i in range(40) for batch in b.ready(i, step)] + b.flush()
    first = -(-FIRST_BUCKET_BYTES // step)
    per_bucket = -(-BUCKET_BYTES // step)
    starts = [0, *range(first, 40, per_bucket)]
    assert [batch.keys for batch in got] == [
        tuple(range(s, e)) for s, e in zip(starts, [*starts[1:], 40], strict=True)]
    assert not any(batch.grouped for batch in got)


def test_at_end_holds_everything_until_the_pass_ends() -> None:
    b = GradientBatcher("abc", policy=AT_END)
    assert b.ready("a", 1 << 30) == [] and b.ready("b", None) == [] and b.ready("c", 1) == []
    assert b.flush() == [Batch(("a", "b", "c"), False)]
    b.policy = BucketPolicy()  # changed between passes (the autotuner)
    assert b.ready("a", 1 << 30) == [Batch(("a",), False)]


def test_explicit_groups_complete_in_any_order_the_rest_follow_the_size_rule() -> None:
    b = GradientBatcher(list("abcde"), [["c", "a"], ["zz", "d", "a"]])  # zz unknown, a taken
    assert b.groups == [("c", "a"), ("d",)]
    assert b.ready("a", 1) == []
    assert b.ready("b", 1) == []  # ungrouped, small: bucket
    assert b.ready("d", 1) == [Batch(("d",), True)]
    assert b.ready("c", 1 << 30) == [Batch(("c", "a"), True)]
    assert b.ready("e", 1 << 30) == [Batch(("b", "e"), False)]  # the bucket reached its cap
    assert b.flush() == []
    # The counts start again: the next step completes the same groups.
    assert b.ready("c", 1) == [] and b.ready("a", 1) == [Batch(("c", "a"), True)]


def test_an_int_splits_the_order_and_reset_forgets_partial_groups() -> None:
    b = GradientBatcher(list(range(5)), 2)
    assert b.groups == [(0, 1, 2), (3, 4)]
    assert b.ready(0, 1) == [] and b.ready(1, 1) == []
    assert b.ready(9, 1) == []  # not in order: size rule
    b.reset()
    assert not b.holding
    assert b.ready(2, 1) == [] and b.ready(0, 1) == [] and b.ready(1, 1) == [
        Batch((0, 1, 2), True)]


def test_all_ready_at_once_is_the_groups_then_one_batch_of_the_rest() -> None:
    b = GradientBatcher(range(6), [[4, 1]])
    assert b.all_ready(range(6)) == [Batch((4, 1), True), Batch((0, 2, 3, 5), False)]
    assert GradientBatcher(range(4), 2).all_ready(range(4)) == [
        Batch((0, 1), True), Batch((2, 3), True)]
    assert GradientBatcher([]).all_ready([]) == []
