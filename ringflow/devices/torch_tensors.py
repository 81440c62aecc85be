"""The torch namespace: torch tensors on any non-CPU device, moved with torch's own operations.

``ringflow.torch`` hands a CUDA tensor (or one on any other non-CPU torch device, such as the
CPU stand-in :mod:`ringflow.torch.fake_device`) to the core as the tensor itself: no DLPack
round trip, and no cupy needed to stage it. Buffers are allocated with ``like.new_empty`` on the
tensor's device, casts and Horovod's prescale arithmetic are torch operations on the device,
and host staging is ``Tensor.copy_`` into pinned host memory for CUDA (pageable elsewhere).
CUDA ordering: :meth:`ready` makes the device's default stream wait for the submitting
thread's current stream, the engine thread works on its default stream, and :meth:`fence`
polls an event recorded there (``Event.query``), so the engine thread is never inside a
blocking CUDA call. The NCCL implementation (:class:`ringflow.backends.Nccl`) sees these
tensors through DLPack as cupy arrays (no copy).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TensorError
from ..ops import BFLOAT16, DTYPES, wrap_integers
from . import poll

__all__ = ["TO_NUMPY", "TO_TORCH", "TorchNamespace", "host_view"]

#: torch dtype -> numpy dtype, for the dtypes ringflow moves (bfloat16: ml_dtypes').
TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8), torch.uint16: np.dtype(np.uint16),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64), torch.float16: np.dtype(np.float16),
    torch.bfloat16: BFLOAT16, torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in TO_NUMPY.items()}


#: Each CUDA device's default stream (``ready`` compares the current stream with it every call).
_DEFAULT_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def host_view(a: np.ndarray) -> torch.Tensor:
    """The CPU tensor over the host array ``a``'s memory (bfloat16 through int16)."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Horovod's ScaleBuffer precision (see :func:`ringflow.ops.scale_into`)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16, torch.float32) \
        else torch.float64


class TorchNamespace:
    name = "torch"

    def device(self, a: torch.Tensor) -> str:
        d = a.device
        return "cpu" if d.type == "cpu" else f"{d.type}:{0 if d.index is None else d.index}"

    def dtype(self, a: torch.Tensor) -> np.dtype:
        try:
            return TO_NUMPY[a.dtype]
        except KeyError:
            raise TensorError(f"tensor has dtype {a.dtype}, which ringflow cannot move; "
                              f"supported: {', '.join(DTYPES)}") from None

    def is_contiguous(self, a: torch.Tensor) -> bool:
        return a.is_contiguous()

    def contiguous(self, a: torch.Tensor) -> torch.Tensor:
        return a.detach().contiguous()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: torch.Tensor | None
              ) -> torch.Tensor:
        if like is None:  # a joined rank on CUDA without a tensor of its own: its current GPU
            return torch.empty(shape, dtype=TO_TORCH[dtype], device="cuda")
        return like.new_empty(shape, dtype=TO_TORCH[dtype])

    def flat(self, a: torch.Tensor) -> torch.Tensor:
        return a.view(-1)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, prescale: float = 1.0) -> None:
        with torch.no_grad():
            if prescale == 1.0:
                dst.copy_(src)  # casts (the compression); float -> int truncates, as C does
                return
            wide = _wide(src.dtype)
            # A 0-d CPU tensor of the wide dtype: the factor rounded to it, as numpy's
            # ``wide(factor)`` is, and usable with a tensor on any device.
            scaled = src.to(wide) * torch.tensor(prescale, dtype=wide)
            if not dst.dtype.is_floating_point and dst.dtype != torch.bool:
                # the one integer rule (ringflow.ops.wrap_integers)
                scaled = wrap_integers(torch.trunc(scaled), TO_NUMPY[dst.dtype], torch.fmod)
            dst.copy_(scaled)

    def zero(self, dst: torch.Tensor) -> None:
        with torch.no_grad():
            dst.zero_()

    def host_empty(self, n: int, dtype: np.dtype, like: torch.Tensor) -> np.ndarray:
        if like is not None and like.is_cuda:  # pinned: copies run at full speed, and async
            t = torch.empty(n, dtype=torch.int16 if dtype == BFLOAT16 else TO_TORCH[dtype],
                            pin_memory=True)
            a = t.numpy()
            return a.view(BFLOAT16) if dtype == BFLOAT16 else a
        return np.empty(n, dtype)

    def to_host(self, src: torch.Tensor, out: np.ndarray) -> None:
        with torch.no_grad():
            host_view(out).view(src.shape).copy_(src)

    def from_host(self, src: np.ndarray, dst: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(host_view(src).view(dst.shape))

    def ready(self, a: torch.Tensor) -> None:
        if a.is_cuda:
            current = torch.cuda.current_stream(a.device)
            default = _DEFAULT_STREAMS.get(a.device)
            if default is None:
                default = _DEFAULT_STREAMS[a.device] = torch.cuda.default_stream(a.device)
            if current != default:
                default.wait_stream(current)

    def fence(self, like: torch.Tensor, timeout: float) -> None:
        if like is None or not like.is_cuda:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(like.device))
        poll(event.query, timeout, "the device work of a collective")

