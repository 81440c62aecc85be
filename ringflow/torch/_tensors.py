"""Conversion between torch tensors and the arrays the engine moves.

A tensor on any device other than the CPU (CUDA, or the stand-in of :mod:`.fake_device`) goes to
the core *as the tensor itself*, detached and contiguous: the core keeps it on its device and
moves it with :class:`~ringflow.devices.torch_tensors.TorchNamespace` (fusion buffers and
outputs on that device; NCCL or host staging with torch's own copies), and results come back as
tensors on the same device. The rest of this module is about CPU tensors.

A contiguous CPU tensor becomes a numpy array over the *same memory* (``Tensor.numpy()``), so an
in-place collective writes straight into the tensor and an out-of-place one into a fresh tensor
allocated here. bfloat16, which numpy lacks, is reinterpreted through int16 as ml_dtypes'
bfloat16; bool maps to numpy bool. A non-contiguous tensor is copied once to a contiguous one (an
in-place collective copies the result back when it completes).

A tensor that cannot take part (not a tensor, sparse, a dtype ringflow does not move) is
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

__all__ = ["SUPPORTED", "from_core", "from_numpy", "prepare", "to_core", "to_numpy"]

#: torch dtypes ringflow moves (the numpy side of each is in ringflow.ops.DTYPES).
SUPPORTED = (
    torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a contiguous, detached CPU tensor (no copy), of the same shape: a 0-dim
    tensor stays 0-dim, so that the core's rules see it (a reducescatter or alltoall of one
    fails on every rank; an allgather takes it as one row)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """The torch tensor over ``a``'s memory (no copy)."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def to_core(t: torch.Tensor) -> Any:
    """What the engine moves for the contiguous, detached tensor ``t``: the numpy view of a CPU
    tensor, a device tensor itself."""
    return to_numpy(t) if t.device.type == "cpu" else t


def from_core(result: Any) -> torch.Tensor:
    """A tensor for what the engine returned: a device tensor as is, a numpy array wrapped."""
    return result if isinstance(result, torch.Tensor) else from_numpy(np.asarray(result))


def prepare(tensor: Any, what: str) -> tuple[Any, torch.Tensor | None]:
    """(array for the engine, contiguous tensor that owns its memory) or (Invalid, None)."""
    if not isinstance(tensor, torch.Tensor):
        return Invalid(f"{what} must be a torch.Tensor, got {type(tensor).__name__}"), None
    if tensor.dtype not in SUPPORTED or tensor.is_sparse:
        kind = "a sparse tensor" if tensor.is_sparse else f"dtype {tensor.dtype}"
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED)
        return Invalid(f"{what} has {kind}, which ringflow cannot move; supported: {names}"), None
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return to_core(t), t
