"""Keras callbacks of Horovod 0.28 (``horovod.tensorflow.keras.callbacks``) for Keras 3.

- ``BroadcastGlobalVariablesCallback(root_rank)``: the model's variables from ``root_rank`` at
  the start of training, then model and optimizer variables after the first batch (when the
  optimizer's slots exist), as Horovod does.
- ``MetricAverageCallback()``: averages every epoch-end metric over the ranks, in one grouped
  allreduce. Put it before callbacks that read the metrics (checkpoints, early stopping).
- ``LearningRateScheduleCallback(initial_lr, multiplier, ...)``: ``lr = initial_lr *
  multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``, per epoch (staircase) or per
  batch with a fractional epoch.
- ``LearningRateWarmupCallback(initial_lr, warmup_epochs, ...)``: the schedule from
  ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al., 2017).

``momentum_correction`` scales the momentum by new_lr/old_lr for the batch where the learning rate
changes. Keras 3 optimizers keep ``momentum`` as a Python float that a traced train function has
already baked in, so the correction is applied only where ``momentum`` is a variable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import global_process_set
from ringflow.errors import ConfigError

from ..functions import broadcast_variables

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s model and optimizer state."""

    def __init__(self, root_rank: int, device: str = "",
                 process_set: Any = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.broadcast_done = False

    def _broadcast(self, with_optimizer: bool) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if with_optimizer and optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        if variables:
            broadcast_variables(variables, self.root_rank, process_set=self.process_set,
                                name="BroadcastGlobalVariablesCallback")

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # The model first, so that the first step starts from the same weights everywhere.
        if not self.broadcast_done:
            self._broadcast(with_optimizer=False)

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Then, once the first step has created the optimizer's slots, everything (Horovod's
        # order); later fits with this callback do not broadcast again.
        if not self.broadcast_done:
            self._broadcast(with_optimizer=True)
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch-end metric in ``logs`` by its average over the ranks."""

    def __init__(self, device: str = "", process_set: Any = global_process_set) -> None:
        super().__init__()
        self.device = device
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if not keys:
            return
        values = np.asarray([float(logs[k]) for k in keys], np.float64)
        # One name per key set: ranks with different metric names get a mismatch, not a hang.
        averaged = _core.allreduce(values, name=f"MetricAverageCallback.{','.join(keys)}",
                                   op=_core.Average, process_set=self.process_set)
        for k, v in zip(keys, averaged, strict=True):
            logs[k] = float(v)


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` while ``start_epoch <= epoch < end_epoch``.

    ``multiplier`` is a number (constant, staircase) or a function of the (fractional, unless
    ``staircase``) epoch. ``steps_per_epoch`` defaults to Keras's ``params['steps']``.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: float | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.staircase = True
            self.multiplier = lambda epoch: multiplier

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = float(np.asarray(optimizer.learning_rate))
        new_lr = self.initial_lr * float(self.multiplier(epoch))
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, tf.Variable) and old_lr > 0:
            self.restore_momentum = float(momentum.numpy())
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ConfigError(
                "LearningRateScheduleCallback(staircase=False) needs steps_per_epoch, and Keras "
                "did not report params['steps']; pass steps_per_epoch= explicitly"
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase:
            epoch = self.current_epoch + float(batch) / self.steps_per_epoch
            if self._in_range(epoch):
                self._adjust(epoch)

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._restore()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, batch by batch."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            n = _core.size()
            # (epoch * (n - 1) / warmup + 1) / n: 1/n at epoch 0, 1 at epoch == warmup_epochs.
            return (epoch * (n - 1) / warmup_epochs + 1) / n

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            # The last batch ran at a fractional epoch just below warmup_epochs: land exactly.
            self.model.optimizer.learning_rate = self.initial_lr
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _core.rank() == 0:
            lr = float(np.asarray(self.model.optimizer.learning_rate))
            _show(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


def _show(message: str) -> None:
    """Keras's own channel for callback messages (stdout or absl), else the log."""
    try:
        from keras.src.utils.io_utils import print_msg
    except ImportError:  # a Keras that moved it: the message still reaches the log
        log.info(message)
    else:
        print_msg(message)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint(save_best_only=True)`` that writes on rank 0 only."""

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 mode: str = "auto", save_freq: str | int = "epoch") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, mode=mode, save_freq=save_freq)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if _core.rank() == 0:
            super()._save_model(*args, **kwargs)
