"""Run ``worker.py MODE`` under ringflow-run; shared by the conformance test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_script(script: str, np_: int, timeout: float = 120,
               env: dict[str, str] | None = None) -> str:
    """Output of ``script`` (in this folder) on ``np_`` ranks under ringflow-run; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable,
         str(WORKER.parent / script)], cwd=str(ROOT), env={**ENV, **(env or {})},
        capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def conform(mode: str, np_: int) -> None:
    """Every rank of ``worker.py mode`` on ``np_`` ranks prints PASS (else the output fails)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(WORKER),
         mode], cwd=str(ROOT), env=ENV, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert out.count("PASS ") == np_, out[-8000:]
