"""Reductions over arrays that are all in this process's memory.

:func:`reduce_parts` combines ``n`` contributions element by element **in rank order** and scales
once. Its users: the shared-memory allreduce (each rank reduces its share of every local rank's
segment) and the coordinator's small-tensor path (rank 0 reduces the copies the ranks sent with
their cache bits; see :mod:`ringflow.negotiation`). Because the order of the operands never
depends on where an element sits in the buffer, both give bitwise identical results for the same
inputs, whatever the fusion layout.

Accumulation: 16-bit floats in float32 (rounded to 16 bits once, at the end; each 16-bit block
is widened and the result narrowed by :func:`ringflow.devices.casts.cast_into`, a framework's
kernel where one is imported, with numpy's bits: numpy's own float16 loops cost ~7x more, which
kept fp16 compression slower than none); everything else in
its own dtype, integers included (a sum that overflows wraps, as on the ring, MPI and NCCL), the
scale of integers applied in float64, truncated toward zero and wrapped into the dtype
(:func:`ringflow.ops.wrap_integers`). AVERAGE
is SUM scaled by ``postscale / n``. These are the ring's rules (:mod:`.reduction`): every path
gives the same bits. (Scaled integers used to be summed in float64, so an integer AVERAGE whose
sum overflowed was the true mean here and the wrapped one on the ring; the soak test found it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..devices import casts
from ..errors import TensorError
from ..ops import ReduceOp, is_float16ish, ufunc, wrap_integers
from .buffers import chunk_elems, chunk_ranges

__all__ = ["STREAM_BYTES", "reduce_parts"]

#: From this many bytes in its range on, :func:`reduce_parts` writes whole blocks large enough for
#: glibc to stream them past the cache. 2 ranks, float32, both at once, ms per reduce pass over
#: each rank's share (2 parts in, 2 copies out): 8 MiB shares 1.3 in place in 512 KiB blocks,
#: 1.5-1.8 streamed; 32 MiB shares 11 in place, 7.0-7.6 streamed.
STREAM_BYTES = 16 << 20


def reduce_parts(parts: Sequence[np.ndarray], lo: int, hi: int, dst: np.ndarray, op: ReduceOp,
                 postscale: float, mirror: np.ndarray | None = None) -> None:
    """``dst[lo:hi] = parts[0] (op) parts[1] (op) ...`` over ``[lo:hi]``, then scaled once.

    Works block by block, so a block is still in cache when the next part is combined into it
    and when it is copied to ``mirror[lo:hi]`` (if given): memory sees each part read once and
    each output written once. From :data:`STREAM_BYTES` on, blocks of
    :data:`~.buffers.CHUNK_BYTES` are combined in an accumulator and written to ``dst`` and
    ``mirror`` by plain copies, which glibc streams past the cache (non-temporal stores; see
    :data:`ringflow.runner.launch.MEMCPY_TUNABLE`) instead of reading each output line before
    writing it.
    """
    dtype = dst.dtype
    combine = ufunc(op)
    factor = postscale / len(parts) if op == ReduceOp.AVERAGE else postscale
    if dtype == np.bool_ and (op == ReduceOp.AVERAGE or postscale != 1.0):
        raise TensorError("a bool tensor cannot be averaged or scaled; use Sum, Min, Max or "
                          "Product, or cast it to a numeric dtype")
    if len(parts) == 1 and factor == 1.0 and mirror is None:
        # One contribution, unscaled (a job or set of one rank): the result is the part itself,
        # whatever the dtype, and dst may be the part (in place).
        np.copyto(dst[lo:hi], parts[0][lo:hi])
        return
    wide = is_float16ish(dtype)
    acc_dtype = np.dtype(np.float32 if wide else dtype)
    scale_ints = dtype.kind in "iu" and factor != 1.0  # scaled in a float64 block of its own
    # A range that is likely still in cache is combined in place in dst, in blocks below glibc's
    # non-temporal threshold. A larger one goes through an accumulator block and is written out
    # by whole-block copies that glibc streams past the cache. Wide dtypes need the accumulator;
    # so does a dst that is a later part (rank r > 0 of the shared-memory path reduces into its
    # own input): writing parts[0] there first would destroy that part before it is read.
    stream = (hi - lo) * dtype.itemsize >= STREAM_BYTES
    per = chunk_elems(8 if scale_ints else acc_dtype.itemsize) // (1 if stream else 2) or 1
    if wide and hi - lo >= casts.MIN_ELEMENTS:
        return _reduce_wide(parts, lo, hi, dst, combine, factor, mirror)
    if (hi - lo <= per and not (wide or stream or scale_ints) and mirror is None
            and _apart(dst, parts)):
        # One block into a dst apart from every part (small tensors: the eager path and the
        # lane): what the loop below does, without its set-up (10 us -> 2 us at 4 KiB).
        tmp = dst[lo:hi]
        first, k = parts[0][lo:hi], 1
        if len(parts) > 1 and first.dtype == dtype == parts[1].dtype:
            # Straight into dst: the bits of copying the first part there, then combining.
            combine(first, parts[1][lo:hi], out=tmp)
            k = 2
        else:
            np.copyto(tmp, first)
        for part in parts[k:]:
            combine(tmp, part[lo:hi], out=tmp, casting="unsafe")
        if factor != 1.0:
            np.multiply(tmp, factor, out=tmp, casting="unsafe")
        return
    if len(parts) == 2 and np.may_share_memory(dst, parts[1]):
        parts = parts[::-1]  # two operands commute exactly (every op here); reduce in place
    acc = None
    if stream or wide or not _apart(dst, parts[1:]):
        acc = np.empty(min(per, max(hi - lo, 1)), acc_dtype)
    scaled = np.empty(min(per, max(hi - lo, 1)), np.float64) if scale_ints else None
    in_place = dst.ctypes.data == parts[0].ctypes.data and dst.strides == parts[0].strides
    for a, b in chunk_ranges(lo, hi, per):
        rest = parts[1:]
        if acc is None:
            tmp = dst[a:b]
            if not in_place:
                np.copyto(tmp, parts[0][a:b])
        else:
            tmp = acc[: b - a]
            if rest:
                combine(parts[0][a:b], rest[0][a:b], out=tmp, dtype=acc_dtype, casting="unsafe")
                rest = rest[1:]
            else:
                np.copyto(tmp, parts[0][a:b], casting="unsafe")
        for part in rest:
            combine(tmp, part[a:b], out=tmp, casting="unsafe")
        if scaled is not None:
            f = scaled[: b - a]
            np.multiply(tmp, factor, out=f, dtype=np.float64)
            np.trunc(f, out=f)  # toward zero, like C's static_cast
            np.copyto(tmp, wrap_integers(f, dtype), casting="unsafe")
        elif factor != 1.0:
            np.multiply(tmp, factor, out=tmp, casting="unsafe")
        if acc is not None:
            np.copyto(dst[a:b], tmp, casting="unsafe")
        if mirror is not None:
            np.copyto(mirror[a:b], tmp, casting="unsafe")


#: Elements per block of a 16-bit reduction: a framework's cast of each block is one parallel
#: region of its thread pool, so blocks are large (4 MiB of float32) to keep the regions few (a
#: region waits for every thread, and a preempted one costs a time slice on a loaded host).
WIDE_BLOCK = casts.CHUNK


def _reduce_wide(parts: Sequence[np.ndarray], lo: int, hi: int, dst: np.ndarray, combine: Any,
                 factor: float, mirror: np.ndarray | None) -> None:
    """:func:`reduce_parts` of 16-bit floats: each block of each part widened to float32 (exact),
    combined in float32 in rank order, scaled, narrowed once: the bits of numpy's mixed-dtype
    ufuncs (``combine(f16, f16, dtype=float32)``, then ``copyto``), at a kernel's speed."""
    n = min(WIDE_BLOCK, hi - lo)
    acc = np.empty(n, np.float32)
    got = np.empty(n, np.float32) if len(parts) > 1 else None
    for a, b in chunk_ranges(lo, hi, WIDE_BLOCK):
        tmp = acc[: b - a]
        casts.cast_into(tmp, parts[0][a:b])
        for part in parts[1:]:
            other = got[: b - a]
            casts.cast_into(other, part[a:b])
            combine(tmp, other, out=tmp)
        if factor != 1.0:
            np.multiply(tmp, factor, out=tmp, casting="unsafe")
        casts.cast_into(dst[a:b], tmp)
        if mirror is not None:
            casts.cast_into(mirror[a:b], tmp)


def _apart(dst: np.ndarray, parts: Sequence[np.ndarray]) -> bool:
    """Whether ``dst`` shares memory with none of ``parts``."""
    for part in parts:
        if np.may_share_memory(dst, part):
            return False
    return True
