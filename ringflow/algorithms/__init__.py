"""Collectives written once over any :class:`~ringflow.transport.Link`, on numpy arrays.

- :mod:`.ring`: :func:`allreduce` (ring reduce-scatter + allgather, pipelined, bitwise identical
  on every rank) and :func:`reducescatter`.
- :mod:`.gather`: :func:`allgather` (ring, uneven first dimensions), :func:`broadcast` (pipelined
  chain), :func:`gather` / :func:`scatter` (to / from a root, uneven first dimensions),
  :func:`alltoall` (pairwise, uneven splits) and :func:`barrier` (dissemination).
- :mod:`.adasum`: :func:`adasum` (Adasum, vector halving / distance doubling, per tensor).
- :mod:`.device`: the same collectives on GPU arrays, composed of NCCL's primitives
  (:mod:`.nccl`: cupy's binding; :mod:`.nccl_torch`: torch's ProcessGroupNCCL).
- :mod:`.buffers`: how arrays are cut into messages; :data:`~.buffers.CHUNK_BYTES` is the pipeline
  chunk size (patch ``ringflow.algorithms.buffers.CHUNK_BYTES`` to change it).

Each module's docstring is its specification: steps, invariants and cost per rank.
"""

from __future__ import annotations

from .adasum import adasum
from .buffers import CHUNK_BYTES, even_split
from .gather import allgather, alltoall, barrier, broadcast, exchange_counts, gather, scatter
from .ring import allreduce, reducescatter

__all__ = [
    "CHUNK_BYTES",
    "adasum",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "even_split",
    "exchange_counts",
    "gather",
    "reducescatter",
    "scatter",
]
