"""reduce, gather and scatter through the engine in numpy, torch and TensorFlow (eager and
``tf.function``), at 1 to 4 ranks through ringflow-run: every dtype, lengths 0, 1, odd and
large, every root, closed forms on every rank, and each error case on every rank followed by an
operation that succeeds (rooted/worker.py). One job per world size runs every installed
framework, one after the other (a job per framework started TensorFlow's and torch's processes
three times as often for the same checks)."""

from __future__ import annotations

import functools
import importlib.util
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


FRAMEWORKS = [f for f in ("numpy", "torch", "tensorflow") if importlib.util.find_spec(f)]


@functools.cache
def output_at(np_: int) -> str:
    """The output of the job of every installed framework on ``np_`` ranks (run once)."""
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(WORKER),
          ",".join(FRAMEWORKS)]], cwd=ROOT, env=ENV, timeout=280, check=False)
    return proc.output


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_reduce_gather_scatter(framework: str, np_: int) -> None:
    pytest.importorskip(framework)
    out = output_at(np_)
    assert out.count(f"PASS {framework} rank") == np_, out[-6000:]
