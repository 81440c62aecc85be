"""The compressors with state through ringflow-run (processes): convergence on scikit-learn's
digits, the launcher's --compression flag, and TensorFlow's graph path.

- ``examples/pytorch_mnist.py`` (a small CNN on digits, 2 ranks, 20 epochs) under
  ``ringflow-run --compression X``: final test accuracy within one point of the uncompressed run
  (measured on the 2-core host: none 97.8%, powersgd 98.2%, onebit 98.0%, randomk:fraction=0.1
  98.7%; auto is off on one host, so it equals none exactly).
- ``compressed_workers/tf_tape.py``: PowerSGD in a DistributedGradientTape inside tf.function
  (the closed form per step, rank 0's bits everywhere) and 1-bit in Keras's model.fit.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(600)

ROOT = Path(ringflow.__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run(*args: str, timeout: float = 300) -> str:
    (result,) = run_commands([[sys.executable, "-m", "ringflow.runner", "-np", "2", *args]],
                             cwd=ROOT, env=ENV, timeout=timeout)
    return result.output


def accuracy(compression: str, tmp_path: Path) -> float:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = run("--compression", compression, sys.executable, "examples/pytorch_mnist.py",
              "--epochs", "20", "--checkpoint-dir", str(tmp_path / compression))
    found = re.search(r"final test accuracy ([0-9.]+)", out)
    assert found, out[-3000:]
    return float(found.group(1))


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory: pytest.TempPathFactory) -> float:
    return accuracy("none", tmp_path_factory.mktemp("none"))


@pytest.mark.parametrize("compression", ["powersgd", "onebit", "randomk:fraction=0.1", "auto"])
def test_digits_converge_as_uncompressed(compression: str, uncompressed: float,
                                         tmp_path: Path) -> None:
    got = accuracy(compression, tmp_path)
    if compression == "auto":  # one host: off, so the very same run
        assert got == uncompressed
    assert got >= uncompressed - 0.01, (compression, got, uncompressed)


def test_bad_compression_flag_fails_before_any_worker() -> None:
    (proc,) = run_commands([[sys.executable, "-m", "ringflow.runner", "-np", "2",
                             "--compression", "powersgd:rank=0", sys.executable, "-c", "pass"]],
                           cwd=ROOT, env=ENV, timeout=60, check=False, merge_stderr=False)
    assert proc.returncode != 0
    assert "rank must be an integer >= 1" in proc.stderr


def test_tensorflow_graph_tape_and_keras() -> None:
    pytest.importorskip("tensorflow")
    out = run(sys.executable, str(ROOT / "tests/multiproc/compressed_workers/tf_tape.py"))
    assert out.count("PASS rank") == 2, out[-4000:]


@pytest.mark.parametrize(("np_", "compression", "flags"), [
    (2, "powersgd:rank=2", []),
    (3, "randomk:fraction=0.2", ["--transport", "tcp"]),
    (3, "onebit", []),
    (4, "powersgd:rank=2", ["--transport", "tcp"]),
])
def test_closed_form_in_processes(np_: int, compression: str, flags: list[str]) -> None:
    pytest.importorskip("torch")
    env = {**ENV, "RINGFLOW_BUCKET_BYTES": "4096"}  # several buckets a step
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_), *flags, "--compression",
           f"{compression}:min_elements=256", sys.executable,
           str(ROOT / "tests/multiproc/compressed_workers/torch_steps.py"),
           f"{compression}:min_elements=256"]
    out = run_commands([cmd], cwd=ROOT, env=env, timeout=300)[0].output
    assert out.count("PASS rank") == np_, out[-4000:]
