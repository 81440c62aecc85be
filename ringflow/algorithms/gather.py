"""Collectives that move data without reducing it: allgather(v), broadcast, gather(v) and
scatter(v) to and from a root, alltoall(v), barrier.

Notation: ``n`` ranks, this rank ``r``. Arrays are split and concatenated along their first
dimension ("rows"); the other dimensions and the dtype are the same on every rank (the caller, in
practice the negotiation, guarantees it). Messages are cut with
:mod:`~ringflow.algorithms.buffers`; no empty message is ever sent.

allgather (ring): rank ``r`` holds block ``r`` (``counts[r]`` rows) of the output. Steps
``s = 0 .. n-2``: send block ``(r-s) % n`` to ``r+1``, receive block ``(r-s-1) % n`` from ``r-1``
straight into place; what arrives at step ``s`` is forwarded at step ``s+1``, chunk by chunk.
Cost per rank: sends ``B_total - B_(r+1)`` bytes (all blocks but the next rank's), in ``n-1``
messages when every block is one non-empty chunk.

broadcast (pipelined chain): ``root -> root+1 -> ... -> root-1``, in chunks of ``CHUNK_BYTES``;
each rank forwards a chunk as soon as it has arrived. Cost: every rank but the last in the chain
sends ``B`` bytes in ``ceil(B / CHUNK_BYTES)`` messages; time ~ ``(n - 2 + chunks)`` chunk
transfers.

gather (to a root): every other rank sends its ``counts[q]`` rows to ``root`` in chunks; the root
posts every receive at once, straight into place in the concatenation. Cost: each non-root sends
its own rows; the root receives ``B_total - B_root`` bytes. scatter (from a root) is its mirror:
the root sends block ``q`` (``counts[q]`` rows) to rank ``q``; each receives its block in place.

alltoall (pairwise): first every rank tells every other how many rows it will send it (one 8-byte
message per pair, all posted at once), then steps ``k = 1 .. n-1``: send ``splits[(r+k) % n]``
rows to ``(r+k) % n`` and receive from ``(r-k) % n`` into place. Pairs with nothing to send skip
the data message. Cost per rank: ``n-1`` count messages plus at most ``n-1`` data messages of
``splits[d]`` rows each.

barrier (dissemination): rounds ``k = 1, 2, 4, ... < n``: send one byte to ``(r+k) % n`` and
receive one from ``(r-k) % n``. After round ``k`` every rank has (transitively) heard from the
``2k`` ranks before it, so none returns before all have entered. Cost: ``ceil(log2 n)`` one-byte
messages per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import TensorError
from ..ops import check_dtype
from ..transport.base import Link
from . import buffers
from .buffers import as_bytes, chunk_ranges
from .ring import allgather_ring

__all__ = ["allgather", "alltoall", "barrier", "broadcast", "exchange_counts", "gather", "scatter"]


def _rows_array(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or buf.ndim == 0:
        raise TensorError(
            f"{what} is split along its first dimension and needs an array with at least one "
            f"dimension, got {getattr(buf, 'shape', type(buf).__name__)}"
        )
    check_dtype(buf.dtype, what)
    return np.ascontiguousarray(buf)


def _counts(values: Sequence[int], n: int, what: str) -> list[int]:
    counts = [int(c) for c in values]
    if len(counts) != n or any(c < 0 for c in counts):
        raise TensorError(
            f"{what} must be {n} non-negative row counts (one per rank), got {counts}"
        )
    return counts


def allgather(t: Link, buf: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Concatenate every rank's ``buf`` along the first dimension, in rank order.

    ``counts[q]`` is the first-dimension length of rank ``q``'s array; ``counts[t.rank]`` must be
    ``buf.shape[0]`` (TensorError otherwise).
    """
    n, r = t.size, t.rank
    buf = _rows_array(buf, "allgather tensor")
    counts = _counts(counts, n, "allgather counts")
    if counts[r] != buf.shape[0]:
        raise TensorError(
            f"allgather on rank {r}: counts[{r}] = {counts[r]} but the tensor has "
            f"{buf.shape[0]} rows (shape {buf.shape}); pass each rank's first-dimension length"
        )
    rest = buf.shape[1:]
    row = math.prod(rest)
    out = np.empty((sum(counts), *rest), buf.dtype)
    bounds = []
    start = 0
    for c in counts:
        bounds.append((start * row, (start + c) * row))
        start += c
    flat = out.reshape(-1)
    lo, hi = bounds[r]
    flat[lo:hi] = buf.reshape(-1)
    if n > 1 and flat.size:
        allgather_ring(t, flat, bounds)
    return out


