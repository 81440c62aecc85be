"""Hierarchical allreduce: shared memory within each host, rings across hosts.

For ``H`` hosts with ``L`` ranks each, numbered host by host. Steps, on every rank:

1. reduce share ``r`` (this rank's local rank) of the ``L`` local inputs in shared memory
   (:class:`~.shm.ShmAllreduce`, unscaled: AVERAGE is summed here);
2. allreduce that share with share ``r`` of every other host over ``cross``, a ring of the ``H``
   ranks with local rank ``r`` (:func:`~.ring.allreduce`), which applies the scale once
   (``postscale``, and ``1 / (H L)`` for AVERAGE); the ``L`` rings run at once, one per share;
3. copy the other local ranks' finished shares out of shared memory.

Cost: each host sends ``2 (H-1)/H * B`` bytes across its link in total -- the host-level ring
bound -- where a flat ring of all ``H L`` ranks sends ``2 (HL-1)/(HL) * B`` per rank
(``tests/multihost/test_hierarchical_bytes.py`` counts the bytes on each link). Results are
bitwise identical on every rank: each element is reduced in shared memory by one rank and across
hosts by one ring.
"""

from __future__ import annotations

import numpy as np

from ..ops import ReduceOp
from ..transport.base import Link
from .ring import allreduce as ring_allreduce
from .shm import ShmAllreduce

__all__ = ["HierarchicalAllreduce"]


class HierarchicalAllreduce:
    """``shm`` among this host's ranks, ``cross`` between the same local rank of every host."""

    def __init__(self, shm: ShmAllreduce, cross: Link) -> None:
        self.shm = shm
        self.cross = cross

    def allreduce(self, src: np.ndarray, out: np.ndarray, op: ReduceOp,
                  postscale: float = 1.0) -> None:
        local = ReduceOp.SUM if op == ReduceOp.AVERAGE else ReduceOp(op)
        total = self.shm.size * self.cross.size
        factor = postscale / total if op == ReduceOp.AVERAGE else postscale
        self.shm.allreduce(src, out, local, 1.0,
                           across=lambda share: ring_allreduce(self.cross, share, local, factor))
