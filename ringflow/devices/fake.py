"""The CPU stand-in for a GPU: device kind ``"fake"``, arrays that numpy refuses.

CI has no GPU, yet the device path of the core (claiming the device, fusion buffers allocated on
it, host staging, results returned on the input's device) must run for real. A
:class:`FakeArray` holds its values in host memory, but ``np.asarray`` of it raises, numpy's
ufuncs refuse it, and it has no buffer protocol: any place where the core forgot to go through
the :class:`~ringflow.devices.ArrayNamespace` fails loudly instead of silently working on the
host. :class:`FakeNamespace` is the namespace a GPU library would provide; only its innermost
calls differ (numpy on the hidden values instead of CUDA kernels and copies), and it counts
what it does in :data:`COUNTS` (copies to and from the host, with bytes; allocations; ``ready``
and ``fence`` calls), so tests can assert that a fused allreduce is staged with exactly one copy
each way.

``to_fake(host_array, device)`` and :func:`asnumpy` (the test's own view, not counted) move
values in and out, as ``cupy.asarray`` and ``cupy.asnumpy`` would.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from ..ops import check_dtype, scale_into

__all__ = ["COUNTS", "FakeArray", "FakeNamespace", "asnumpy", "reset_counts", "to_fake"]

#: What :class:`FakeNamespace` did in this process (see the module doc).
COUNTS: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()


def _count(what: str, nbytes: int = 0) -> None:
    with _counts_lock:
        COUNTS[what] += 1
        if nbytes:
            COUNTS[f"{what}_bytes"] += nbytes


def reset_counts() -> None:
    with _counts_lock:
        COUNTS.clear()


class FakeArray:
    """An array on the stand-in device (see the module doc). Slicing and ``reshape`` give
    views, like a GPU array's."""

    __slots__ = ("_data", "device")
    __array_ufunc__ = None  # numpy's ufuncs refuse it (a TypeError), as they refuse cupy's

    def __init__(self, data: np.ndarray, device: str = "fake:0") -> None:
        self._data = data
        self.device = device

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def ndim(self) -> int:
        return self._data.ndim

    @property
    def size(self) -> int:
        return self._data.size

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def __len__(self) -> int:
        return len(self._data)

    def reshape(self, *shape: Any) -> FakeArray:
        return FakeArray(self._data.reshape(*shape), self.device)

    def __getitem__(self, key: Any) -> FakeArray:
        return FakeArray(self._data[key], self.device)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(f"an array on {self.device} cannot be read as a numpy array; copy it to "
                        "the host through its namespace (ringflow.devices)")

    def __repr__(self) -> str:
        return f"FakeArray({self._data!r}, device={self.device!r})"


def to_fake(host: Any, device: str = "fake:0") -> FakeArray:
    """A new array on ``device`` holding a copy of ``host`` (not counted: the test's input)."""
    return FakeArray(np.array(host, order="C"), device)


def asnumpy(a: FakeArray) -> np.ndarray:
    """A host copy of ``a``'s values (not counted: the test's own look)."""
    return a._data.copy()


def _data(a: FakeArray) -> np.ndarray:
    if not isinstance(a, FakeArray):  # a host array where a device one belongs: a core bug
        raise TypeError(f"expected an array on the fake device, got {type(a).__name__}")
    return a._data


class FakeNamespace:
    name = "fake"

    def device(self, a: FakeArray) -> str:
        return a.device

    def dtype(self, a: FakeArray) -> np.dtype:
        return check_dtype(a.dtype)

    def is_contiguous(self, a: FakeArray) -> bool:
        return bool(_data(a).flags.c_contiguous)

    def contiguous(self, a: FakeArray) -> FakeArray:
        return a if self.is_contiguous(a) else FakeArray(np.array(a._data, order="C"), a.device)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: FakeArray | None) -> FakeArray:
        _count("alloc")
        return FakeArray(np.empty(shape, dtype), "fake:0" if like is None else like.device)

    def flat(self, a: FakeArray) -> FakeArray:
        return FakeArray(_data(a).reshape(-1), a.device)

    def copy(self, dst: FakeArray, src: FakeArray, prescale: float = 1.0) -> None:
        if dst.device != src.device:
            raise ValueError(f"copy between {src.device} and {dst.device}")
        if prescale != 1.0:
            scale_into(_data(src), prescale, _data(dst))
        else:
            np.copyto(_data(dst), _data(src), casting="unsafe")

    def zero(self, dst: FakeArray) -> None:
        _data(dst).fill(0)

    def host_empty(self, n: int, dtype: np.dtype, like: Any) -> np.ndarray:
        return np.empty(n, dtype)

    def to_host(self, src: FakeArray, out: np.ndarray) -> None:
        if isinstance(out, FakeArray) or out.dtype != src.dtype or out.size != src.size:
            raise ValueError(f"to_host of {src.dtype}[{src.size}] into {out!r}")
        _count("to_host", src.nbytes)
        np.copyto(out.reshape(src.shape), _data(src))

    def from_host(self, src: np.ndarray, dst: FakeArray) -> None:
        if isinstance(src, FakeArray) or src.dtype != dst.dtype or src.size != dst.size:
            raise ValueError(f"from_host of {src!r} into {dst.dtype}[{dst.size}]")
        _count("from_host", dst.nbytes)
        np.copyto(_data(dst), src.reshape(dst.shape))

    def ready(self, a: FakeArray) -> None:
        _count("ready")

    def fence(self, like: Any, timeout: float) -> None:
        _count("fence")
