"""Overlap with backward changes when gradients are submitted, never what they sum to.

Through ringflow-run, a DistributedOptimizer trains the same model from the same batches twice:
with the default buckets (a first bucket starts while backward runs) and with
``RINGFLOW_BUCKET_BYTES=0`` (everything after backward), and the final parameters must be equal
bit for bit on every rank. That holds wherever the sum's order does not depend on what was
fused (DESIGN.md section 4): shared memory (rank order) at 2 and 3 ranks, the TCP ring at 2
ranks (a + b either way) and at 3 ranks with fusion off. Over shared memory the script runs in
the framework jobs (framework_jobs.py: the same processes as other scripts); over TCP, alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from framework_jobs import TEST_TIMEOUT_S, passed

pytest.importorskip("torch")

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = Path(__file__).resolve().parent / "torch_workers" / "overlap.py"
VERDICT = r"PASS overlap rank {r}: \d+ of \d+ operations started during backward; results equal"


@pytest.mark.parametrize("np", [2, 3], ids=["shm-2", "shm-3"])
def test_overlapped_and_at_end_give_the_same_bits_over_shared_memory(np: int) -> None:
    passed(np, VERDICT)


@pytest.mark.parametrize(("np", "env"), [
    (2, {}),
    (3, {"RINGFLOW_FUSION_THRESHOLD_BYTES": "0"}),
], ids=["tcp-2", "tcp-3-unfused"])
def test_overlapped_and_at_end_give_the_same_bits_over_tcp(np: int, env: dict[str, str]) -> None:
    environ = {**os.environ, **env, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    environ.pop("RINGFLOW_BUCKET_BYTES", None)
    (proc,) = run_commands([[sys.executable, "-m", "ringflow.runner", "-np", str(np),
                             "--transport", "tcp", sys.executable, str(WORKER)]], env=environ,
                           timeout=200)
    out = proc.output
    assert out.count("PASS overlap rank") == np, out[-4000:]
