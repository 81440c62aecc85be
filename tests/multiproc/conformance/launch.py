"""Run ``worker.py MODE`` under ringflow-run; shared by the conformance test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ringflow.testing import run_commands

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_script(script: str, np_: int, timeout: float = 120,
               env: dict[str, str] | None = None) -> str:
    """Output of ``script`` (in this folder) on ``np_`` ranks under ringflow-run; it must exit 0."""
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable,
          str(WORKER.parent / script)]], cwd=ROOT, env={**ENV, **(env or {})}, timeout=timeout)
    return result.output


def conform(mode: str, np_: int) -> None:
    """Every rank of ``worker.py mode`` on ``np_`` ranks prints PASS (else the output fails)."""
    out = conform_modes([mode], np_)
    assert out.count(f"PASS {mode}: ") == np_, out[-8000:]


def conform_modes(modes: list[str], np_: int) -> str:
    """The output of ``worker.py`` running ``modes`` one after the other in one job on ``np_``
    ranks, whatever its exit code (each mode's PASS lines say how it went)."""
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(WORKER),
          ",".join(modes)]], cwd=ROOT, env=ENV, timeout=100 * len(modes) + 100, check=False)
    return result.output
