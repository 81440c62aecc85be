"""Gradient compression for ``ringflow.torch``: Horovod's ``Compression`` namespace.

``Compression.none``, ``Compression.fp16`` and ringflow's ``Compression.bf16`` are core
:class:`ringflow.compression.Compressor` values, so a collective that receives one hands it to the
engine, which casts to the 16-bit wire dtype while it packs the fusion buffer and back while it
unpacks: no extra pass over the tensor, no temporary tensor in the adapter.

``compress`` / ``decompress`` on torch tensors are still offered because Horovod users call them
directly (``tensor_c, ctx = Compression.fp16.compress(t)``). A user-defined compressor in Horovod's
style (any object with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``) is
also accepted by every collective; the adapter then applies it around the collective itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compression import Compression as _Core
from ..compression import Compressor

__all__ = ["Compression", "TorchCompressor"]

_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class TorchCompressor(Compressor):
    """A core compressor whose ``compress`` / ``decompress`` also accept torch tensors."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        """(tensor cast to the wire dtype, its original dtype); non-float tensors pass as is."""
        if not isinstance(tensor, torch.Tensor):
            return super().compress(tensor)
        wire = _WIRE.get(self.name)
        if wire is None or not tensor.is_floating_point() or tensor.element_size() <= 2:
            return tensor, tensor.dtype
        return tensor.to(wire), tensor.dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:  # type: ignore[override]
        if not isinstance(tensor, torch.Tensor):
            return super().decompress(tensor, ctx)
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """Optional gradient compression used while allreducing (Horovod's names, plus ``bf16``)."""

    none = TorchCompressor("none", _Core.none.wire)
    fp16 = TorchCompressor("fp16", _Core.fp16.wire)
    bf16 = TorchCompressor("bf16", _Core.bf16.wire)
