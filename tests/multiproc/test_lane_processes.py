"""The same-host lane (ringflow.lane) between processes under ``ringflow-run``: it is used and its
results are right. A rank that dies or freezes while the others have posted fails the job as on
the coordinator's path: ``test_engine_failures.py`` (the ``lane_*`` scenarios)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_failures import launch

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
