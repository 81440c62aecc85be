"""The Keras elastic callbacks (ringflow.tensorflow.keras.elastic) on a state that records its
commits: what they keep in ``state.batch`` and ``state.epoch``, and when they commit; the
TensorFlow states' refusals."""

from __future__ import annotations

import pytest

elastic = None  # imported by _imports


@pytest.fixture(scope="module", autouse=True)
def _imports() -> None:
    """ringflow.tensorflow.keras.elastic: imported when a test here first runs, not at
    collection (tests/conftest.py: "TensorFlow at collection")."""
    global elastic
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    from ringflow.tensorflow.keras import elastic


class _State:
    def __init__(self, batch: int = 0, epoch: int = 0) -> None:
        self.batch, self.epoch, self.commits = batch, epoch, 0

    def commit(self) -> None:
        self.commits += 1


def test_commit_every_n_batches_and_at_each_epoch_end():
    state = _State()
    cb = elastic.CommitStateCallback(state, batches_per_commit=2)
    cb.on_train_begin()
    for b in range(5):
        cb.on_batch_end(b)
    cb.on_epoch_end(0)
    assert state.commits == 3


def test_batch_counts_the_batches_done_across_a_resumed_fit():
    state = _State(batch=3)  # a reset after 3 batches of this epoch; fit resumes at batch 3
    cb = elastic.UpdateBatchStateCallback(state)
    cb.on_train_begin()
    cb.on_batch_end(0)
    cb.on_batch_end(1)
    assert state.batch == 5
    cb.on_epoch_end(0)
    cb.on_batch_end(0)
    assert state.batch == 1


def test_epoch_counts_across_resets():
    state = _State(epoch=2)
    cb = elastic.UpdateEpochStateCallback(state)
    cb.on_train_begin()
    cb.on_epoch_end(0)
    assert state.epoch == 3
    cb.on_train_begin()  # fit() again after a reset
    cb.on_epoch_end(0)
    assert state.epoch == 4


def test_tensorflow_states_refuse_what_they_cannot_hold():
    import keras
    import tensorflow as tf

    from ringflow.errors import UnsupportedError
    from ringflow.tensorflow import elastic as tf_elastic

    with pytest.raises(UnsupportedError, match="TF1's global variables and sessions are not"):
        tf_elastic.TensorFlowState([tf.Variable(1.0)], session=object())
    model = keras.Sequential([keras.layers.Dense(1)])  # no input shape: not built
    with pytest.raises(ValueError, match="Model must be built first"):
        tf_elastic.TensorFlowKerasState(model, keras.optimizers.SGD())
