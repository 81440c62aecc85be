"""How the collectives cut numpy arrays into the byte messages a Transport moves.

- :func:`even_split` divides ``length`` items among ``parts`` ranks as evenly as possible, the
  remainder going to the lowest ranks (5 over 3 -> 2, 2, 1). Every algorithm uses it, so a rank can
  compute any other rank's share without asking.
- :func:`chunk_ranges` cuts a range of elements into pipeline chunks of at most :data:`CHUNK_BYTES`
  (or, on a thread inside :func:`chunk_size`, the size a plan item carries: ``RINGFLOW_CHUNK_BYTES``
  or the autotuner's, the same on every rank for that item). Sender and receiver cut the same range
  the same way, so they agree on the size of every message without sending it. Empty ranges have no
  chunks: no algorithm ever sends an empty message.
- :func:`as_bytes` is the zero-copy ``memoryview`` of a contiguous array (bfloat16 and bool have
  no buffer-protocol format, so every array goes through a ``uint8`` view).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from ..errors import TensorError

__all__ = ["CHUNK_BYTES", "as_bytes", "chunk_elems", "chunk_ranges", "chunk_size", "even_split"]

#: Largest message of a pipelined collective. 1 MiB is large enough that per-message overhead
#: (a Python call, a syscall, a header) is small against copying it, and small enough that the
#: ring's reduce of one chunk overlaps the transfer of the next. A multiple of every itemsize;
#: tests lower it to exercise multi-chunk pipelines. Measured by benchmarks/tcp_tuning.py (engine
#: path, loopback, 2 shared cores, medians of 5 runs; benchmarks/RESULTS.md): 64 MiB over TCP on
#: 4 ranks took 350 / 227 / 214 / 170 / 174 / 258 ms with 256 KiB / 512 KiB / 1 / 2 / 4 / 8 MiB
#: chunks (1 MiB: all 13 runs of the defaults in that round), but a second round gave 1 / 2 /
#: 4 MiB 207 / 188 / 168 ms at 64 MiB and 813 / 890 / 711 ms at 256 MiB, inside each other's
#: run-to-run spread; on the shared-memory path (whose reduce loop uses the same block) 1 MiB was
#: as fast as or faster than 2 and 4 MiB (4 ranks, 256 MiB: 278 / 304 / 284 ms). Smaller is
#: clearly slower, larger no clear win: 1 MiB stays.
CHUNK_BYTES = 1 << 20


class _Chunk(threading.local):
    nbytes = 0  # 0: CHUNK_BYTES


_chunk = _Chunk()


def chunk_elems(itemsize: int) -> int:
    """Elements per pipeline chunk for items of ``itemsize`` bytes (read at call time)."""
    return max(1, (_chunk.nbytes or CHUNK_BYTES) // itemsize)


@contextlib.contextmanager
def chunk_size(nbytes: int) -> Iterator[None]:
    """Pipeline chunks of ``nbytes`` (0: :data:`CHUNK_BYTES`) on this thread inside the block.
    Per thread, since every engine of a process (tests run several) has its own engine thread;
    sender and receiver must use the same size, so it comes with the plan item."""
    before, _chunk.nbytes = _chunk.nbytes, nbytes
    try:
        yield
    finally:
        _chunk.nbytes = before


def even_split(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` half-open ranges covering ``range(length)``; lower parts take the remainder."""
    q, rem = divmod(length, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + q + (i < rem)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_ranges(start: int, stop: int, per_chunk: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into consecutive ranges of at most ``per_chunk`` elements."""
    return [(lo, min(lo + per_chunk, stop)) for lo in range(start, stop, per_chunk)]


def as_bytes(arr: np.ndarray) -> memoryview:
    """A writable-if-``arr``-is, zero-copy byte view of the C-contiguous array ``arr``."""
    if not arr.flags.c_contiguous:
        raise TensorError(
            f"internal: a transport buffer of shape {arr.shape} is not C-contiguous; "
            f"pass np.ascontiguousarray(tensor)"
        )
    return memoryview(arr.reshape(-1).view(np.uint8))
