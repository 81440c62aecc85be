"""``SyncBatchNormalization``: Keras batch normalization with statistics over all ranks' batches.

In training, each rank computes over its batch the per-channel sum, sum of squares and count; one
grouped Sum-allreduce makes them global, and

    mean = sum / count,  variance = sumsq / count - mean**2.

Counting rows (rather than averaging per-rank means, as Horovod does) keeps the statistics exact
when ranks hold batches of different sizes. The allreduce is differentiable, so gradients flow
through the global statistics as in single-process batch norm over the union of the batches.
In inference the moving statistics are used, as in ``keras.layers.BatchNormalization``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ringflow import ProcessSet, Sum, global_process_set

from . import mpi_ops

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose batch statistics cover every rank of ``process_set``."""

    def __init__(self, *args: Any, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        kwargs.pop("fused", None)  # a TF1-era argument Horovod users still pass
        super().__init__(*args, **kwargs)
        self._process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or self._process_set.size() <= 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        local_sum = tf.reduce_sum(x, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x), axis=axes)
        shape = tf.shape(x)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), x.dtype)
        total, total_sq, n = mpi_ops._grouped_allreduce(
            [local_sum, local_sq, tf.reshape(count, [1])], op=Sum,
            name=f"{self.name}_sync_batch_norm", process_set=self._process_set,
        )
        n = tf.reshape(n, [])
        mean = total / n
        variance = tf.maximum(total_sq / n - tf.square(mean), 0.0)
        return mean, variance
