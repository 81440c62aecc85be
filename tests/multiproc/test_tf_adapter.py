"""ringflow.tensorflow and ringflow.tensorflow.keras with real processes through ringflow-run.

TensorFlow takes seconds to import, so each launch runs a worker script that batches many named
checks (tests/multiproc/tf_workers/); a failing check is reported by name with its rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ringflow.testing import CommandResult, run_commands

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "tf_workers"
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "RINGFLOW_TIMEOUT_S": "60",  # a rank that fails a check early makes its peers time out
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def launch(np_: int, script: Path | str, *args: str, timeout: float = 200) -> CommandResult:
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable,
           str(script), *args]
    (result,) = run_commands([cmd], cwd=ROOT, env=ENV, timeout=timeout, check=False,
                             merge_stderr=False)
    return result


def passed(result: CommandResult, np_: int) -> None:
    report = f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert result.returncode == 0, report
    for rank in range(np_):
        assert f"rank {rank}: " in result.stdout and "checks passed" in result.stdout, report


@pytest.mark.parametrize("np_", [1, 2])
def test_ops_tapes_objects_sync_batch_norm(np_: int) -> None:
    """Every collective eager and in tf.function, their gradients, the tapes (with the
    n x B == 1 x nB equivalence), object helpers, process sets, join, errors."""
    passed(launch(np_, WORKERS / "ops_worker.py"), np_)


@pytest.mark.parametrize("np_", [2, 3])
def test_tf1_graph_mode_and_error_classes(np_: int) -> None:
    """Horovod's graph mode (a tf.Graph run by a Session): the broadcast gradient that used to
    deadlock, names equal on every rank, broadcast_ / broadcast_global_variables / objects; and
    the tf.errors class of each failed collective, eagerly, in tf.function and in a session."""
    passed(launch(np_, WORKERS / "graph_worker.py"), np_)


def test_keras_fit_callbacks_load_model(tmp_path: Path) -> None:
    """model.fit equivalence (SGD, Adam, SyncBatchNormalization), backward_passes_per_step,
    all callbacks, load_model, PartialDistributedOptimizer and the keras helpers."""
    passed(launch(2, WORKERS / "keras_worker.py", str(tmp_path)), 2)
