"""``hvd.elastic`` for Keras (Horovod's ``horovod.tensorflow.keras.elastic``): ``run``,
``KerasState`` and the callbacks that keep ``state.batch`` and ``state.epoch`` and commit.

::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=EPOCHS - state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)])

(epochs committed whole: ``CommitStateCallback(state, batches_per_commit=STEPS)``, or resume
mid-epoch as :class:`UpdateBatchStateCallback` says).

The state handling is :class:`ringflow.tensorflow.elastic.TensorFlowKerasState`'s.
"""

from __future__ import annotations

from typing import Any

import keras

from ..elastic import ObjectState, TensorFlowKerasState, run

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (``model.optimizer`` by default) and plain values."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # alike on every rank after a reset

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch``: the number of batches done in the current epoch.

    Unlike Horovod's, it does not shorten the first epoch after a reset by rewriting
    ``params['steps']``: Keras 3 ignores that (the epoch runs every step again, and from the
    first batch, which repeats samples). Resume in ``fit``'s arguments instead: a dataset that
    starts at ``state.batch`` and ``steps_per_epoch - state.batch`` steps for that epoch
    (docs/guides/elastic.md). Horovod also stores the index of the last batch, one less than
    the number done; this stores the number done."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.first = state.batch  # batches of the current epoch done before this fit()

    def on_train_begin(self, logs: Any = None) -> None:
        self.first = self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = self.first + batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = self.first = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch``: the epochs done across resets (Keras counts from 0 at each fit)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
