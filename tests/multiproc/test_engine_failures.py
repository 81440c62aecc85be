"""The engine through ``ringflow-run`` where it takes processes: shutdown, a dead peer, a frozen
peer.

Each test launches one scenario of ``engine_workers/engine_worker.py``; every rank writes what it
saw to ``<rank>.json``. Every surviving rank must fail its pending op within a bounded time, with
one error class and text on every rank that names the cause. Everything else the engine does
(ordering, cache, fusion, mismatches, join, process sets, eager reduction, callbacks, stalls) is
tested at the thread tier, ``tests/inproc/test_engine.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(120)

ROOT = Path(ringflow.__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "engine_workers" / "engine_worker.py")


def launch(scenario: str, n: int, out: Path, env: dict[str, str] | None = None,
           timeout: float = 90, ok: bool = True) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on ``n`` ranks (with ``ok``, it must exit 0); return each reporting
    rank's JSON, by rank."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable, WORKER,
          scenario, str(out)]],
        env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})}, timeout=timeout,
        check=ok, merge_stderr=False)
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


def test_shutdown_fails_pending_ops(tmp_path: Path) -> None:
    results = launch("shutdown_pending", 2, tmp_path)
    for res in results.values():
        assert res["pending"]["type"] == "ShutdownError"
        # By itself ("was shut down") or by rank 0 ("left the job (it called shutdown())").
        assert "shut down" in res["pending"]["text"] or "shutdown()" in res["pending"]["text"], res
        assert res["later"]["type"] == "NotInitializedError"


# lane_*: the name is cached and small, so the survivors post it on the same-host lane first.
@pytest.mark.parametrize("scenario", ["peer_exit", "lane_peer_exit"])
def test_dead_peer_fails_pending_ops_everywhere(tmp_path: Path, scenario: str) -> None:
    results = launch(scenario, 3, tmp_path)
    survivors = {r: results[r] for r in (0, 1)}
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError" and "rank 2" in error["text"], error
    assert all(res["pending"]["elapsed"] < 5 for res in survivors.values()), survivors


def test_a_rank_that_shuts_down_early_is_named_to_the_others(tmp_path: Path) -> None:
    results = launch("shutdown_early", 3, tmp_path)
    error = same_on_every_rank({r: results[r] for r in (0, 2)}, "pending")
    assert error["type"] == "ShutdownError", error
    assert error["text"] == (
        "rank 1 left the job (it called shutdown()) before submitting 'se.after'")


@pytest.mark.parametrize("n", [2, 3])
def test_dead_peer_during_a_collective_fails_it_with_one_text(tmp_path: Path, n: int) -> None:
    # On 2 CPUs, 2 ranks reduce by reading each other's memory and 3 through shared segments
    # (algorithms/shm.py): a rank that vanishes mid-read must give the same error as a socket.
    results = launch("peer_exit_midop", n, tmp_path)
    survivors = {r: results[r] for r in range(n - 1)}
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError" and f"rank {n - 1}" in error["text"], error
    assert all(res["pending"]["elapsed"] < 5 for res in survivors.values()), survivors


@pytest.mark.parametrize("scenario", ["peer_frozen", "lane_peer_frozen"])
def test_frozen_peer_is_detected_within_timeout(tmp_path: Path, scenario: str) -> None:
    timeout_s = 3
    # The frozen rank is killed by rank 0 once the survivors have reported, so the job fails.
    results = launch(scenario, 3, tmp_path, env={"RINGFLOW_TIMEOUT_S": str(timeout_s)},
                     ok=False)
    survivors = {r: results[r] for r in (0, 1)}
    assert sorted(results) == [0, 1], results
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError", error
    assert "rank 2 has not responded" in error["text"] and "RINGFLOW_TIMEOUT_S" in error["text"]
    assert all(res["pending"]["elapsed"] < timeout_s + 4 for res in survivors.values())