def broadcast(t: Link, buf: np.ndarray, root: int) -> None:
    """Copy ``root``'s ``buf`` into ``buf`` on every rank, in place (pipelined chain)."""
    n, r = t.size, t.rank
    if not 0 <= root < n:
        raise TensorError(f"broadcast root rank {root} is outside 0..{n - 1}; pass a valid rank")
    if not isinstance(buf, np.ndarray) or not (buf.flags.c_contiguous and buf.flags.writeable):
        raise TensorError(
            f"broadcast works in place and needs a writable C-contiguous numpy array, got "
            f"{getattr(buf, 'shape', type(buf).__name__)}; pass np.ascontiguousarray(tensor)"
        )
    check_dtype(buf.dtype, "broadcast tensor")
    flat = buf.reshape(-1)
    if n == 1 or flat.size == 0:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    pos = (r - root) % n  # place in the chain
    chunks = chunk_ranges(0, flat.size, buffers.chunk_elems(flat.itemsize))
    if pos == 0:
        sends = [t.isend(as_bytes(flat[lo:hi]), nxt) for lo, hi in chunks]
    else:
        sends = []
        # Chunks land in place, so all receives are posted at once.
        recvs = [t.irecv(as_bytes(flat[lo:hi]), prv) for lo, hi in chunks]
        for work, (lo, hi) in zip(recvs, chunks, strict=True):
            work.wait()
            if pos < n - 1:
                sends.append(t.isend(as_bytes(flat[lo:hi]), nxt))
    for work in sends:
        work.wait()


def _blocks(counts: Sequence[int], row: int) -> list[tuple[int, int]]:
    """Element bounds of each rank's block of rows in a concatenation."""
    at = np.concatenate(([0], np.cumsum(counts))) * row
    return [(int(at[q]), int(at[q + 1])) for q in range(len(counts))]


def _chunked(t: Link, flat: np.ndarray, peer: int, send: bool) -> list:
    """Post ``flat`` to or from ``peer`` as pipeline chunks (nothing for an empty block)."""
    post = t.isend if send else t.irecv
    per = buffers.chunk_elems(flat.itemsize)
    return [post(as_bytes(flat[lo:hi]), peer) for lo, hi in chunk_ranges(0, flat.size, per)]


def gather(t: Link, buf: np.ndarray, counts: Sequence[int], root: int) -> np.ndarray | None:
    """Concatenate every rank's ``buf`` along the first dimension on ``root``, in rank order.

    ``counts[q]`` is rank ``q``'s first-dimension length (TensorError if this rank's differs).
    Returns the concatenation on ``root``, None elsewhere.
    """
    n, r = t.size, t.rank
    buf = _rows_array(buf, "gather tensor")
    counts = _counts(counts, n, "gather counts")
    if counts[r] != buf.shape[0]:
        raise TensorError(f"gather on rank {r}: counts[{r}] = {counts[r]} but the tensor has "
                          f"{buf.shape[0]} rows (shape {buf.shape})")
    row = math.prod(buf.shape[1:])
    if r != root:
        for work in _chunked(t, buf.reshape(-1), root, send=True):
            work.wait()
        return None
    out = np.empty((sum(counts), *buf.shape[1:]), buf.dtype)
    flat = out.reshape(-1)
    blocks = _blocks(counts, row)
    works = [w for q, (lo, hi) in enumerate(blocks) if q != r
             for w in _chunked(t, flat[lo:hi], q, send=False)]
    lo, hi = blocks[r]
    flat[lo:hi] = buf.reshape(-1)
    for work in works:
        work.wait()
    return out


