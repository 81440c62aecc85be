"""DistributedSampler without a torch.distributed process group, and without padding on request.

torch's ``DistributedSampler`` only needs ``torch.distributed`` to find the world size and rank
when they are not given; this subclass fills them in from ringflow (``size()`` / ``rank()``, or a
process set's), so it is still an instance of ``torch.utils.data.DistributedSampler`` and keeps
its exact sharding: every rank gets ``ceil(len / size)`` indices (padded by repeating, or
``floor`` with ``drop_last``), reshuffled per epoch by ``set_epoch(epoch)`` with ``seed + epoch``.

``pad=False`` (a ringflow extension) is the sharding for evaluation: rank ``r`` takes positions
``r, r + size, r + 2 size, ...`` of the (shuffled) index list, so every sample goes to exactly one
rank and none is repeated; ranks then hold ``len // size`` or one more. The padding of the
default repeats up to ``size - 1`` samples, which a global accuracy counts twice (the trap of
distributed evaluation); ``drop_last=True`` instead leaves up to ``size - 1`` samples out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from .. import ProcessSet, global_process_set, rank, size

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchDistributedSampler):
    """``torch.utils.data.DistributedSampler`` whose defaults come from ringflow.

    ``num_replicas`` defaults to the size of ``process_set`` and ``rank`` to this process's rank
    in it (the global ones by default). ``pad=False``: every sample on exactly one rank, no
    repeats (lengths may differ by one between ranks); see the module doc.

    Raises:
        ValueError: ``pad=False`` with ``drop_last=True`` (one keeps every sample, the other
            drops some: choose one); torch's for a bad rank.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, process_set: ProcessSet = global_process_set,
                 pad: bool = True) -> None:
        if not pad and drop_last:
            raise ValueError("DistributedSampler(pad=False, drop_last=True): pad=False keeps "
                             "every sample once, drop_last=True drops the tail; pass one of them")
        if num_replicas is None:
            num_replicas = size() if process_set is global_process_set else process_set.size()
        if rank is None:
            rank = _rank() if process_set is global_process_set else process_set.rank()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.pad = pad
        if not pad:
            n = len(self.dataset)  # type: ignore[arg-type]
            self.num_samples = len(range(self.rank, n, self.num_replicas))
            self.total_size = n

    def __iter__(self) -> Iterator[Any]:
        if self.pad:
            return super().__iter__()
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:  # torch's order for this epoch (seed + epoch), without the padding
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        return iter(indices[self.rank::self.num_replicas])


_rank = rank
