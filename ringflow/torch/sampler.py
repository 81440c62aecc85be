"""DistributedSampler without a torch.distributed process group.

torch's ``DistributedSampler`` only needs ``torch.distributed`` to find the world size and rank
when they are not given; this subclass fills them in from ringflow (``size()`` / ``rank()``, or a
process set's), so it is still an instance of ``torch.utils.data.DistributedSampler`` and keeps
its exact sharding: every rank gets ``ceil(len / size)`` indices (padded by repeating, or
``floor`` with ``drop_last``), reshuffled per epoch by ``set_epoch(epoch)`` with ``seed + epoch``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from .. import ProcessSet, global_process_set, rank, size

__all__ = ["DistributedSampler"]


class DistributedSampler(_TorchDistributedSampler):
    """``torch.utils.data.DistributedSampler`` whose defaults come from ringflow.

    ``num_replicas`` defaults to the size of ``process_set`` and ``rank`` to this process's rank
    in it (the global ones by default).
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, process_set: ProcessSet = global_process_set) -> None:
        if num_replicas is None:
            num_replicas = size() if process_set is global_process_set else process_set.size()
        if rank is None:
            rank = _rank() if process_set is global_process_set else process_set.rank()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)


_rank = rank
