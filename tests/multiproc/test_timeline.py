"""The Chrome-trace timeline: from RINGFLOW_TIMELINE_PATH and started/stopped at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = """
import sys, numpy as np, ringflow as rf
rf.init()
for _ in range(3):
    rf.grouped_allreduce([np.ones(10), np.ones(5)], name="g")
rf.stop_timeline()
rf.start_timeline(sys.argv[1])
rf.allgather(np.ones(2), name="ag")
rf.shutdown()
"""


def test_timeline_per_rank_from_env_and_at_run_time(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    second = tmp_path / "second.json"
    env = dict(os.environ, RINGFLOW_TIMELINE_PATH=str(tmp_path / "tl.json"))
    proc = subprocess.run(
        [sys.executable, "-m", "ringflow.runner", "-np", "2", sys.executable, str(script),
         str(second)], env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    for path, op, tensors in [
        (tmp_path / "tl.json", "ALLREDUCE", {"g.0", "g.1"}),
        (tmp_path / "tl.rank1.json", "ALLREDUCE", {"g.0", "g.1"}),
        (second, "ALLGATHER", {"ag"}),
        (tmp_path / "second.rank1.json", "ALLGATHER", {"ag"}),
    ]:
        events = json.loads(path.read_text())  # a complete JSON array after shutdown
        rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert rows == tensors, (path, rows)
        phases = [e for e in events if e["name"] in (op, f"NEGOTIATE_{op}")]
        begins = [e for e in phases if e["ph"] == "B"]
        ends = [e for e in phases if e["ph"] == "E"]
        assert len(begins) == len(ends) > 0, path
        assert all(e["ts"] >= 0 for e in phases)
        if op == "ALLREDUCE":  # the two tensors of the group were fused into one collective
            assert {e["args"]["fused"] for e in begins if e["name"] == op} == {2}
