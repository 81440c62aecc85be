"""ringflow.torch.auto through real processes: ``ringflow-run --auto`` (2 and 3 ranks), the
``python -m ringflow.torch.auto`` runner under ringflow-run and under torchrun.

The training script (``auto_workers/train.py``) is plain torch: run alone it trains on the global
batch, and every rank of a distributed run must end with its parameters (bitwise equal across
ranks; equal to one process's up to the order of float additions) having seen its batches split
among the ranks. ``auto_workers/checks.py`` records the edges, compared with closed forms.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ringflow  # noqa: E402
from ringflow.testing import run_commands  # noqa: E402
from ringflow.torch._auto.loader import share  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKERS = Path(__file__).resolve().parent / "auto_workers"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
RUN = [sys.executable, "-m", "ringflow.runner"]
TRAIN = ["--samples", "102", "--batch-size", "12", "--epochs", "2", "--lbfgs"]


def run(cmd: list[str], timeout: float = 180) -> str:
    (result,) = run_commands([cmd], env=ENV, cwd=ROOT, timeout=timeout)
    return result.output


def load(out: Path, n: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt") for r in range(n)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The script as one process: the global batch (12) every step."""
    out = tmp_path_factory.mktemp("alone")
    run([sys.executable, str(WORKERS / "train.py"), "--out", str(out), *TRAIN])
    return load(out, 1)[0]


def assert_same_training(alone: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for key, value in alone["state"].items():
        for r, got in enumerate(ranks):
            assert torch.equal(got["state"][key], ranks[0]["state"][key]), (key, r)
        # 18 SGD steps and 4 LBFGS iterations: float32 sums in another order, no more
        assert torch.allclose(ranks[0]["state"][key].double(), value.double(), rtol=1e-4,
                              atol=1e-5), (key, (ranks[0]["state"][key] - value).abs().max())
    assert torch.equal(ranks[0]["state"]["unused"], torch.ones(3))  # no gradient: never moved
    # every global batch of the single run, split among the ranks in rank order
    assert [len(rank["seen"]) for rank in ranks] == [len(alone["seen"])] * n
    for k, batch in enumerate(alone["seen"]):
        assert [rank["seen"][k] for rank in ranks] == [share(batch, n, r) for r in range(n)]
    assert [rank["batches"] for rank in ranks] == [alone["batches"]] * n


@pytest.mark.parametrize("n", [2, 3])
def test_auto_mode_equals_one_process_on_the_global_batch(alone: dict[str, Any], n: int,
                                                          tmp_path: Path) -> None:
    run([*RUN, "--auto", "-np", str(n), sys.executable, str(WORKERS / "train.py"),
         "--out", str(tmp_path), *TRAIN])
    assert_same_training(alone, load(tmp_path, n))


def test_the_runner_module_under_ringflow_run(alone: dict[str, Any], tmp_path: Path) -> None:
    run([*RUN, "-np", "2", sys.executable, "-m", "ringflow.torch.auto",
         str(WORKERS / "train.py"), "--out", str(tmp_path), *TRAIN])
    assert_same_training(alone, load(tmp_path, 2))


def test_the_runner_module_under_torchrun(alone: dict[str, Any], tmp_path: Path) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ringflow.torch.auto", str(WORKERS / "train.py"), "--out", str(tmp_path),
         *TRAIN], timeout=240)
    assert_same_training(alone, load(tmp_path, 2))


def uneven_warning(n: int, width: int, *lengths: int) -> list[str]:
    """The start of the warning about the first of ``lengths`` that does not divide by n."""
    return [f"ringflow.torch.auto: a DataLoader batch of {length} samples does not divide"[:width]
            for length in lengths if length % n][:1]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_auto_mode_edges(n: int, tmp_path: Path) -> None:
    script = [sys.executable, str(WORKERS / "checks.py"), "--out", str(tmp_path)]
    run(script if n == 1 else [*RUN, "--auto", "-np", str(n), *script])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    # the scoped function ran twice in all, on rank 0
    assert (tmp_path / "calls").read_text() == "a 0\nb 0\n"
    for r, res in enumerate(results):
        mine = [share(list(range(4)), n, r), share([4, 5, 6], n, r)]
        expected = {
            "before_init": [r, n, False],
            "enabled": True,
            "shard": mine, "shard_again": mine * 2, "shard_len": 2,
            "shard_warnings": uneven_warning(n, 50, 4, 3),
            "validate": [{"seen": list(range(7)), "accuracy": 3 / 7, "by": 0}] * 2,
            "accuracy": 3 / 7,
            "broken": "no such checkpoint",
            "broadcast": [1.0, 1.0],
            "averaged": [1 - (n + 1) / 4] * 2,
            "tiny_len": 2 if n == 1 or r == 0 else 1,
            "iterable": [0, 1, 2, 3],
            "uneven": [share(list(range(5)), n, r), share(list(range(5, 10)), n, r)],
            "left_alone_warnings": [] if n == 1 else [
                "ringflow.torch.auto does not shard a DataLoader of an Iterab",
                *uneven_warning(n, 60, 5)],
            "torch_sync_warnings": [] if n == 1 else [
                "torch.nn.SyncBatchNorm is not synchronising: torch.distribut"],
        }
        if n > 1:
            expected["mismatch"] = "ringflow.torch.auto: optimizer #0"
        for key in ("sync", "bn"):  # output and running variance: the global batch's
            assert max(res.pop(key)) < 1e-5, (r, key)
        assert res == expected, r


def test_ringflow_run_help_lists_auto() -> None:
    out = run([*RUN, "--help"])
    assert "--auto" in out and "ringflow.torch.auto" in out


def test_a_worker_that_never_imports_torch_is_untouched(tmp_path: Path) -> None:
    """--auto waits for `import torch`: a worker without torch does not import it."""
    out = run([*RUN, "--auto", "-np", "2", sys.executable, "-c",
               "import sys, ringflow; print('torch' in sys.modules, ringflow.rank())"])
    assert sorted(line.split(":", 1)[1] for line in out.splitlines() if line[:1] == "[") == [
        "False 0", "False 1"]
