"""ringflow.metrics and single_process_scope with ranks as threads (ringflow.testing.run_engines).

Expected values are single-process replays: the same metric fed every rank's samples in one
process must give the same bits; a scoped function runs once, and every rank returns its value.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import ringflow
from ringflow import metrics
from ringflow.single_process import in_single_process_scope
from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 3, 4]
DEADLINE = 30.0


def samples(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Losses spanning many exponents (so that summation order shows), scores and targets."""
    rng = np.random.default_rng(length)
    losses = rng.standard_normal(length) * 10.0 ** rng.integers(-8, 9, length)
    scores = rng.standard_normal((length, 5)).astype(np.float32)
    targets = rng.integers(0, 5, length)
    return losses, scores, targets


def uneven(length: int, n: int, r: int) -> slice:
    """Rank r's part of ``length`` samples: every part a different size, some empty."""
    cuts = np.linspace(0, length, n + 1) ** 1.5 / max(length, 1) ** 0.5
    bounds = [0, *[int(c) for c in cuts[1:-1]], length]
    return slice(bounds[r], bounds[r + 1])


def replay(length: int) -> dict[str, Any]:
    """One process over every sample, in one batch."""
    losses, scores, targets = samples(length)
    mean, total, acc, count = metrics.Mean(), metrics.Sum(), metrics.Accuracy(), metrics.Sum()
    mean.update(losses)
    total.update(losses.astype(np.float32))
    acc.update(scores, targets)
    count.update(np.ones(length, np.int64))
    return {"mean": mean.local(), "sum": total.local(), "accuracy": acc.local(),
            "count": count.local(), "correct": acc.correct}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("length", [0, 1, 7, 1001])
def test_global_metrics_equal_one_process_bit_for_bit(n: int, length: int) -> None:
    losses, scores, targets = samples(length)

    def body(r: int, rf: Any) -> dict[str, Any]:
        part = uneven(length, n, r)
        mean, total, acc, count = (metrics.Mean(), metrics.Sum(), metrics.Accuracy(),
                                   metrics.Sum())
        for chunk in np.array_split(np.arange(part.start, part.stop), 3):  # several updates
            mean.update(losses[chunk])
            total.update(losses[chunk].astype(np.float32))
            acc.update(scores[chunk], targets[chunk])
            count.update(np.ones(chunk.size, np.int64))
        return {"mean": mean.compute(), "sum": total.compute(), "accuracy": acc.compute(),
                "count": count.compute(), "correct": acc.correct,
                "global_sum": metrics.global_sum(targets[part])}

    expected = replay(length)
    expected["global_sum"] = int(targets.sum())
    for got in run_engines(n, body, deadline=DEADLINE):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert (got[key] == value) or (np.isnan(got[key]) and np.isnan(value)), \
                (key, got[key], value)
            assert type(got[key]) is type(value), key
    if length:
        assert expected["accuracy"] == expected["correct"] / length  # the single-process ratio
        assert isinstance(expected["count"], int) and expected["count"] == length


def test_a_sum_is_exact_where_float_addition_is_not() -> None:
    values = np.array([1e16, 1.0, -1e16, 1.0])  # float64 left to right: 0.0 + 1.0 = 1.0
    total = metrics.Sum()
    total.update(values)
    assert total.local() == 2.0
    mean = metrics.Mean()
    mean.update([float("inf"), 1.0])
    assert mean.local() == float("inf")
    mean.update([float("-inf")])
    assert np.isnan(mean.local())


def test_accuracy_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"output of shape \(3, 2, 2\) does not match"):
        metrics.Accuracy().update(np.zeros((3, 2, 2)), np.zeros(2))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_inside_the_local_mode_compute_is_local_and_needs_no_other_rank(n: int) -> None:
    def body(r: int, rf: Any) -> Any:
        acc = metrics.Accuracy()
        acc.update(np.array([r % 2]), np.array([1]))
        if r == 0:  # the others never call compute(): it must not wait for them
            with ringflow.single_process_scope():
                return acc.compute()
        return None

    assert run_engines(n, body, deadline=DEADLINE)[0] == 0.0


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("root", ["first", "last"])
def test_a_scoped_function_runs_once_and_every_rank_gets_its_result(n: int, root: str) -> None:
    root_rank = 0 if root == "first" else n - 1
    runs: list[tuple[int, bool]] = []
    lock = threading.Lock()

    @ringflow.single_process_scope(root_rank=root_rank)
    def validate(epoch: int) -> dict[str, int]:
        with lock:
            runs.append((ringflow.rank(), in_single_process_scope()))
        return {"epoch": epoch, "by": ringflow.rank()}

    def body(r: int, rf: Any) -> list[Any]:
        return [validate(epoch) for epoch in range(3)]

    results = run_engines(n, body, deadline=DEADLINE)
    assert results == [[{"epoch": e, "by": root_rank} for e in range(3)]] * n
    assert runs == [(root_rank, True)] * 3  # once per call, on the root, in the local mode


@ringflow.single_process_scope
def _fails() -> None:
    raise KeyError("checkpoint directory is gone")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_root_s_exception_is_raised_on_every_rank(n: int) -> None:
    def body(r: int, rf: Any) -> tuple[str, str]:
        try:
            _fails()
        except KeyError as exc:
            return type(exc).__name__, str(exc)
        raise AssertionError("no exception")

    assert run_engines(n, body, deadline=DEADLINE) == [
        ("KeyError", "'checkpoint directory is gone'")] * n


def test_the_context_manager_form_is_the_local_mode_and_nests() -> None:
    scope = ringflow.single_process_scope()
    assert not in_single_process_scope()
    with scope:
        with scope:
            assert in_single_process_scope()
        assert in_single_process_scope()
    assert not in_single_process_scope()


def test_a_root_outside_the_job_is_refused() -> None:
    with pytest.raises(ringflow.errors.ConfigError, match="root_rank=-1"):
        ringflow.single_process_scope(root_rank=-1)

    @ringflow.single_process_scope(root_rank=3)
    def f() -> int:
        return 1

    with pytest.raises(ringflow.errors.ConfigError, match="the job has 1 ranks"):
        f()


@pytest.mark.parametrize("n", [2, 3])
def test_a_result_that_cannot_reach_the_other_ranks_fails_every_rank(n: int) -> None:
    @ringflow.single_process_scope
    def unpicklable() -> Any:
        return lambda: None  # pickle refuses a lambda

    def body(r: int, rf: Any) -> str:
        with pytest.raises(TypeError, match="cannot be handed to the other ranks") as info:
            unpicklable()
        return str(info.value).split(" (")[0]

    assert len(set(run_engines(n, body, deadline=DEADLINE))) == 1
