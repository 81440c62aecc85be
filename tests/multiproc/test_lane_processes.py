"""The same-host lane (ringflow.lane) between processes under ``ringflow-run``: it is used, its
results are right, and a rank that dies or freezes while the others have posted fails the job
as it would on the coordinator's path (the posts give up after ``lane_wait_us``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_failures import launch, same_on_every_rank

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [2, 3])
def test_small_cached_allreduces_take_the_lane_between_processes(tmp_path: Path, n: int) -> None:
    # A long wait: a rank descheduled on a loaded 2-CPU machine must not send every op to rank 0.
    results = launch("lane", n, tmp_path, env={"RINGFLOW_LANE_WAIT_US": "100000"})
    for res in results.values():
        assert res["stats"]["lane"] > 0, res["stats"]


def test_no_lane_when_turned_off(tmp_path: Path) -> None:
    results = launch("lane", 2, tmp_path, env={"RINGFLOW_LANE_WAIT_US": "0"})
    assert all(res["stats"]["lane"] == 0 for res in results.values()), results


def test_a_dead_peer_fails_posted_operations_with_one_text(tmp_path: Path) -> None:
    results = launch("lane_peer_exit", 3, tmp_path)
    survivors = {r: results[r] for r in (0, 1)}
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError" and "rank 2" in error["text"], error
    assert all(res["pending"]["elapsed"] < 5 for res in survivors.values()), survivors


def test_a_frozen_peer_fails_posted_operations_within_the_timeout(tmp_path: Path) -> None:
    timeout_s = 3
    results = launch("lane_peer_frozen", 3, tmp_path, env={"RINGFLOW_TIMEOUT_S": str(timeout_s)},
                     ok=False)
    survivors = {r: results[r] for r in (0, 1)}
    error = same_on_every_rank(survivors, "pending")
    assert error["type"] == "PeerError" and "rank 2 has not responded" in error["text"], error
    assert all(res["pending"]["elapsed"] < timeout_s + 4 for res in survivors.values())
