"""Ring allreduce and ring reduce-scatter over any :class:`~ringflow.transport.Transport`.

Notation: ``n`` ranks, this rank ``r``, ``next = (r+1) % n``, ``prev = (r-1) % n``. The buffer is
cut into ``n`` segments (:func:`~ringflow.algorithms.buffers.even_split`: as even as possible,
lower ranks larger; for :func:`reducescatter` the cut is along rows). Segment ``r`` is *owned* by
rank ``r``. A rank only ever sends to ``next`` and receives from ``prev``.

Reduce-scatter, steps ``s = 0 .. n-2``: send segment ``(r-s-1) % n``, receive segment
``(r-s-2) % n`` from ``prev`` into a temporary buffer and combine it into the local copy with
``ops.ufunc(op)(acc, received, out=acc)``. The segment received at step ``s`` is the one sent at
step ``s+1``, and the one received at step ``n-2`` is segment ``r``: after ``n-1`` steps rank
``r`` holds the full reduction of its own segment.

Allgather (allreduce only), steps ``s = 0 .. n-2``: send segment ``(r-s) % n``, receive segment
``(r-s-1) % n`` straight into place; the segment received at step ``s`` is sent at step ``s+1``.

Pipelining: every segment travels as chunks of at most ``CHUNK_BYTES``. A chunk is forwarded as
soon as it has been reduced (or, in the allgather, received), so a chunk moves on before the rest
of its segment has arrived; the receive of the next chunk is posted before the current one is
reduced, so sending, receiving and reducing overlap (numpy ufuncs and sockets release the GIL).
Two receive buffers of one chunk each, and at most one float scratch chunk, are allocated once
per call.

Scaling (AVERAGE, ``postscale``) happens exactly once per element, by the segment's owner, at the
end of the reduce-scatter; the allgather then only copies. Each element is thus computed by one
rank and every rank ends with **bitwise identical** results; a rerun with the same inputs gives
the same bits.

- AVERAGE is SUM followed by a multiplication by ``1/n`` (times ``postscale``).
- Integers: the scale is applied in float64 and the result truncated toward zero, like C's
  ``static_cast`` (``-7 / 2 -> -3``). An integer SUM with ``postscale == 1`` stays exact.
- bool: SUM is logical or, PRODUCT logical and, MIN/MAX as usual; AVERAGE or a ``postscale`` raise
  TensorError.
- float16 / bfloat16 SUM and AVERAGE: every contribution is first multiplied by
  ``p = 2**-ceil(log2 n)`` (exact, a power of two), so any partial sum of ``k <= n``
  contributions stays within the input range and never overflows mid-ring (4 ranks x 40000 in
  float16 would reach 80000 > 65504 otherwise). Each addition is done in float32 and rounded to
  16 bits for the wire; the owner's last addition stays in float32, is multiplied by
  ``postscale / p`` (and ``1/n`` for AVERAGE) and rounded to 16 bits once. Cost of ``p``: inputs
  below ``2**-14 * 2**ceil(log2 n)`` (float16) lose bits as subnormals.
- float16 / bfloat16 MIN, MAX, PRODUCT use the plain ufunc; a ``postscale`` is applied in float32.

Cost per rank, buffer of ``B`` bytes: allreduce sends ``2 (n-1)/n B`` bytes in
``2 sum_s chunks(segment)`` messages -- exactly ``2 (n-1)`` when every segment is one non-empty
chunk; reduce-scatter sends ``(n-1)/n B`` bytes in ``n-1`` messages in that case. Empty
segments send nothing. ``n == 1`` sends nothing and only scales; an empty buffer returns at once.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import TensorError
from ..ops import ReduceOp, check_dtype, is_float16ish, ufunc
from ..transport import Transport
from . import buffers
from .buffers import as_bytes, chunk_ranges, even_split

__all__ = ["allreduce", "reducescatter"]


class _Reduction:
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
        return np.empty(length, self.scratch_dtype)

    def prescale_inplace(self, flat: np.ndarray) -> None:
        if self.prescale != 1.0:
            np.multiply(flat, self.prescale, out=flat)

    def combine(self, acc: np.ndarray, got: np.ndarray, scratch: np.ndarray | None) -> None:
        """``acc = acc (op) got`` on a chunk that travels on."""
        if self.wide:
            tmp = scratch[: acc.size]
            np.add(acc, got, out=tmp, dtype=np.float32)
            np.copyto(acc, tmp, casting="unsafe")
        else:
            self.ufunc(acc, got, out=acc)

    def finish(self, acc: np.ndarray, got: np.ndarray | None, scratch: np.ndarray | None) -> None:
        """The owner's last combine (none if ``got`` is None), then the scale."""
        if self.wide and got is not None:
            # Keep the last sum in float32 so that it is rounded to 16 bits only once.
            tmp = scratch[: acc.size]
            np.add(acc, got, out=tmp, dtype=np.float32)
            if self.factor != 1.0:
                np.multiply(tmp, self.factor, out=tmp)
            np.copyto(acc, tmp, casting="unsafe")
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
            np.copyto(acc, tmp, casting="unsafe")
        else:
            np.multiply(acc, self.factor, out=acc)


def _scale_only(flat: np.ndarray, red: _Reduction) -> None:
    """One rank: nothing to combine, apply the scale chunk by chunk (bounded scratch)."""
    if red.factor == 1.0:
        return
    per = buffers.chunk_elems(flat.itemsize)
    scratch = red.scratch(min(per, flat.size))
    for lo, hi in chunk_ranges(0, flat.size, per):
        red.finish(flat[lo:hi], None, scratch)


