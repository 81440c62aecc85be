"""The engine through ``ringflow-run``: ordering, mismatches, cache, fusion, sets, join, dtypes.

Each test launches one scenario of ``engine_workers/engine_worker.py``; every rank checks its
results in closed form and writes what it saw to ``<rank>.json``; the test compares the ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ringflow

pytestmark = pytest.mark.timeout(120)

ROOT = Path(ringflow.__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "engine_workers" / "engine_worker.py")


def launch(scenario: str, n: int, out: Path, env: dict[str, str] | None = None,
           timeout: float = 90, ok: bool = True) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on ``n`` ranks; return each reporting rank's JSON, by rank."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable, WORKER,
             scenario, str(out)],
            env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})},
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        done = sorted(p.name for p in out.glob("*.json"))
        pytest.fail(f"{scenario} on {n} ranks did not finish within {timeout} s (results written: "
                    f"{done}):\n{exc.stdout}\n{exc.stderr}")
    if ok:
        assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    results = {}
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return results


def same_on_every_rank(results: dict[int, dict[str, Any]], key: str) -> dict[str, Any]:
    """The error recorded under ``key``: the same class and text on every rank."""
    seen = {(results[r][key]["type"], results[r][key]["text"]) for r in results}
    assert len(seen) == 1, f"{key}: ranks saw different errors: {seen}"
    return results[0][key]


def test_200_named_tensors_in_random_order_then_cache_hits(tmp_path: Path) -> None:
    n = 3
    results = launch("random_order", n, tmp_path)
    assert sorted(results) == list(range(n))
    for r, res in results.items():
        first, *steady = res["steps"]
        assert first["tensors"] == 200 and first["requests_sent"] == 200, (r, first)
        for step in res["steps"]:
            # 4 dtypes: at least 4 fused collectives; far fewer than 200 in any case.
            assert 4 <= step["collectives"] <= 50, (r, step)
        for step in steady:
            # Steady state: every name goes as a cache bit, none as a full request.
            assert step["tensors"] == 200, (r, step)
            assert step["bits_sent"] == 200 and step["requests_sent"] == 0, (r, step)
        assert res["stats"]["cached_names"] == 200
    coordinator = results[0]["steps"]
    assert coordinator[0]["negotiated"] == 200
    for step in coordinator[1:]:
        assert step["negotiated"] == 0 and step["cache_hits"] == 200, step


def test_fusion_reduces_many_small_tensors_in_few_collectives(tmp_path: Path) -> None:
    results = launch("fusion", 2, tmp_path)
    for r, res in results.items():
        count = res["count"]
        for label in ("first", "steady"):
            assert res[label]["tensors"] == count, (r, label, res[label])
            assert res[label]["collectives"] <= count // 4, (r, label, res[label])
        # A group is negotiated together and fits the fusion buffer: one collective.
        assert res["grouped"]["collectives"] == 1 and res["grouped"]["tensors"] == count, res
        assert res["group_callback"] == [True], res  # once, when the whole group is done
    assert results[0]["grouped"]["fused_items"] == 1


def test_fusion_threshold_zero_runs_one_collective_per_tensor(tmp_path: Path) -> None:
    results = launch("fusion", 2, tmp_path, env={"RINGFLOW_FUSION_THRESHOLD_BYTES": "0"})
    for res in results.values():
        assert res["steady"]["collectives"] == res["count"], res["steady"]
        assert res["grouped"]["collectives"] == res["count"], res["grouped"]


def test_cache_capacity_zero_negotiates_every_time(tmp_path: Path) -> None:
    results = launch("fusion", 2, tmp_path, env={"RINGFLOW_CACHE_CAPACITY": "0"})
    for res in results.values():
        assert res["steady"]["bits_sent"] == 0, res["steady"]
        assert res["steady"]["requests_sent"] == res["count"], res["steady"]
        assert res["first"]["cached_names"] == 0  # nothing was cached
    assert results[0]["steady"]["negotiated"] == results[0]["count"]


# field -> (value on ranks 0..n-2, value on rank n-1), as the message prints them
MISMATCHES = {
    "collective": ("'allreduce'", "'allgather'"),
    "reduce_op": ("1", "4"),
    "dtype": ("'float32'", "'float64'"),
    "shape": ("(4,)", "(5,)"),
    "shape[1:]": ("(3,)", "(4,)"),
    "root": ("0", "1"),
    "prescale": ("1.0", "2.0"),
    "postscale": ("1.0", "0.5"),
    "compression": ("'none'", "'fp16'"),
    "group": ("'m.group'", "''"),
    "cached": ("(4,)", "(5,)"),  # a shape change of a name already in the response cache
}


def test_every_mismatch_fails_on_every_rank_with_one_text(tmp_path: Path) -> None:
    n = 3
    results = launch("mismatch", n, tmp_path)
    assert sorted(results) == list(range(n))
    for field, (common, odd) in MISMATCHES.items():
        error = same_on_every_rank(results, field)
        name = results[0][field]["name"]
        assert error["type"] == "MismatchError", error
        text = error["text"]
        shown = "shape" if field == "cached" else field
        assert f"ranks disagree on {shown} of tensor {name!r}" in text, text
        assert f"{common} on ranks 0, 1" in text and f"{odd} on rank 2" in text, text


def test_unnamed_ops_in_swapped_order_are_detected(tmp_path: Path) -> None:
    results = launch("mismatch", 2, tmp_path)
    for i, (a, b) in enumerate([("(3,)", "(5,)"), ("(5,)", "(3,)")]):
        texts = {(res["unnamed"][i]["type"], res["unnamed"][i]["text"])
                 for res in results.values()}
        assert len(texts) == 1, texts
        ((kind, text),) = texts
        assert kind == "MismatchError"
        assert f"shape of tensor 'allreduce.noname.{i}': {a} on rank 0; {b} on rank 1" in text
        assert "pass name=" in text


def test_local_validation_failure_reaches_every_rank(tmp_path: Path) -> None:
    results = launch("local_errors", 3, tmp_path)
    expected = {
        "dtype": "rank 1: tensor 'l.dtype' has dtype complex64, which ringflow cannot",
        "out": "rank 1: the output for 'l.out' must be a C-contiguous array of shape (4,)",
        "bool": "rank 0: tensor 'l.bool' has dtype bool, which cannot be averaged or scaled",
        "root": "rank 0: broadcast of 'l.root': root rank 3 is outside 0..2",
    }
    for key, fragment in expected.items():
        error = same_on_every_rank(results, key)
        assert error["type"] == "TensorError" and fragment in error["text"], (key, error)
    assert all(res["dup"] == [6.0] * 4 for res in results.values()), results
    second = results[0]["dup_second"]
    assert second["type"] == "TensorError"
    assert second["text"].startswith("tensor 'l.dup' was submitted again while it was in flight")


def test_process_sets(tmp_path: Path) -> None:
    results = launch("process_sets", 4, tmp_path)
    assert sorted(results) == [0, 1, 2, 3]
    for r, res in results.items():
        other = "ranks=[2, 3]" if r < 2 else "ranks=[0, 1]"
        assert res["non_member"]["type"] == "TensorError"
        assert f"rank {r} is not a member of ProcessSet(" in res["non_member"]["text"]
        assert other in res["non_member"]["text"]
        assert res["removed"] == [True, True]
        if r == 0:
            assert res["orphan"]["type"] == "TensorError", res["orphan"]
            assert "process set 1 was removed while 'ps.orphan' was pending" in (
                res["orphan"]["text"])
        assert res["after_remove"]["type"] == "TensorError"
        assert "has not been added; call add_process_set() first" in res["after_remove"]["text"]


def test_join_with_uneven_data(tmp_path: Path) -> None:
    n = 3
    results = launch("join", n, tmp_path)
    assert {res["last"] for res in results.values()} == {n - 1}


def test_every_dtype_and_op_and_compression(tmp_path: Path) -> None:
    n = 4
    results = launch("dtypes_ops", n, tmp_path)
    # 10 numeric dtypes x 5 ops + bool x 4 ops, 4 lengths each; 4 compression round trips; 2
    # fp16-overflow averages.
    assert {res["checked"] for res in results.values()} == {(10 * 5 + 4) * 4 + 4 + 2}
    assert sorted(results) == list(range(n))
    # The cached round of every small allreduce was reduced by rank 0 (some fused together).
    assert all(res["eager"] > 50 for res in results.values()), results


def test_a_done_callback_may_submit_the_next_op(tmp_path: Path) -> None:
    results = launch("callbacks", 3, tmp_path)
    assert sorted(results) == [0, 1, 2]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_cached_allreduces_reduced_by_the_coordinator_match_the_data_plane(
    tmp_path: Path, n: int
) -> None:
    results = launch("eager", n, tmp_path)
    assert sorted(results) == list(range(n))
    assert len({json.dumps(res["digest"]) for res in results.values()}) == 1  # same bits everywhere
    for res in results.values():
        assert 1 <= res["eager"] < res["cases"], res  # fused; the largest ones not eager
