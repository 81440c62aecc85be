"""ringflow.tensorflow and ringflow.tensorflow.keras with real processes through ringflow-run.

TensorFlow takes seconds to import, so each worker script batches many named checks
(tests/multiproc/tf_workers/), and the scripts run in the framework jobs, one per world size
(framework_jobs.py: the same processes as other files' scripts). A failing check is reported by
name with its rank and script.
"""

from __future__ import annotations

import pytest
from framework_jobs import TEST_TIMEOUT_S, installed, passed

pytestmark = [pytest.mark.timeout(TEST_TIMEOUT_S),
              pytest.mark.skipif(not installed("tensorflow", "keras"),
                                 reason="needs tensorflow and keras")]


def checks_passed(script: str) -> str:
    """The verdict of a tf_workers script (common.finish) on rank {r}."""
    return rf"rank {{r}}: {script}: \d+ checks passed"


@pytest.mark.parametrize("np_", [1, 2])
def test_ops_tapes_objects_sync_batch_norm(np_: int) -> None:
    """Every collective eager and in tf.function, their gradients, the tapes (with the
    n x B == 1 x nB equivalence), object helpers, process sets, join, errors."""
    passed(np_, checks_passed("ops"))


@pytest.mark.parametrize("np_", [2, 3])
def test_tf1_graph_mode_and_error_classes(np_: int) -> None:
    """Horovod's graph mode (a tf.Graph run by a Session): the broadcast gradient that used to
    deadlock, names equal on every rank, broadcast_ / broadcast_global_variables / objects; and
    the tf.errors class of each failed collective, eagerly, in tf.function and in a session."""
    passed(np_, checks_passed("graph"))


def test_keras_fit_callbacks_load_model() -> None:
    """model.fit equivalence (SGD, Adam, SyncBatchNormalization), backward_passes_per_step,
    all callbacks, load_model, PartialDistributedOptimizer and the keras helpers."""
    passed(2, checks_passed("keras"))


def test_compressors_in_a_tape_in_tf_function_and_in_keras_fit() -> None:
    """PowerSGD in a DistributedGradientTape inside tf.function (the closed form per step, rank 0's
    bits everywhere) and 1-bit in Keras's model.fit."""
    passed(2, r"PASS compression rank {r}\b")
