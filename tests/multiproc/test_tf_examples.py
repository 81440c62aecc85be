"""The TensorFlow examples run through ringflow-run -np 2 and print what they promise."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from framework_jobs import installed

from ringflow.testing import run_commands

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not installed("tensorflow", "sklearn"),
                                 reason="needs tensorflow and scikit-learn")]

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "RINGFLOW_TIMEOUT_S": "60",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def run_example(name: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", sys.executable,
           str(ROOT / "examples" / name), *args]
    (result,) = run_commands([cmd], cwd=ROOT, env=ENV, timeout=200, merge_stderr=False)
    return result.stdout


def test_keras_digits(tmp_path: Path) -> None:
    out = run_example("keras_digits.py", "--epochs", "4", "--checkpoint-dir", str(tmp_path))
    assert "finished gradual learning rate warmup" in out
    accuracy = float(re.search(r"'val_accuracy': ([0-9.]+)", out).group(1))
    assert accuracy > 0.85, out
    # Rank 0 alone writes one checkpoint per epoch.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"checkpoint-{e}.keras" for e in range(1, 5)]
    assert "[1]:" not in out or "final" not in out.split("[1]:", 1)[1]


def test_tensorflow_digits_tape() -> None:
    out = run_example("tensorflow_digits_tape.py", "--steps", "200")
    accuracy = float(re.search(r"test accuracy over 2 ranks: ([0-9.]+)", out).group(1))
    assert accuracy > 0.85, out
    assert "weights identical on every rank: True" in out


def test_tensorflow_synthetic_benchmark() -> None:
    out = run_example("tensorflow_synthetic_benchmark.py", "--num-iters", "2",
                      "--num-batches-per-iter", "1", "--num-warmup-batches", "1")
    assert re.search(r"Img/sec per worker: [0-9.]+ \+-[0-9.]+", out), out
    assert re.search(r"Total img/sec on 2 worker\(s\): [0-9.]+", out), out
