"""Reduce operations and the dtypes ringflow moves.

The enum values are Horovod's (``Average=0, Sum=1, Adasum=2, Min=3, Max=4, Product=5``) so that
constants pickled or compared by Horovod users keep their meaning.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from .errors import TensorError

__all__ = [
    "BFLOAT16",
    "DTYPES",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "check_dtype",
    "dtype_name",
    "is_float16ish",
    "scale_into",
    "ufunc",
    "wrap_integers",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: Every dtype a collective accepts, by name (the name travels in negotiation).
DTYPES: dict[str, np.dtype] = {
    d.name: d
    for d in map(
        np.dtype,
        [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64,
         np.float16, BFLOAT16, np.float32, np.float64],
    )
}

# numpy's dtype.name is computed in Python (~4 us); the engine asks for it on every submission.
_NAMES: dict[np.dtype, str] = {d: n for n, d in DTYPES.items()}


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT,
)

_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def ufunc(op: ReduceOp) -> np.ufunc:
    """The elementwise ufunc that combines two contributions under ``op``."""
    try:
        return _UFUNC[op]
    except KeyError:
        raise TensorError(
            f"reduce op {ReduceOp(op).name} is not supported by ringflow; use Sum or Average"
        ) from None


def check_dtype(dtype: np.dtype, what: str = "tensor") -> np.dtype:
    """Return ``dtype`` if ringflow can move it, else raise TensorError naming the choices."""
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise TensorError(
            f"{what} has dtype {dtype}, which ringflow cannot reduce or move; "
            f"supported: {', '.join(DTYPES)}"
        )
    return dtype


def dtype_name(dtype: np.dtype) -> str:
    """The name under which ``dtype`` (one of :data:`DTYPES`) travels in negotiation."""
    return _NAMES[dtype]


def is_float16ish(dtype: np.dtype) -> bool:
    """16-bit floats, whose sums ringflow accumulates in float32."""
    return dtype == np.float16 or dtype == BFLOAT16


def scale_into(src: np.ndarray, factor: float, out: np.ndarray) -> None:
    """``out[...] = src * factor`` with Horovod's CPU arithmetic (``ScaleBuffer``).

    16-bit floats and float32 are multiplied in float32 by the factor rounded to float32, and
    rounded once into ``out`` (numpy's own float16 loop would first round the factor to 16
    bits); float64 and integers are multiplied in float64, and integers truncated toward zero
    and wrapped into their dtype (:func:`wrap_integers`). ``out`` may be ``src``, or an array of
    another dtype (a wire dtype).
    """
    if out.dtype.kind in "iu":
        wide = np.multiply(src, np.float64(factor), dtype=np.float64)
        np.copyto(out, wrap_integers(np.trunc(wide, out=wide), out.dtype), casting="unsafe")
        return
    wide = np.float32 if is_float16ish(src.dtype) or src.dtype == np.float32 else np.float64
    np.multiply(src, wide(factor), out=out, dtype=wide, casting="unsafe")


def wrap_integers(whole: Any, dtype: np.dtype, fmod: Any = np.fmod) -> Any:
    """``whole`` (float64 holding whole numbers: a scaled integer sum, truncated toward zero)
    reduced modulo ``2**bits`` into the range of the integer ``dtype``, ready to be cast.

    The one rule for scaled integers on every path (the host's numpy, the same-host lane, the
    GPU's NCCL path, through numpy, cupy or torch: ``fmod`` is the library's): sum exactly in
    the dtype (wrapping, as integer sums do), scale once in float64, truncate toward zero, and
    wrap what does not fit, as the sum would have. Horovod leaves an out-of-range conversion to
    C's ``static_cast``, which is undefined: x86 wraps through a 32-bit integer while CUDA
    saturates, so a uint8 average with a postscale of 2 gave 254 on the host and 255 on a GPU.
    Values in range are unchanged. Exact: ``fmod`` is exact in IEEE arithmetic, and the
    corrections by ``2**bits`` subtract numbers within a factor of two of each other.
    """
    modulus = float(2 ** (8 * dtype.itemsize))
    wrapped = fmod(whole, modulus)  # (-2**bits, 2**bits), the sign of whole
    if dtype.kind == "i":
        return wrapped - (wrapped >= modulus / 2) * modulus + (wrapped < -modulus / 2) * modulus
    return wrapped + (wrapped < 0) * modulus
