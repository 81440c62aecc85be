"""Ring allreduce and ring reduce-scatter over any :class:`~ringflow.transport.Link`.

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

from .. import injection
from ..errors import TensorError
from ..ops import ReduceOp
from ..transport.base import Link
from . import buffers
from .buffers import as_bytes, chunk_ranges, even_split
from .reduction import Reduction, inplace_flat, scale_only

__all__ = ["allreduce", "reducescatter"]


def reduce_scatter_ring(
    t: Link, flat: np.ndarray, bounds: list[tuple[int, int]], red: Reduction,
    src: np.ndarray | None = None,
) -> None:
    """Reduce-scatter of ``flat`` in place: afterwards ``flat[bounds[t.rank]]`` is reduced.

    The other segments hold partial results. All sends have completed on return, so the caller
    may overwrite any part of ``flat``. With ``src`` (the input, apart from ``flat``, needing no
    prescale) ``flat`` starts empty: the first segment is sent from ``src`` and each received
    chunk's own part is copied from ``src`` just before it is combined (while it is in cache,
    and while the link carries the rest); segment ``r - 1`` of ``flat`` is left unwritten.
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

    first = flat if src is None else src
    sends = [t.isend(as_bytes(first[lo:hi]), nxt) for lo, hi in chunks[(r - 1) % n]]
    pending = t.irecv(as_bytes(recv_bufs[0, : plan[0][2] - plan[0][1]]), prv) if plan else None
    for i, (last, lo, hi) in enumerate(plan):
        pending.wait()
        if i + 1 < len(plan):
            _, lo2, hi2 = plan[i + 1]
            pending = t.irecv(as_bytes(recv_bufs[(i + 1) % 2, : hi2 - lo2]), prv)
        acc, got = flat[lo:hi], recv_bufs[i % 2, : hi - lo]
        if src is not None:
            np.copyto(acc, src[lo:hi])
        if last:
            red.finish(acc, got, scratch)
        else:
            red.combine(acc, got, scratch)
            sends.append(t.isend(as_bytes(acc), nxt))
    for work in sends:
        work.wait()


def allgather_ring(t: Link, flat: np.ndarray, bounds: list[tuple[int, int]]) -> None:
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


def allreduce(t: Link, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0,
              src: np.ndarray | None = None) -> None:
    """Reduce ``buf`` over all ranks in place (ring; see the module docstring), or, with ``src``,
    reduce ``src`` (not modified; same dtype and size) into ``buf``.

    ``buf`` is a writable C-contiguous array (any shape; treated as 1-D) of the same dtype and
    size on every rank. An out-of-place call costs no separate copy pass: the copy of ``src`` is
    folded into the reduce-scatter, chunk by chunk (the same bits as copying first). Raises
    TensorError for an unsupported dtype/op (before any message), or PeerError,
    RingflowTimeoutError or ProtocolError from the transport, after which the contents of ``buf``
    are unspecified.
    """
    flat = inplace_flat(buf, "allreduce buffer")
    red = Reduction(flat.dtype, op, postscale, t.size, "allreduce buffer")
    if flat.size == 0:
        return
    if src is not None:
        src = src.reshape(-1)
        if t.size == 1 or red.prescale != 1.0 or np.may_share_memory(src, flat):
            np.copyto(flat, src)
            src = None
    if t.size == 1:
        scale_only(flat, red)
        return
    bounds = even_split(flat.size, t.size)
    red.prescale_inplace(flat)
    reduce_scatter_ring(t, flat, bounds, red, src)
    if injection.ARMED:
        injection.hit("data_mid", flat.nbytes)
    allgather_ring(t, flat, bounds)


def reducescatter(
    t: Link, buf: np.ndarray, op: ReduceOp, postscale: float = 1.0
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
    red = Reduction(buf.dtype, op, postscale, t.size, "reducescatter tensor")
    n, r = t.size, t.rank
    rest = buf.shape[1:]
    row = math.prod(rest)
    rows = even_split(buf.shape[0], n)
    flat = np.array(buf, copy=True, order="C").reshape(-1)  # the caller's buffer stays intact
    if n == 1:
        scale_only(flat, red)
        return flat.reshape(buf.shape)
    bounds = [(lo * row, hi * row) for lo, hi in rows]
    if flat.size:
        red.prescale_inplace(flat)
        reduce_scatter_ring(t, flat, bounds, red)
    lo, hi = bounds[r]
    # Copy so that the other ranks' (partial) rows can be freed.
    return flat[lo:hi].reshape((rows[r][1] - rows[r][0], *rest)).copy()
