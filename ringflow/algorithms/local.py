"""Reductions over arrays that are all in this process's memory.

:func:`reduce_parts` combines ``n`` contributions element by element **in rank order** and scales
once. Its users: the shared-memory allreduce (each rank reduces its share of every local rank's
segment) and the coordinator's small-tensor path (rank 0 reduces the copies the ranks sent with
their cache bits; see :mod:`ringflow.negotiation`). Because the order of the operands never
depends on where an element sits in the buffer, both give bitwise identical results for the same
inputs, whatever the fusion layout.

Accumulation: 16-bit floats in float32 (rounded to 16 bits once, at the end), integers that are
scaled in float64 and truncated toward zero like C's ``static_cast``; everything else in its own
dtype. AVERAGE is SUM scaled by ``postscale / n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import TensorError
from ..ops import ReduceOp, is_float16ish, ufunc
from .buffers import chunk_elems, chunk_ranges

__all__ = ["reduce_parts"]


def reduce_parts(parts: Sequence[np.ndarray], lo: int, hi: int, dst: np.ndarray, op: ReduceOp,
                 postscale: float) -> None:
    """``dst[lo:hi] = parts[0] (op) parts[1] (op) ...`` over ``[lo:hi]``, then scaled once."""
    dtype = dst.dtype
    combine = ufunc(op)
    factor = postscale / len(parts) if op == ReduceOp.AVERAGE else postscale
    if dtype == np.bool_ and (op == ReduceOp.AVERAGE or postscale != 1.0):
        raise TensorError("a bool tensor cannot be averaged or scaled; use Sum, Min, Max or "
                          "Product, or cast it to a numeric dtype")
    wide = is_float16ish(dtype) or (dtype.kind in "iu" and factor != 1.0)
    if not wide and not any(np.may_share_memory(dst, p) for p in parts[1:]):
        # The same arithmetic straight in dst: no scratch, no chunk loop.
        out = dst[lo:hi]
        np.copyto(out, parts[0][lo:hi], casting="unsafe")
        for part in parts[1:]:
            combine(out, part[lo:hi], out=out, casting="unsafe")
        if factor != 1.0:
            np.multiply(out, factor, out=out, casting="unsafe")
        return
    acc_dtype = (np.float32 if is_float16ish(dtype) else np.float64) if wide else dtype
    per = chunk_elems(8)
    acc = np.empty(min(per, max(hi - lo, 1)), acc_dtype)
    for a, b in chunk_ranges(lo, hi, per):
        tmp = acc[: b - a]
        np.copyto(tmp, parts[0][a:b], casting="unsafe")
        for part in parts[1:]:
            combine(tmp, part[a:b], out=tmp, casting="unsafe")
        if factor != 1.0:
            np.multiply(tmp, factor, out=tmp, casting="unsafe")
            if dtype.kind in "iu":
                np.trunc(tmp, out=tmp)  # toward zero, like C's static_cast
        np.copyto(dst[a:b], tmp, casting="unsafe")
