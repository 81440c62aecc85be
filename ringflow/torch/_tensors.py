"""Conversion between CPU torch tensors and the numpy arrays the engine moves.

A contiguous CPU tensor becomes a numpy array over the *same memory* (``Tensor.numpy()``), so an
in-place collective writes straight into the tensor and an out-of-place one into a fresh tensor
allocated here. bfloat16, which numpy lacks, is reinterpreted through int16 as ml_dtypes'
bfloat16; bool maps to numpy bool. A non-contiguous tensor is copied once to a contiguous one (an
in-place collective copies the result back when it completes).

A tensor that cannot take part (not a tensor, not on the CPU, a dtype ringflow does not move) is
*not* rejected here with a local exception: that would leave the other ranks waiting for this
rank's request. It becomes the kit's :class:`~ringflow._adapter.Invalid` placeholder, whose
conversion to numpy fails with the reason; the core turns that into a request that carries the
error, and the operation fails on every rank with the same text.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._adapter import Invalid
from ..ops import BFLOAT16

__all__ = ["SUPPORTED", "from_numpy", "prepare", "to_numpy"]

#: torch dtypes ringflow moves (the numpy side of each is in ringflow.ops.DTYPES).
SUPPORTED = (
    torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a contiguous, detached CPU tensor (no copy).

    A 0-dim tensor is seen as shape (1,): the core treats every array as at least 1-d
    (``np.ascontiguousarray``), and an ``out`` of shape () would not match its request.
    """
    a = t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()
    return a.reshape(1) if a.ndim == 0 else a


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """The torch tensor over ``a``'s memory (no copy)."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def prepare(tensor: Any, what: str) -> tuple[np.ndarray | Invalid, torch.Tensor | None]:
    """(array for the engine, contiguous tensor that owns its memory) or (Invalid, None)."""
    if not isinstance(tensor, torch.Tensor):
        return Invalid(f"{what} must be a torch.Tensor, got {type(tensor).__name__}"), None
    if tensor.device.type != "cpu":
        return Invalid(
            f"{what} is on device {tensor.device}; ringflow.torch moves CPU tensors only "
            "(GPU support comes with the NCCL transport); move it with tensor.cpu()"
        ), None
    if tensor.dtype not in SUPPORTED or tensor.is_sparse:
        kind = "a sparse tensor" if tensor.is_sparse else f"dtype {tensor.dtype}"
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED)
        return Invalid(f"{what} has {kind}, which ringflow cannot move; supported: {names}"), None
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return to_numpy(t), t
