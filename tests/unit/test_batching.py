"""The gradient batching policy both adapters share (ringflow.batching), on its own."""

from __future__ import annotations

import pytest

from ringflow.batching import (
    BUCKET_BYTES,
    SMALL_GRADIENT_BYTES,
    Batch,
    GradientBatcher,
    split_groups,
)

KIB = 1024


@pytest.mark.parametrize(("n", "parts", "want"), [
    (5, 2, [[0, 1, 2], [3, 4]]), (3, 7, [[0], [1], [2]]), (4, 1, [[0, 1, 2, 3]]), (0, 3, []),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
])
def test_split_groups_is_horovods_split_list(n: int, parts: int, want: list[list[int]]) -> None:
    assert split_groups(list(range(n)), parts) == want


def test_large_gradients_go_at_once_small_ones_wait_for_the_bucket_or_the_flush() -> None:
    b = GradientBatcher("abcdef")
    assert b.ready("a", SMALL_GRADIENT_BYTES) == [Batch(("a",), False)]
    assert b.ready("b", None) == [Batch(("b",), False)]  # unknown size or sparse: alone
    assert b.ready("c", 10 * KIB) == []
    assert b.ready("d", 0) == []
    assert b.holding
    assert b.ready("e", 5 * SMALL_GRADIENT_BYTES) == [Batch(("e",), False)]
    assert b.flush() == [Batch(("c", "d"), False)]
    assert not b.holding and b.flush() == []


def test_the_bucket_is_a_batch_once_it_holds_bucket_bytes() -> None:
    b = GradientBatcher(range(10))
    step = SMALL_GRADIENT_BYTES - 1
    got = [batch for i in range(10) for batch in b.ready(i, step)] + b.flush()
    per_bucket = -(-BUCKET_BYTES // step)
    assert [batch.keys for batch in got] == [
        tuple(range(i, min(i + per_bucket, 10))) for i in range(0, 10, per_bucket)]
    assert not any(batch.grouped for batch in got)


def test_explicit_groups_complete_in_any_order_the_rest_follow_the_size_rule() -> None:
    b = GradientBatcher(list("abcde"), [["c", "a"], ["zz", "d", "a"]])  # zz unknown, a taken
    assert b.groups == [("c", "a"), ("d",)]
    assert b.ready("a", 1) == []
    assert b.ready("b", 1) == []  # ungrouped, small: bucket
    assert b.ready("d", 1) == [Batch(("d",), True)]
    assert b.ready("c", 1 << 30) == [Batch(("c", "a"), True)]
    assert b.ready("e", 1 << 30) == [Batch(("e",), False)]
    assert b.flush() == [Batch(("b",), False)]
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
