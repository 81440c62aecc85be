"""ringflow-run --autotune: every rank runs each plan item with the same values while the tuner
tries them (chunk sizes on the TCP ring, where sender and receiver must cut messages alike, and
16-bit wire compression), ends with the same parameters and values, and rank 0 writes the log
with the chosen values and the line that pins them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(240)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = Path(__file__).resolve().parent / "torch_workers" / "autotune.py"


@pytest.mark.parametrize(("np", "transport"), [(2, "auto"), (3, "tcp")])
def test_autotuned_values_agree_on_every_rank(tmp_path: Path, np: int, transport: str) -> None:
    log = tmp_path / "autotune.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np), "--transport", transport,
         "--autotune", "--autotune-log-file", str(log), "--autotune-warmup-samples", "0",
         "--autotune-steps-per-sample", "2", "--autotune-compression", "fp16",
          sys.executable, str(WORKER)]], env=env, timeout=200)
    out = proc.output
    assert out.count("PASS rank") == np, out[-4000:]
    lines = log.read_text().splitlines()
    assert lines[0].startswith("step,phase,fusion_threshold_bytes,")
    assert lines[-2].split(",")[1] == "chosen" and lines[-1].startswith("# pin: RINGFLOW_")
    assert {line.split(",")[1] for line in lines[1:-2]} <= {"search", "confirm"}
