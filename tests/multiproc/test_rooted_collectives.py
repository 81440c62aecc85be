"""reduce, gather and scatter through the engine in numpy, torch and TensorFlow (eager and
``tf.function``), at 1 to 4 ranks through ringflow-run: every dtype, lengths 0, 1, odd and
large, every root, closed forms on every rank, and each error case on every rank followed by an
operation that succeeds (rooted/worker.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(300)

ROOT = Path(ringflow.__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "rooted" / "worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_reduce_gather_scatter(framework: str, np_: int) -> None:
    pytest.importorskip(framework)
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(WORKER),
          framework]], cwd=ROOT, env=ENV, timeout=280)
    out = proc.output
    assert out.count("PASS rank") == np_, out[-6000:]
