"""The host namespace: numpy arrays in this process's memory (device ``"cpu"``).

The executor runs CPU items through it too, so that the device path and the host path are one
piece of code that differs only in these calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import check_dtype, scale_into
from .casts import cast_into

__all__ = ["HOST", "HostNamespace"]


class HostNamespace:
    name = "numpy"

    def device(self, a: Any) -> str:
        return "cpu"

    def dtype(self, a: np.ndarray) -> np.dtype:
        return check_dtype(a.dtype)

    def is_contiguous(self, a: np.ndarray) -> bool:
        return bool(a.flags.c_contiguous)

    def contiguous(self, a: np.ndarray) -> np.ndarray:
        return a if a.flags.c_contiguous else np.array(a, order="C")

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    def flat(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(-1)

    def copy(self, dst: np.ndarray, src: np.ndarray, prescale: float = 1.0) -> None:
        if dst.dtype != src.dtype:  # compression and decompression: a framework's kernel
            cast_into(dst, src, prescale)
        elif prescale != 1.0:
            scale_into(src, prescale, dst)
        else:
            np.copyto(dst, src, casting="unsafe")

    def zero(self, dst: np.ndarray) -> None:
        dst.fill(0)

    def host_empty(self, n: int, dtype: np.dtype, like: Any) -> np.ndarray:
        return np.empty(n, dtype)

    def to_host(self, src: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, src)

    def from_host(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src)

    def ready(self, a: np.ndarray) -> None:
        pass

    def fence(self, like: Any, timeout: float) -> None:
        pass


HOST = HostNamespace()