def reduce_scatter_ring(
    t: Transport, flat: np.ndarray, bounds: list[tuple[int, int]], red: _Reduction
) -> None:
    """Reduce-scatter of ``flat`` in place: afterwards ``flat[bounds[t.rank]]`` is reduced.

    The other segments hold partial results. All sends have completed on return, so the caller
    may overwrite any part of ``flat``.
    """
    n, r = t.size, t.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    per = buffers.chunk_elems(flat.itemsize)
    chunks = [chunk_ranges(lo, hi, per) for lo, hi in bounds]
    # (owner's last step?, lo, hi) for every chunk this rank receives, in arrival order.
    plan = [
        (s == n - 2, lo, hi) for s in range(n - 1) for lo, hi in chunks[(r - s - 2) % n]
    ]
    longest = max((hi - lo for _, lo, hi in plan), default=0)
    recv_bufs = np.empty((2, longest), flat.dtype)
    scratch = red.scratch(longest)

    sends = [t.isend(as_bytes(flat[lo:hi]), nxt) for lo, hi in chunks[(r - 1) % n]]
    pending = t.irecv(as_bytes(recv_bufs[0, : plan[0][2] - plan[0][1]]), prv) if plan else None
    for i, (last, lo, hi) in enumerate(plan):
        pending.wait()
        if i + 1 < len(plan):
            _, lo2, hi2 = plan[i + 1]
            pending = t.irecv(as_bytes(recv_bufs[(i + 1) % 2, : hi2 - lo2]), prv)
        acc, got = flat[lo:hi], recv_bufs[i % 2, : hi - lo]
        if last:
            red.finish(acc, got, scratch)
        else:
            red.combine(acc, got, scratch)
            sends.append(t.isend(as_bytes(acc), nxt))
    for work in sends:
        work.wait()


def allgather_ring(t: Transport, flat: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Ring allgather in place: on entry ``flat[bounds[t.rank]]`` is this rank's block; on return
    every block is filled. All sends have completed on return."""
    n, r = t.size, t.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    per = buffers.chunk_elems(flat.itemsize)
    chunks = [chunk_ranges(lo, hi, per) for lo, hi in bounds]
    plan = [(s < n - 2, lo, hi) for s in range(n - 1) for lo, hi in chunks[(r - s - 1) % n]]
    sends = [t.isend(as_bytes(flat[lo:hi]), nxt) for lo, hi in chunks[r]]
    # Every chunk lands in its final place, so all receives can be posted at once: the transport
    # never waits for this thread to post the next one.
    recvs = [t.irecv(as_bytes(flat[lo:hi]), prv) for _, lo, hi in plan]
    for work, (forward, lo, hi) in zip(recvs, plan, strict=True):
        work.wait()
        if forward:
            sends.append(t.isend(as_bytes(flat[lo:hi]), nxt))
    for work in sends:
        work.wait()


def _inplace_flat(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TensorError(f"{what} needs a numpy array, got {type(buf).__name__}")
    if not (buf.flags.c_contiguous and buf.flags.writeable):
        raise TensorError(
            f"{what} works in place and needs a writable C-contiguous array, got shape "
            f"{buf.shape} (contiguous={buf.flags.c_contiguous}, writeable={buf.flags.writeable}); "
            f"pass np.ascontiguousarray(tensor) and copy the result back"
        )
    return buf.reshape(-1)


def allreduce(t: Transport, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0) -> None:
    """Reduce ``buf`` over all ranks in place (ring; see the module docstring).

    ``buf`` is a writable C-contiguous array (any shape; treated as 1-D) of the same dtype and
    size on every rank. Raises TensorError for an unsupported dtype/op (before any message), or
    PeerError, RingflowTimeoutError or ProtocolError from the transport, after which the contents
    of ``buf`` are unspecified.
    """
    flat = _inplace_flat(buf, "allreduce buffer")
    red = _Reduction(flat.dtype, op, postscale, t.size, "allreduce buffer")
    if flat.size == 0:
        return
    if t.size == 1:
        _scale_only(flat, red)
        return
    bounds = even_split(flat.size, t.size)
    red.prescale_inplace(flat)
    reduce_scatter_ring(t, flat, bounds, red)
    allgather_ring(t, flat, bounds)


def reducescatter(
    t: Transport, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0
) -> np.ndarray:
    """Reduce ``buf`` over all ranks and return this rank's rows of the result.

    ``buf`` (not modified) has the same dtype and shape on every rank, at least one dimension.
    Rows (the first dimension) are split as evenly as possible, lower ranks taking the remainder:
    5 rows over 3 ranks -> 2, 2, 1. Same reduction, scaling and determinism rules as
    :func:`allreduce`.
    """
    if not isinstance(buf, np.ndarray) or buf.ndim == 0:
        raise TensorError(
            f"reducescatter splits its tensor along the first dimension and needs an array with "
            f"at least one dimension, got {getattr(buf, 'shape', type(buf).__name__)}"
        )
    red = _Reduction(buf.dtype, op, postscale, t.size, "reducescatter tensor")
    n, r = t.size, t.rank
    rest = buf.shape[1:]
    row = math.prod(rest)
    rows = even_split(buf.shape[0], n)
    flat = np.array(buf, copy=True, order="C").reshape(-1)  # the caller's buffer stays intact
    if n == 1:
        _scale_only(flat, red)
        return flat.reshape(buf.shape)
    bounds = [(lo * row, hi * row) for lo, hi in rows]
    if flat.size:
        red.prescale_inplace(flat)
        reduce_scatter_ring(t, flat, bounds, red)
    lo, hi = bounds[r]
    # Copy so that the other ranks' (partial) rows can be freed.
    return flat[lo:hi].reshape((rows[r][1] - rows[r][0], *rest)).copy()
