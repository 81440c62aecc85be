"""The PyTorch examples and the DDP comparison run end to end through ringflow-run (2 ranks).
examples/pytorch_mnist.py is test_compressed_processes.py's baseline: checked there."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(240)

ROOT = Path(ringflow.__file__).resolve().parent.parent
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
LAUNCH = [sys.executable, "-m", "ringflow.runner", "-np", "2", sys.executable]


def run(cmd: list[str], timeout: float = 180) -> str:
    (result,) = run_commands([cmd], env=ENV, cwd=ROOT, timeout=timeout, merge_stderr=False)
    return result.stdout


def test_synthetic_benchmark_reports_per_rank_and_total() -> None:
    out = run([*LAUNCH, "examples/pytorch_synthetic_benchmark.py", "--model", "cnn",
               "--num-iters", "2", "--num-batches-per-iter", "2", "--fp16-allreduce"])
    assert re.search(r"Img/sec per rank: [0-9.]+ \+-[0-9.]+", out), out
    assert "Total img/sec on 2 rank(s)" in out, out


def test_ddp_comparison_runs_in_one_go(tmp_path: Path, monkeypatch) -> None:
    records = tmp_path / "records.jsonl"  # not the repository's records
    monkeypatch.setitem(ENV, "BENCH_RECORDS", str(records))
    out = run([sys.executable, "benchmarks/torch_ddp_vs_ringflow.py", "--models", "cnn",
               "--batch-size", "8", "--num-iters", "1", "--num-batches-per-iter", "1",
               "--ddp-rounds", "1"],
              timeout=200)
    assert re.search(r"ringflow / DDP: [0-9.]+x", out), out
    assert re.search(r"DDP\(ringflow\) / DDP\(gloo\): [0-9.]+x", out), out
    figures = json.loads(records.read_text())["figures"]
    assert set(figures["models"]["cnn"]["ratio"]) == {"ringflow", "ddp_ringflow"}
