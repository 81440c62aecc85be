"""Compression of floating-point tensors to 16 bits on the wire, framework-neutral.

A compressor only chooses the *wire dtype* of a floating tensor: the engine casts while packing
the fusion buffer (compress) and casts back while unpacking it (decompress), so compression costs
no extra pass over memory. Non-floating tensors travel unchanged. Sums of 16-bit values accumulate
in float32 inside the ring (see :mod:`ringflow.algorithms`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .ops import BFLOAT16

__all__ = ["Compression", "Compressor"]


@dataclasses.dataclass(frozen=True)
class Compressor:
    name: str
    wire: np.dtype | None  # None: no compression

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype a tensor of ``dtype`` travels as."""
        dtype = np.dtype(dtype)
        if self.wire is None or dtype.kind != "f" or dtype.itemsize <= self.wire.itemsize:
            return dtype
        return self.wire

    def compress(self, array: np.ndarray) -> tuple[np.ndarray, np.dtype]:
        """Horovod's interface: (compressed array, context to decompress with)."""
        return array.astype(self.wire_dtype(array.dtype), copy=False), array.dtype

    def decompress(self, array: np.ndarray, ctx: np.dtype) -> np.ndarray:
        return array.astype(ctx, copy=False)


class Compression:
    """Horovod's ``Compression`` namespace: ``none``, ``fp16``, and ringflow's ``bf16``."""

    none = Compressor("none", None)
    fp16 = Compressor("fp16", np.dtype(np.float16))
    bf16 = Compressor("bf16", BFLOAT16)

    @classmethod
    def by_name(cls, name: str) -> Compressor:
        return {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}[name]
