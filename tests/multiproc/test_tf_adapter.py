"""ringflow.tensorflow and ringflow.tensorflow.keras with real processes through ringflow-run.

TensorFlow takes seconds to import, so each worker script batches many named checks
(tests/multiproc/tf_workers/), and one job per world size runs every script that world size
needs, one after the other in each rank (one_process.py): 6 TensorFlow processes where a job
per script started 12. A failing check is reported by name with its rank and script.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from one_process import command

from ringflow.testing import CommandResult, run_commands

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "tf_workers"
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "RINGFLOW_TIMEOUT_S": "60",  # a rank that fails a check early makes its peers time out
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


#: The worker scripts of each world size (keras_worker.py also writes into a directory).
SCRIPTS = {1: ["ops"], 2: ["ops", "graph", "keras", "compression"], 3: ["graph"]}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], CommandResult]:
    """The job of ``np_`` ranks that runs its scripts (once per module)."""
    keras_dir = str(tmp_path_factory.mktemp("keras"))

    @functools.cache
    def run(np_: int) -> CommandResult:
        scripts = [[str(WORKERS / f"{name}_worker.py"), *([keras_dir] if name == "keras" else [])]
                   for name in SCRIPTS[np_]]
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_), *command(*scripts)]
        (result,) = run_commands([cmd], cwd=ROOT, env=ENV, check=False, merge_stderr=False,
                                 timeout=120 * len(SCRIPTS[np_]) + 60)
        return result

    return run


def passed(result: CommandResult, np_: int, script: str) -> None:
    """Every rank of the job of ``np_`` ranks passed every check of ``script``."""
    report = f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    for rank in range(np_):
        assert re.search(rf"rank {rank}: {script}: \d+ checks passed", result.stdout), report
    # A job that failed after its scripts' verdicts (at shutdown) fails every script's test.
    assert result.returncode == 0 or "failed checks" in result.stderr, report


@pytest.mark.parametrize("np_", [1, 2])
def test_ops_tapes_objects_sync_batch_norm(job, np_: int) -> None:
    """Every collective eager and in tf.function, their gradients, the tapes (with the
    n x B == 1 x nB equivalence), object helpers, process sets, join, errors."""
    passed(job(np_), np_, "ops")


@pytest.mark.parametrize("np_", [2, 3])
def test_tf1_graph_mode_and_error_classes(job, np_: int) -> None:
    """Horovod's graph mode (a tf.Graph run by a Session): the broadcast gradient that used to
    deadlock, names equal on every rank, broadcast_ / broadcast_global_variables / objects; and
    the tf.errors class of each failed collective, eagerly, in tf.function and in a session."""
    passed(job(np_), np_, "graph")


def test_keras_fit_callbacks_load_model(job) -> None:
    """model.fit equivalence (SGD, Adam, SyncBatchNormalization), backward_passes_per_step,
    all callbacks, load_model, PartialDistributedOptimizer and the keras helpers."""
    passed(job(2), 2, "keras")


def test_compressors_in_a_tape_in_tf_function_and_in_keras_fit(job) -> None:
    """PowerSGD in a DistributedGradientTape inside tf.function (the closed form per step, rank 0's
    bits everywhere) and 1-bit in Keras's model.fit."""
    out = job(2).output
    assert out.count("PASS compression rank") == 2, out[-6000:]
