"""``Compression`` for TensorFlow: the core's compressors, whose ``compress``/``decompress`` also
take TensorFlow tensors, as Horovod's ``horovod.tensorflow.Compression`` does.

Passed to a collective, a compressor is handed to the engine, which casts while it fuses (the
wire dtype is :meth:`ringflow.compression.Compressor.wire_dtype`'s: floating tensors wider than
16 bits); these methods are for code that calls them itself (Horovod's tests, custom wrappers):
``compress(t) -> (t', ctx)`` casts a floating tensor to the wire dtype (a ``tf.cast``, in eager
code and in graphs alike), ``decompress(t', ctx)`` casts it back. numpy arrays keep the core's
behaviour. Other tensors pass unchanged. (``ringflow.torch.compression`` is the same for torch.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from ringflow import compression as core

__all__ = ["Compression", "TFCompressor"]


@dataclasses.dataclass(frozen=True)
class TFCompressor(core.Compressor):
    """A core :class:`~ringflow.compression.Compressor` that also compresses TensorFlow tensors."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, np.ndarray):
            return super().compress(tensor)
        tensor = tf.convert_to_tensor(tensor)
        wire = tf.as_dtype(self.wire_dtype(tensor.dtype.as_numpy_dtype))
        return (tensor if wire == tensor.dtype else tf.cast(tensor, wire)), tensor.dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if isinstance(tensor, np.ndarray):
            return super().decompress(tensor, ctx)
        return tensor if tensor.dtype == ctx else tf.cast(tensor, ctx)


class Compression:
    """Horovod's ``Compression`` namespace: ``none``, ``fp16``, and ringflow's ``bf16``; and the
    gradient compressors with state for ``DistributedGradientTape`` and the Keras
    ``DistributedOptimizer``: ``powersgd(rank=)``, ``randomk(fraction=)``, ``onebit()``,
    ``auto()`` (:mod:`ringflow.compressed`)."""

    none = TFCompressor("none", core.Compression.none.wire)
    fp16 = TFCompressor("fp16", core.Compression.fp16.wire)
    bf16 = TFCompressor("bf16", core.Compression.bf16.wire)
    powersgd = staticmethod(core.Compression.powersgd)
    randomk = staticmethod(core.Compression.randomk)
    onebit = staticmethod(core.Compression.onebit)
    auto = staticmethod(core.Compression.auto)

    @classmethod
    def by_name(cls, name: str) -> TFCompressor:
        return {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}[name]
