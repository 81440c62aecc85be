"""What ranks submit and what plans carry: :class:`Request`, :class:`Response`,
:class:`CachedAllreduce` (the negotiation protocol of :mod:`ringflow.negotiation`, carried by
the messages of :mod:`ringflow.messages`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .collectives import Kind
from .compression import Compression
from .ops import DTYPES

__all__ = ["CachedAllreduce", "Key", "Request", "Response", "on_the_wire", "wire_dtype"]

Key = tuple[int, str]  # (process set id, tensor name)


@functools.cache
def wire_dtype(compression: str, dtype: str) -> np.dtype:
    """The dtype a tensor of ``dtype`` travels in under ``compression``."""
    return Compression.by_name(compression).wire_dtype(DTYPES[dtype])


@dataclasses.dataclass(frozen=True)
class Request:
    """One rank's submission of one tensor: everything the ranks must agree on.

    ``kind`` is a key of :data:`ringflow.collectives.COLLECTIVES`; ``root`` a global rank;
    ``error`` a local validation failure, which fails the operation on every rank."""

    name: str
    kind: Kind | str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    reduce_op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    compression: str = "none"
    device: str = "cpu"
    process_set: int = 0
    group: str = ""
    group_size: int = 0
    splits: tuple[int, ...] = ()
    error: str = ""
    #: Where the user called (``file:line``, :func:`ringflow.submission.call_site`), for stall
    #: reports; "" where unknown. Not compared: the same request from another line is cached.
    site: str = dataclasses.field(default="", compare=False)

    @property
    def key(self) -> Key:
        return (self.process_set, self.name)

    @property
    def nbytes(self) -> int:
        if not self.dtype:
            return 0
        # math.prod, not np.prod: this runs per tensor per cycle (np.prod costs ~5 us).
        return math.prod(self.shape) * self.wire_dtype.itemsize

    @property
    def wire_dtype(self) -> np.dtype:
        return wire_dtype(self.compression, self.dtype)


@dataclasses.dataclass(frozen=True)
class Response:
    """One plan item: an operation on one or more (fused) tensors, or an error for one name."""

    kind: Kind | str
    process_set: int
    requests: tuple[Request, ...]  # one reference request per tensor, in fusion order
    first_dims: tuple[tuple[int, ...], ...] = ()  # allgather: [tensor][member] first dimension
    joined: tuple[int, ...] = ()  # global ranks that contribute zeros
    error: str = ""
    error_type: str = ""  # a class name from ringflow.errors
    value: int = -1  # join: the last rank to join; add_process_set: the new id
    #: The coordinator's wire compression for this item (``RINGFLOW_WIRE_COMPRESSION`` or the
    #: autotuner's), in place of the requests' own ``none``: see :func:`on_the_wire`.
    wire: str = ""
    #: Pipeline chunk bytes of this item's algorithm (0: the built-in), the same on every rank.
    chunk: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.requests)


@dataclasses.dataclass(frozen=True)
class CachedAllreduce:
    """A plan item of fused allreduces that every rank has cached: only their bits travel, and,
    for small tensors the coordinator reduced itself, the fused result (wire dtype)."""

    bits: tuple[int, ...]
    result: np.ndarray | None = dataclasses.field(default=None, compare=False)
    wire: str = ""  # as Response.wire
    chunk: int = 0  # as Response.chunk


@functools.lru_cache(maxsize=4096)
def _rewired(req: Request, wire: str) -> Request:
    return dataclasses.replace(req, compression=wire)


def on_the_wire(item: Response) -> Response:
    """``item`` as the executor runs it: with ``item.wire`` set, its requests travel in that
    16-bit format (the coordinator sets it only on float32 Sum/Average allreduces of host arrays
    whose calls asked for no compression, larger than ``EAGER_BYTES``)."""
    if not item.wire:
        return item
    return dataclasses.replace(item, requests=tuple(_rewired(r, item.wire)
                                                    for r in item.requests))
