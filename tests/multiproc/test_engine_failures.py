"""Failures through ``ringflow-run``: shutdown, a dead peer, a frozen peer, a stall.

Every surviving rank must fail its pending op within a bounded time, with one error class and
text on every rank that names the cause.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine import launch, same_on_every_rank  # same directory (pytest rootdir mode)

pytestmark = pytest.mark.timeout(120)


def test_shutdown_fails_pending_ops(tmp_path: Path) -> None:
    results = launch("shutdown_pending", 2, tmp_path)
    for res in results.values():
        assert res["pending"]["type"] == "ShutdownError"
        # By itself ("was shut down") or by rank 0 ("left the job (it called shutdown())").
        assert "shut down" in res["pending"]["text"] or "shutdown()" in res["pending"]["text"], res
        assert res["later"]["type"] == "NotInitializedError"


def test_dead_peer_fails_pending_ops_everywhere(tmp_path: Path) -> None:
    results = launch("peer_exit", 3, tmp_path)
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


def test_frozen_peer_is_detected_within_timeout(tmp_path: Path) -> None:
    timeout_s = 3
    # The frozen rank is killed by rank 0 once the survivors have reported, so the job fails.
    results = launch("peer_frozen", 3, tmp_path, env={"RINGFLOW_TIMEOUT_S": str(timeout_s)},
                     ok=False)
    survivors = {r: results[r] for r in (0, 1)}
    assert sorted(results) == [0, 1], results
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError", error
    assert "rank 2 has not responded" in error["text"] and "RINGFLOW_TIMEOUT_S" in error["text"]
    assert all(res["pending"]["elapsed"] < timeout_s + 4 for res in survivors.values())


def test_stall_fails_the_tensor_on_every_rank(tmp_path: Path) -> None:
    results = launch("stall", 3, tmp_path, env={"RINGFLOW_STALL_SHUTDOWN_S": "2"})
    error = same_on_every_rank(results, "pending")
    assert error["type"] == "StallError", error
    text = error["text"]
    assert "tensor 'st.skipped'" in text and "missing ranks [2]" in text, text
    assert "RINGFLOW_STALL_SHUTDOWN_S" in text
