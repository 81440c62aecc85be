"""How contributions of one dtype are combined and scaled: :class:`Reduction`.

Shared by every implementation that reduces over a network (the ring, MPI's native allreduce,
the hierarchical allreduce's ring across hosts) so that each element is scaled by the same code,
once, by one rank: results stay bitwise identical on every rank. The rules (AVERAGE as SUM then
``1/n``; integers scaled in float64 and truncated; 16-bit sums accumulated in float32 behind a
power-of-two prescale so no partial sum overflows) are specified in :mod:`.ring`'s docstring.
"""

from __future__ import annotations

import math

import numpy as np

from ..devices import casts
from ..errors import TensorError
from ..ops import ReduceOp, check_dtype, is_float16ish, ufunc, wrap_integers
from . import buffers
from .buffers import chunk_ranges

__all__ = ["Reduction", "inplace_flat", "scale_only"]


class Reduction:
    """How one (dtype, op, postscale, n) combines contributions and scales the result."""

    def __init__(self, dtype: np.dtype, op: ReduceOp, postscale: float, size: int, what: str):
        self.dtype = check_dtype(dtype, what)
        self.ufunc = ufunc(op)  # raises TensorError for ADASUM
        postscale = float(postscale)
        if self.dtype == np.bool_ and (op == ReduceOp.AVERAGE or postscale != 1.0):
            raise TensorError(
                f"{what} has dtype bool, which cannot be averaged or scaled "
                f"(op={ReduceOp(op).name}, postscale={postscale}); use Sum (logical or), Min, Max "
                f"or Product (logical and), or cast to a numeric dtype"
            )
        self.half = is_float16ish(self.dtype)
        # 16-bit sums are accumulated in float32 with every contribution pre-scaled by a power of
        # two, so that no partial sum can overflow; see the module docstring.
        self.wide = self.half and op in (ReduceOp.SUM, ReduceOp.AVERAGE)
        self.prescale = 2.0 ** -math.ceil(math.log2(size)) if self.wide else 1.0
        factor = postscale / size if op == ReduceOp.AVERAGE else postscale
        self.factor = factor / self.prescale  # exact: prescale is a power of two
        if self.half:
            self.scratch_dtype: np.dtype | None = np.dtype(np.float32)
        elif self.dtype.kind in "iu" and self.factor != 1.0:
            self.scratch_dtype = np.dtype(np.float64)
        else:
            self.scratch_dtype = None

    def scratch(self, length: int) -> np.ndarray | None:
        if self.scratch_dtype is None:
            return None
        # A 16-bit sum widens both operands: two halves.
        return np.empty(2 * length if self.wide else length, self.scratch_dtype)

    def _widened(self, acc: np.ndarray, got: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """``float32(acc) + float32(got)`` in the first half of ``scratch``: numpy's bits for
        ``np.add(acc, got, dtype=float32)``, widened by a framework's kernel where one is imported
        (:mod:`ringflow.devices.casts`; numpy's float16 loop costs ~7x more)."""
        n = acc.size
        tmp, other = scratch[:n], scratch[scratch.size // 2:][:n]
        casts.cast_into(tmp, acc)
        casts.cast_into(other, got)
        np.add(tmp, other, out=tmp)
        return tmp

    def prescale_inplace(self, flat: np.ndarray) -> None:
        if self.prescale == 1.0:
            return
        if not self.half or flat.size < casts.MIN_ELEMENTS:
            np.multiply(flat, self.prescale, out=flat)
            return
        # numpy's 16-bit multiply is a scalar loop (100 ms for 12.5 M elements here): widen each
        # chunk by a kernel, multiply in float32, narrow once -- the bits of numpy's loop, which
        # computes in float32 too (float16 rounds the factor to float16 first; ml_dtypes'
        # bfloat16 keeps it in float32).
        p = self.prescale
        factor = np.float32(np.float16(p) if flat.dtype == np.float16 else p)
        per = casts.CHUNK
        tmp = np.empty(min(per, flat.size), np.float32)
        for lo, hi in chunk_ranges(0, flat.size, per):
            part = tmp[: hi - lo]
            casts.cast_into(part, flat[lo:hi])
            np.multiply(part, factor, out=part)
            casts.cast_into(flat[lo:hi], part)

    def combine(self, acc: np.ndarray, got: np.ndarray, scratch: np.ndarray | None) -> None:
        """``acc = acc (op) got`` on a chunk that travels on."""
        if self.wide:
            casts.cast_into(acc, self._widened(acc, got, scratch))
        else:
            self.ufunc(acc, got, out=acc)

    def finish(self, acc: np.ndarray, got: np.ndarray | None, scratch: np.ndarray | None) -> None:
        """The owner's last combine (none if ``got`` is None), then the scale."""
        if self.wide and got is not None:
            # Keep the last sum in float32 so that it is rounded to 16 bits only once.
            tmp = self._widened(acc, got, scratch)
            if self.factor != 1.0:
                np.multiply(tmp, self.factor, out=tmp)
            casts.cast_into(acc, tmp)
            return
        if got is not None:
            self.ufunc(acc, got, out=acc)
        if self.factor == 1.0:
            return
        if self.half:
            tmp = scratch[: acc.size]
            np.multiply(acc, self.factor, out=tmp, dtype=np.float32)
            np.copyto(acc, tmp, casting="unsafe")
        elif self.dtype.kind in "iu":
            tmp = scratch[: acc.size]
            np.multiply(acc, self.factor, out=tmp, dtype=np.float64)
            np.trunc(tmp, out=tmp)  # toward zero, like C's static_cast
            np.copyto(acc, wrap_integers(tmp, self.dtype), casting="unsafe")
        else:
            np.multiply(acc, self.factor, out=acc)



def scale_only(flat: np.ndarray, red: Reduction) -> None:
    """One rank: nothing to combine, apply the scale chunk by chunk (bounded scratch)."""
    if red.factor == 1.0:
        return
    per = buffers.chunk_elems(flat.itemsize)
    scratch = red.scratch(min(per, flat.size))
    for lo, hi in chunk_ranges(0, flat.size, per):
        red.finish(flat[lo:hi], None, scratch)


def inplace_flat(buf: np.ndarray, what: str) -> np.ndarray:
    """``buf`` as 1-D, in place: it must be a writable C-contiguous numpy array."""
    if not isinstance(buf, np.ndarray):
        raise TensorError(f"{what} needs a numpy array, got {type(buf).__name__}")
    if not (buf.flags.c_contiguous and buf.flags.writeable):
        raise TensorError(
            f"{what} works in place and needs a writable C-contiguous array, got shape "
            f"{buf.shape} (contiguous={buf.flags.c_contiguous}, writeable={buf.flags.writeable}); "
            f"pass np.ascontiguousarray(tensor) and copy the result back"
        )
    return buf.reshape(-1)
