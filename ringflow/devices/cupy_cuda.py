"""The cupy namespace: cupy arrays on CUDA devices (``"cuda:<i>"``).

Runs in CI against the cupy stand-in (``tests/standins/cupy``), which has cupy's interface
but host memory and no kernels; on a GPU, ``tests/gpu`` and ``benchmarks/gpu_check.py``
(docs/guides/gpus.md says what has run on one).

Buffers are cupy arrays on the input's device; casts and Horovod's prescale arithmetic are cupy
ufuncs (``dtype=`` the wide type, ``casting="unsafe"``, as :func:`ringflow.ops.scale_into`);
host staging goes through pinned memory (``cupy.cuda.alloc_pinned_memory``). CUDA ordering:
:meth:`ready` makes the null stream wait for the submitting thread's current stream, the engine
thread works on the null stream, and :meth:`fence` polls an event (``Event.done``).
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from ..ops import check_dtype, is_float16ish, wrap_integers
from . import poll

__all__ = ["CupyNamespace"]


class CupyNamespace:
    name = "cupy"

    def device(self, a: Any) -> str:
        return f"cuda:{a.device.id}"

    def dtype(self, a: Any) -> np.dtype:
        return check_dtype(a.dtype)

    def is_contiguous(self, a: Any) -> bool:
        return bool(a.flags.c_contiguous)

    def contiguous(self, a: Any) -> Any:
        return cp.ascontiguousarray(a)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        if like is None:
            return cp.empty(shape, dtype)
        with cp.cuda.Device(like.device.id):
            return cp.empty(shape, dtype)

    def flat(self, a: Any) -> Any:
        return a.reshape(-1)

    def copy(self, dst: Any, src: Any, prescale: float = 1.0) -> None:
        if prescale == 1.0:
            cp.copyto(dst, src, casting="unsafe")
            return
        if dst.dtype.kind in "iu":  # the one integer rule (ringflow.ops.wrap_integers)
            whole = cp.trunc(cp.multiply(src, np.float64(prescale), dtype=np.float64))
            cp.copyto(dst, wrap_integers(whole, dst.dtype, cp.fmod), casting="unsafe")
            return
        wide = np.float32 if is_float16ish(src.dtype) or src.dtype == np.float32 else np.float64
        cp.multiply(src, wide(prescale), out=dst, dtype=wide, casting="unsafe")

    def zero(self, dst: Any) -> None:
        dst.fill(0)

    def host_empty(self, n: int, dtype: np.dtype, like: Any) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(max(n * dtype.itemsize, 1))
        return np.frombuffer(mem, dtype, n)

    def to_host(self, src: Any, out: np.ndarray) -> None:
        src.get(out=out.reshape(src.shape))

    def from_host(self, src: np.ndarray, dst: Any) -> None:
        dst.set(src.reshape(dst.shape))

    def ready(self, a: Any) -> None:
        with cp.cuda.Device(a.device.id):
            current = cp.cuda.get_current_stream()
            if current != cp.cuda.Stream.null:
                event = cp.cuda.Event(disable_timing=True)
                event.record(current)
                cp.cuda.Stream.null.wait_event(event)

    def fence(self, like: Any, timeout: float) -> None:
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record()
        poll(lambda: event.done, timeout, "the device work of a collective")

