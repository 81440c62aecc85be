"""A CPU stand-in for cupy (see ../README.md): arrays in host memory behind cupy's interface.

Only what ringflow and its tests call is here. Arrays refuse numpy's implicit conversion and
ufuncs, as cupy's do, so a core path that forgot to go through its namespace fails loudly.
Kernels run at once on the calling thread (every stream is therefore in order with every
other); events report "not done" at their first query, so polling loops are exercised.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__version__ = os.environ.get("CUPY_STANDIN_VERSION", "14.2.0")
STANDIN = True

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, bool_ = np.uint8, np.uint16, np.bool_


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray:
    """A device array: host memory, the device it was made on."""

    __slots__ = ("_a", "_device")
    __array_ufunc__ = None

    def __init__(self, a: np.ndarray, device: Any = None) -> None:
        from . import cuda

        self._a = a
        self._device = cuda.Device() if device is None else device

    # what cupy's arrays have
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: self._device)
    data = property(lambda self: _Pointer(self._a.ctypes.data))

    def __len__(self) -> int:
        return len(self._a)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __repr__(self) -> str:
        return f"array({self._a!r}) on device {self._device.id} (cupy stand-in)"

    def _wrap(self, a: np.ndarray) -> ndarray:
        return ndarray(a, self._device)

    def __getitem__(self, key: Any) -> ndarray:
        return self._wrap(self._a[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[key] = _unwrap(value, self)

    def reshape(self, *shape: Any) -> ndarray:
        return self._wrap(self._a.reshape(*shape))

    def ravel(self) -> ndarray:
        return self._wrap(self._a.ravel())

    def view(self, dtype: Any) -> ndarray:
        return self._wrap(self._a.view(dtype))

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        return self._wrap(self._a.astype(dtype, copy=copy))

    def copy(self) -> ndarray:
        return self._wrap(self._a.copy())

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def get(self, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return self._a.copy()
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("Shape mismatch or dtype mismatch in get(out=)")
        out[...] = self._a
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError("Shape mismatch or dtype mismatch in set()")
        self._a[...] = arr

    def _binary(self, other: Any, op: Any) -> ndarray:
        return self._wrap(op(self._a, _unwrap(other, self)))

    def __mul__(self, other: Any) -> ndarray:
        return self._binary(other, np.multiply)

    __rmul__ = __mul__

    def __add__(self, other: Any) -> ndarray:
        return self._binary(other, np.add)

    __radd__ = __add__

    def __sub__(self, other: Any) -> ndarray:
        return self._binary(other, np.subtract)

    def __truediv__(self, other: Any) -> ndarray:
        return self._binary(other, np.true_divide)

    def __ge__(self, other: Any) -> ndarray:
        return self._binary(other, np.greater_equal)

    def __lt__(self, other: Any) -> ndarray:
        return self._binary(other, np.less)

    def __imul__(self, other: Any) -> ndarray:
        np.multiply(self._a, _unwrap(other, self), out=self._a, casting="unsafe")
        return self

    def __eq__(self, other: Any) -> ndarray:  # type: ignore[override]
        return self._binary(other, np.equal)

    __hash__ = None  # type: ignore[assignment]


def _unwrap(value: Any, like: ndarray | None = None) -> Any:
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, np.ndarray) and value.ndim:
        raise TypeError("Unsupported type <class 'numpy.ndarray'>: copy host arrays to the "
                        "device with cupy.asarray")
    return value


def _new(a: np.ndarray) -> ndarray:
    return ndarray(a)


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return _new(np.empty(shape, dtype))


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return _new(np.zeros(shape, dtype))


def ones(shape: Any, dtype: Any = float) -> ndarray:
    return _new(np.ones(shape, dtype))


def full(shape: Any, value: Any, dtype: Any = None) -> ndarray:
    return _new(np.full(shape, value, dtype))


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _new(np.arange(*args, dtype=dtype))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None else a.astype(dtype, copy=False)
    return _new(np.array(a, dtype=dtype, order="C"))


def asnumpy(a: ndarray) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def ascontiguousarray(a: ndarray) -> ndarray:
    return a._wrap(np.ascontiguousarray(a._a))


def concatenate(arrays: Any, axis: int = 0) -> ndarray:
    return _new(np.concatenate([_unwrap(a) for a in arrays], axis))


def copyto(dst: ndarray, src: Any, casting: str = "same_kind") -> None:
    np.copyto(dst._a, _unwrap(src), casting=casting)


def _ufunc(f: Any) -> Any:
    def call(*args: Any, out: ndarray | None = None, **kwargs: Any) -> ndarray:
        got = f(*(_unwrap(a) for a in args), out=None if out is None else out._a, **kwargs)
        return out if out is not None else _new(got)

    return call


multiply = _ufunc(np.multiply)
add = _ufunc(np.add)
trunc = _ufunc(np.trunc)
fmod = _ufunc(np.fmod)
floor = _ufunc(np.floor)


def from_dlpack(x: Any) -> ndarray:
    if isinstance(x, ndarray):
        return x
    raise TypeError(f"the cupy stand-in cannot import {type(x).__name__} through DLPack")


from . import cuda  # noqa: E402  (cuda.Device needs ndarray's module loaded)

__all__ = ["cuda", "ndarray"]
