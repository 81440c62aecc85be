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

__all__ = ["TORCH_OPS", "Compression", "TorchCompressor"]

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
    """Optional gradient compression used while allreducing (Horovod's names, plus ``bf16``),
    and the gradient compressors with state, for ``DistributedOptimizer(compression=...)``:
    ``powersgd(rank=)``, ``randomk(fraction=)``, ``onebit()``, ``auto()``
    (:mod:`ringflow.compressed`)."""

    none = TorchCompressor("none", _Core.none.wire)
    fp16 = TorchCompressor("fp16", _Core.fp16.wire)
    bf16 = TorchCompressor("bf16", _Core.bf16.wire)
    powersgd = staticmethod(_Core.powersgd)
    randomk = staticmethod(_Core.randomk)
    onebit = staticmethod(_Core.onebit)
    auto = staticmethod(_Core.auto)

    @classmethod
    def by_name(cls, name: str) -> TorchCompressor:
        return {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}[name]


class _TorchOps:
    """:class:`ringflow.compressed.ArrayOps` on torch tensors: PowerSGD's products and QR run on
    the tensor's device; what travels is staged through host memory (it is small)."""

    def to_host(self, x: Any) -> Any:
        return x.detach().contiguous().cpu().numpy()

    def from_host(self, a: Any, like: Any) -> Any:
        if like is None:
            return torch.from_numpy(a.copy())
        return torch.as_tensor(a, dtype=like.dtype, device=like.device)

    def write(self, x: Any, a: Any) -> None:
        src = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
        with torch.no_grad():
            x.copy_(src.reshape(x.shape))

    def orthonormal(self, p: Any) -> Any:
        return torch.linalg.qr(p).Q


TORCH_OPS = _TorchOps()