def scatter(t: Link, buf: np.ndarray | None, counts: Sequence[int], root: int,
            rest: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Rank ``q`` receives rows ``counts[:q].sum() ..`` of ``root``'s ``buf`` (``counts[q]`` rows
    of shape ``rest`` and dtype ``dtype``); ``buf`` is only read on ``root``. Returns this rank's
    block (a copy on ``root``)."""
    n, r = t.size, t.rank
    counts = _counts(counts, n, "scatter counts")
    row = math.prod(rest)
    out = np.empty((counts[r], *rest), dtype)
    if r != root:
        for work in _chunked(t, out.reshape(-1), root, send=False):
            work.wait()
        return out
    flat = _rows_array(buf, "scatter tensor").reshape(-1)
    blocks = _blocks(counts, row)
    works = [w for q, (lo, hi) in enumerate(blocks) if q != r
             for w in _chunked(t, flat[lo:hi], q, send=True)]
    lo, hi = blocks[r]
    out.reshape(-1)[:] = flat[lo:hi]
    for work in works:
        work.wait()
    return out


def exchange_counts(t: Link, splits: Sequence[int]) -> list[int]:
    """``splits[d]`` to rank ``d``; the list of what every rank sent this one (alltoall's row
    counts, also for the device's alltoall). One 8-byte message per ordered pair, all in flight
    at once."""
    n, r = t.size, t.rank
    send_counts = np.asarray(splits, dtype=np.int64)
    recv_counts = np.zeros(n, dtype=np.int64)
    recv_counts[r] = splits[r]
    peers = [((r + k) % n, (r - k) % n) for k in range(1, n)]
    recvs = [t.irecv(as_bytes(recv_counts[src : src + 1]), src) for _, src in peers]
    sends = [t.isend(as_bytes(send_counts[dst : dst + 1]), dst) for dst, _ in peers]
    for work in (*recvs, *sends):
        work.wait()
    received = [int(c) for c in recv_counts]
    if any(c < 0 for c in received):
        raise TensorError(
            f"alltoall on rank {r}: peers announced negative row counts {received}; "
            f"every rank must pass non-negative splits"
        )
    return received


def alltoall(
    t: Link, buf: np.ndarray, splits: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """Send ``splits[d]`` consecutive rows of ``buf`` to rank ``d``; return what arrived.

    Returns the received rows concatenated in source-rank order and the received splits
    (``received[q]`` rows came from rank ``q``). TensorError if ``sum(splits) != buf.shape[0]``.
    """
    n, r = t.size, t.rank
    buf = _rows_array(buf, "alltoall tensor")
    splits = _counts(splits, n, "alltoall splits")
    if sum(splits) != buf.shape[0]:
        raise TensorError(
            f"alltoall on rank {r}: splits {splits} add up to {sum(splits)} rows but the tensor "
            f"has {buf.shape[0]} (shape {buf.shape}); the splits must cover the first dimension"
        )
    rest = buf.shape[1:]
    row = math.prod(rest)
    received = exchange_counts(t, splits)
    # Data, pairwise: step k sends to r+k and receives from r-k, straight into place.
    peers = [((r + k) % n, (r - k) % n) for k in range(1, n)]
    out = np.empty((sum(received), *rest), buf.dtype)
    src_flat, out_flat = buf.reshape(-1), out.reshape(-1)
    send_at = np.concatenate(([0], np.cumsum(splits))) * row
    recv_at = np.concatenate(([0], np.cumsum(received))) * row
    out_flat[recv_at[r] : recv_at[r + 1]] = src_flat[send_at[r] : send_at[r + 1]]
    for dst, src in peers:
        step = []
        if received[src]:
            step.append(t.irecv(as_bytes(out_flat[recv_at[src] : recv_at[src + 1]]), src))
        if splits[dst]:
            step.append(t.isend(as_bytes(src_flat[send_at[dst] : send_at[dst + 1]]), dst))
        for work in step:
            work.wait()
    return out, received


def barrier(t: Link) -> None:
    """Return on each rank only after every rank has entered (dissemination barrier)."""
    n, r = t.size, t.rank
    token = np.zeros(1, dtype=np.uint8)
    got = np.zeros(1, dtype=np.uint8)
    k = 1
    while k < n:
        recv = t.irecv(as_bytes(got), (r - k) % n)
        send = t.isend(as_bytes(token), (r + k) % n)
        recv.wait()
        send.wait()
        k *= 2
