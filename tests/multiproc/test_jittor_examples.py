"""The Jittor-style and distributed-evaluation examples, through ringflow-run, print what they
promise: the same model as one process, and a global accuracy equal to one process's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from framework_jobs import installed

from ringflow.testing import run_commands

pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(300),  # scikit-learn: looked for, not imported (conftest.py)
              pytest.mark.skipif(not installed("sklearn"), reason="needs scikit-learn")]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run(*args: str, np: int = 0, auto: bool = False) -> str:
    cmd = [sys.executable, *args]
    if np:
        cmd = [sys.executable, "-m", "ringflow.runner", *(["--auto"] if auto else []), "-np",
               str(np), *cmd]
    return run_commands([cmd], cwd=ROOT, env=ENV, timeout=240, merge_stderr=False)[0].stdout


FINAL = re.compile(r"^(?:\[(\d)\]:)?final test accuracy ([0-9.]+); parameter checksum ([-0-9.]+)",
                   re.M)


def test_an_unchanged_script_under_auto_trains_the_single_process_model() -> None:
    script = ("examples/jittor_style_auto.py", "--epochs", "3")
    (_, accuracy, checksum), = FINAL.findall(run(*script))
    ranks = FINAL.findall(run(*script, np=2, auto=True))
    assert sorted(r for r, _, _ in ranks) == ["0", "1"]
    assert len({(a, c) for _, a, c in ranks}) == 1  # every rank holds the same model
    _, got_accuracy, got_checksum = ranks[0]
    assert abs(float(got_checksum) - float(checksum)) < 1e-4 * abs(float(checksum))
    assert abs(float(got_accuracy) - float(accuracy)) <= 0.005  # a sample or two, at most


def test_scoped_validation_and_global_metrics_agree(tmp_path: Path) -> None:
    out = run("examples/jittor_style_scope.py", "--epochs", "2", "--checkpoint-dir",
              str(tmp_path), np=2, auto=True)
    lines = re.findall(r"^\[0\]:epoch \d: test accuracy ([0-9.]+) over 451 samples on 2 rank\(s\); "
                       r"on rank 0 alone ([0-9.]+); equal: True$", out, re.M)
    assert len(lines) == 2 and all(a == b for a, b in lines), out
    assert "[1]:epoch" not in out  # printed by rank 0 only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-1.pt", "epoch-2.pt"]


@pytest.mark.parametrize("n", [2, 3])
def test_exact_distributed_accuracy_equals_one_process(n: int) -> None:
    out = run("examples/distributed_evaluation.py", "--epochs", "2", np=n)
    padded = re.search(r"padded, averaged over ranks: [0-9.]+ \((\d+) images counted\)", out)
    exact = re.search(r"exact \(pad=False, metrics\): +([0-9.]+) \(451 images\)", out)
    alone = re.search(r"one process \(rank 0 alone\): +([0-9.]+) \(451 images\)", out)
    assert padded and exact and alone, out
    assert int(padded.group(1)) == -(-451 // n) * n  # the padding repeats samples
    assert exact.group(1) == alone.group(1)  # repr of both floats: the last digit too
    assert sorted(re.findall(r"rank (\d): exact == one process: True", out)) == \
        [str(r) for r in range(n)]
