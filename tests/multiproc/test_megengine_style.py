"""MegEngine's workflow on one machine, run as MegEngine users run it (``python script.py``, the
launcher starting the processes): the key-value client, a model-parallel pipeline over
``remote_send`` / ``remote_recv`` whose loss and gradients equal one process's exactly, shape
mismatches, and ``examples/megengine_style.py`` (also under ``ringflow-run -np 2``).

Several machines: ``tests/multihost/test_megengine_machines.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from framework_jobs import installed

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(300)

ROOT = Path(ringflow.__file__).resolve().parent.parent
MACHINE = str(Path(__file__).resolve().parent / "megengine_workers" / "machine.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def one_machine(scenario: str, n: int, tmp_path: Path) -> list[dict]:
    out = tmp_path / "out.json"
    run_commands([[sys.executable, MACHINE, scenario, str(n), str(n), "0", "localhost", "0",
                   str(out)]], env=ENV, timeout=280)
    data = json.loads(out.read_text())
    assert "results" in data, data
    return data["results"]


@pytest.mark.parametrize("n", [2, 3])
def test_client_and_collectives_under_the_launcher(tmp_path: Path, n: int) -> None:
    results = one_machine("job", n, tmp_path)
    assert [res["rank"] for res in results] == list(range(n))  # in rank order, one per process
    for r, res in enumerate(results):
        assert res["size"] == n and res["local"] == [r, n] and res["cross"] == [0, 1]
        assert res["sum"] == [n * (n + 1) / 2] * 5  # init() was done for the function
        assert res["seen"] == [True] * n
        assert res["late"] == ["set", "after", 1.0, "s"]
        assert 0.4 < res["timed_out"][0] < 5, res["timed_out"]
        assert "'user/nobody/sets/this' was not set within 0.5 s" in res["timed_out"][1]
        if r != n - 1:
            assert res["waited"] > 0.5  # user_get blocked until rank n-1 set the key


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_loss_and_gradients_equal_one_process(tmp_path: Path, n: int) -> None:
    results = one_machine("pipeline", n, tmp_path)
    for res in results:
        assert len(res["diffs"]) == 3
        for step in res["diffs"]:
            assert step["grads"] == [0.0, 0.0], res  # weight and bias of this rank's stage
            assert step["params"] == [0.0, 0.0], res  # after the SGD steps too
    assert [d["loss"] for d in results[-1]["diffs"]] == [0.0] * 3
    assert all(a == b for a, b in results[-1]["losses"])


def test_remote_recv_of_another_shape_fails_on_both_ranks(tmp_path: Path) -> None:
    sender, receiver = one_machine("mismatch", 2, tmp_path)
    assert sender["error"] == receiver["error"], (sender, receiver)
    kind, text = receiver["error"]
    assert kind == "MismatchError"
    assert "rank 0 sent 4 elements of float32" in text and "rank 1 expected 5" in text, text


def _example(*args: str, runner: list[str] | None = None) -> list[str]:
    command = [*(runner or []), sys.executable, str(ROOT / "examples" / "megengine_style.py"),
               "--epochs", "1", *args]
    (result,) = run_commands([command], cwd=ROOT, env=ENV, timeout=280, merge_stderr=False)
    return result.stdout.splitlines()


@pytest.mark.timeout(900)  # three runs of the example: six processes that import torch
def test_example_equals_one_process_launched_either_way() -> None:
    if not installed("sklearn"):  # looked for, not imported: the example imports it
        pytest.skip("scikit-learn is not installed")
    alone = _example("--single")
    assert alone[-1].startswith("test accuracy ") and len(alone) == 6, alone
    assert _example() == alone  # python script.py: the launcher starts the two processes
    under_run = _example(runner=[sys.executable, "-m", "ringflow.runner", "-np", "2"])
    assert [line.removeprefix("[1]:") for line in under_run if line.startswith("[1]:")] == alone
    assert f"[0]:{alone[-1]}" in under_run  # rank 0 reads the accuracy from the client
