"""The compressors with state through ringflow-run (processes): convergence on scikit-learn's
digits, the launcher's --compression flag, and the closed form per step in torch (TensorFlow's:
tf_workers/compression_worker.py, run by test_tf_adapter.py).

- ``examples/pytorch_mnist.py`` (a small CNN on digits, 2 ranks, 20 epochs) under
  ``ringflow-run --compression X``: final test accuracy within one point of the uncompressed run
  (measured on the 2-core host: none 97.8%, powersgd 98.2%, onebit 98.0%, randomk:fraction=0.1
  98.7%; at 10 epochs the compressors still trail by up to 2.7 points). The uncompressed run is
  the example as its docstring and docs/getting-started.md's first job run it (no flag; the page
  asks for one epoch), and also checks that rank 0 alone prints and writes the checkpoints.
  ``auto`` is off on one host: its first epoch (one epoch is enough: the cosine schedule's first
  epoch does not depend on the number of epochs) equals the uncompressed run's, every figure
  printed.
- The closed form per step (``compressed_workers/torch_steps.py``): every compressor at 3 ranks
  over shared memory and at 4 over the TCP ring, one job each, which runs the script once per
  compressor in the same processes (one_process.py). The script sets ``RINGFLOW_COMPRESSION``
  itself, as the flag would; the flag's way to the workers is the digits runs'.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest
from framework_jobs import installed
from one_process import command, failure_named

import ringflow
from ringflow.testing import CommandResult, run_commands

pytestmark = pytest.mark.timeout(600)

ROOT = Path(ringflow.__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run(*args: str, timeout: float = 300) -> str:
    (result,) = run_commands([[sys.executable, "-m", "ringflow.runner", "-np", "2", *args]],
                             cwd=ROOT, env=ENV, timeout=timeout)
    return result.output


def digits(tmp_path: Path, *flags: str, epochs: int = 20) -> str:
    """The output of ``ringflow-run -np 2 [flags] python examples/pytorch_mnist.py``."""
    pytest.importorskip("torch")
    if not installed("sklearn"):  # looked for, not imported: the example imports it
        pytest.skip("scikit-learn is not installed")
    return run(*flags, sys.executable, "examples/pytorch_mnist.py", "--epochs", str(epochs),
               "--checkpoint-dir", str(tmp_path))


def final_accuracy(out: str) -> float:
    found = re.search(r"final test accuracy ([0-9.]+)", out)
    assert found, out[-3000:]
    return float(found.group(1))


def first_epoch(out: str) -> str:
    """Rank 0's figures after the first epoch, without the time it took."""
    found = re.search(r"epoch 1: (.*?) +\(", out)
    assert found, out[-3000:]
    return found.group(1)


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The example as users run it (no --compression): its output and checkpoint directory."""
    where = tmp_path_factory.mktemp("none")
    return digits(where), where


def test_the_example_learns_and_rank_0_alone_prints_and_checkpoints(
        uncompressed: tuple[str, Path]) -> None:
    out, where = uncompressed
    assert final_accuracy(out) > 0.95, out[-3000:]
    assert "[1]:epoch" not in out and "[1]:final" not in out, out[-3000:]
    assert sorted(p.name for p in where.iterdir()) == sorted(
        f"checkpoint-{e}.pt" for e in range(1, 21))


@pytest.mark.parametrize("compression", ["powersgd", "onebit", "randomk:fraction=0.1"])
def test_digits_converge_as_uncompressed(compression: str, uncompressed: tuple[str, Path],
                                         tmp_path: Path) -> None:
    got = final_accuracy(digits(tmp_path, "--compression", compression))
    want = final_accuracy(uncompressed[0])
    assert got >= want - 0.01, (compression, got, want)


def test_auto_on_one_host_is_the_uncompressed_run(uncompressed: tuple[str, Path],
                                                  tmp_path: Path) -> None:
    got = digits(tmp_path, "--compression", "auto", epochs=1)
    assert first_epoch(got) == first_epoch(uncompressed[0]), (got[-2000:], uncompressed[0][:2000])


def test_bad_compression_flag_fails_before_any_worker() -> None:
    (proc,) = run_commands([[sys.executable, "-m", "ringflow.runner", "-np", "2",
                             "--compression", "powersgd:rank=0", sys.executable, "-c", "pass"]],
                           cwd=ROOT, env=ENV, timeout=60, check=False, merge_stderr=False)
    assert proc.returncode != 0
    assert "rank must be an integer >= 1" in proc.stderr


#: The closed-form jobs: shared memory at 3 ranks, the TCP ring at 4; each runs every compressor.
CLOSED_FORM_JOBS = {3: [], 4: ["--transport", "tcp"]}
SPECS = ["powersgd:rank=2:min_elements=256", "randomk:fraction=0.2:min_elements=256",
         "onebit:min_elements=256"]


@functools.cache
def closed_form(np_: int) -> CommandResult:
    """``compressed_workers/torch_steps.py`` with each of :data:`SPECS`, one after the other in
    the processes of one job of ``np_`` ranks (one_process.py: a torch process costs 4 CPU-s
    before its first step); run once."""
    steps = str(ROOT / "tests/multiproc/compressed_workers/torch_steps.py")
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_), *CLOSED_FORM_JOBS[np_],
           *command(*([steps, spec] for spec in SPECS))]
    env = {**ENV, "RINGFLOW_BUCKET_BYTES": "4096"}  # several buckets a step
    return run_commands([cmd], cwd=ROOT, env=env, timeout=300, check=False)[0]


@pytest.mark.parametrize("np_", list(CLOSED_FORM_JOBS), ids=["shm-3", "tcp-4"])
@pytest.mark.parametrize("spec", SPECS)
def test_closed_form_in_processes(np_: int, spec: str) -> None:
    pytest.importorskip("torch")
    result = closed_form(np_)
    out = result.output
    assert all(f"PASS {spec} rank {r}\n" in out for r in range(np_)), out[-4000:]
    assert failure_named(result.returncode, out), out[-4000:]
