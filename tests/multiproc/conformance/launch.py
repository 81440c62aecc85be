"""How test_conformance_torch.py launches the conformance scripts that run alone (the framework
jobs run worker.py: framework_jobs.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ringflow.testing import run_commands

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_script(script: str, np_: int, timeout: float = 120,
               env: dict[str, str] | None = None) -> str:
    """Output of ``script`` (in this folder) on ``np_`` ranks under ringflow-run; it must exit 0."""
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable,
          str(HERE / script)]], cwd=ROOT, env={**ENV, **(env or {})}, timeout=timeout)
    return result.output
