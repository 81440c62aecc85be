"""DataLoaders under ``ringflow.torch.auto``: each global batch split among the ranks.

A DataLoader's ``batch_size`` stays the *global* batch, as in Jittor: one process would draw
batch ``k`` of ``B`` indices; rank ``r`` of ``n`` takes positions ``[r q + min(r, s), ...)`` of
it, ``q`` or ``q + 1`` of them (``q, s = divmod(B, n)``), so the ranks together see exactly the
batches one process sees, each sample once, nothing repeated or dropped.

Each epoch (each ``iter(loader)``), every rank iterates the loader's own batch sampler to the end,
so its random number generator advances as one process's would; then rank 0's list of batches
is broadcast (one ``broadcast_object`` of the pickled lists: about 5 bytes per index, and any
index a dataset takes, not only integers) and every rank takes its share of rank 0's batches.
A ``SequentialSampler`` needs no broadcast. The batch sampler must be finite.

Left alone: a DataLoader of an ``IterableDataset`` or with ``batch_size=None`` (warned once:
shard those yourself), and one whose sampler is a ``DistributedSampler`` (sharded already).

Exactness: the gradient of a mean loss averaged over ranks is the global batch's when every
batch divides evenly among the ranks; otherwise smaller shares weigh more, and a warning says so
once per loader when such a batch is drawn with gradients enabled (a training loop; evaluation
under ``torch.no_grad()`` is exact whatever the split). A batch of fewer samples than ranks (the
last one) leaves ranks ``L..n-1`` without it: they run one batch fewer, which an evaluation loop
does not mind; in a training loop the optimizers' check (:mod:`.optim`) then fails every rank.

:func:`clock` counts the global batches that this process's sharded loaders have passed (those
a rank had no share of included): every rank's clock agrees wherever the ranks are at the same
point of their data, which is what the optimizers check at each step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler
from torch.utils.data.sampler import BatchSampler

from ... import rank, size
from ..._adapter import broadcast_object
from . import active, ensure_init

__all__ = ["GlobalBatches", "clock", "install", "share"]

_ATTRIBUTE = "_ringflow_auto_batches"
_warned: set[str] = set()
_clock = 0


def clock() -> int:
    """Global batches passed by this process's sharded DataLoaders (see the module doc)."""
    return _clock


def share(batch: Sequence[int], n: int, r: int) -> list[int]:
    """Rank ``r``'s contiguous share of ``batch`` among ``n`` ranks: ``len // n`` or one more,
    the larger shares first; shares of consecutive ranks are consecutive."""
    q, s = divmod(len(batch), n)
    start = r * q + min(r, s)
    return list(batch[start:start + q + (1 if r < s else 0)])


class GlobalBatches:
    """The index sampler of a DataLoader under auto mode: its batch sampler's batches, this
    rank's share of each (see the module doc)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._warned = False

    def __iter__(self) -> Iterator[list[int]]:
        if not active():
            yield from self.inner
            return
        n, r = size(), rank()
        batches = [list(b) for b in self.inner]
        if not _deterministic(self.inner):
            ensure_init()
            batches = broadcast_object(batches if r == 0 else None, 0,
                                       name="ringflow.auto.loader")
        global _clock
        for batch in batches:
            _clock += 1
            mine = share(batch, n, r)
            if len(batch) % n and not self._warned and torch.is_grad_enabled():
                self._warned = True
                warnings.warn(
                    f"ringflow.torch.auto: a DataLoader batch of {len(batch)} samples does not "
                    f"divide among {n} ranks; ranks take shares that differ by one, and "
                    "averaging their gradients weighs the smaller shares more than one process "
                    f"would. For the single-process result use a batch_size divisible by {n} "
                    "(and drop_last=True, or a dataset length that leaves a last batch "
                    f"divisible by {n})", RuntimeWarning, stacklevel=2)
            if mine:
                yield mine

    def __len__(self) -> int:
        length = len(self.inner)
        if length and active() and 0 < _last_length(self.inner) < size():
            return length - (rank() >= _last_length(self.inner))
        return length


def _deterministic(inner: Any) -> bool:
    return isinstance(inner, BatchSampler) and type(inner.sampler) is SequentialSampler


def _last_length(inner: Any) -> int:
    """The length of the last batch, where the batch sampler says it without iterating."""
    if type(inner) is BatchSampler and not inner.drop_last:
        try:
            return len(inner.sampler) % inner.batch_size  # type: ignore[arg-type]
        except TypeError:
            return 0
    return 0


def _index_sampler(loader: DataLoader[Any]) -> Any:
    inner = _original.fget(loader)  # type: ignore[union-attr]
    if not loader._auto_collation or _left_alone(loader):
        return inner
    wrapper = loader.__dict__.get(_ATTRIBUTE)
    if wrapper is None or wrapper.inner is not inner:
        wrapper = GlobalBatches(inner)
        object.__setattr__(loader, _ATTRIBUTE, wrapper)  # DataLoader guards some attributes
    return wrapper


def _left_alone(loader: DataLoader[Any]) -> bool:
    return isinstance(loader.dataset, IterableDataset) \
        or isinstance(loader.sampler, DistributedSampler) \
        or isinstance(getattr(loader.batch_sampler, "sampler", None), DistributedSampler)


def _warning_iter(original: Callable[..., Any]) -> Callable[..., Any]:
    """DataLoader.__iter__, saying once per kind which loaders auto mode leaves unsharded."""

    def __iter__(self: DataLoader[Any]) -> Any:
        kind = "iterable" if isinstance(self.dataset, IterableDataset) \
            else "unbatched" if not self._auto_collation else None
        if kind is not None and kind not in _warned and active():
            _warned.add(kind)
            warnings.warn(_UNSHARDED[kind], RuntimeWarning, stacklevel=2)
        return original(self)

    return __iter__


_UNSHARDED = {
    "iterable": "ringflow.torch.auto does not shard a DataLoader of an IterableDataset: every "
                "rank reads all of it. Shard it in the dataset's __iter__ with ringflow.rank() "
                "and ringflow.size()",
    "unbatched": "ringflow.torch.auto does not shard a DataLoader with batch_size=None (each "
                 "item is a batch already): every rank reads all of it. Give it a batch_size, "
                 "or a ringflow.torch.DistributedSampler",
}
_original = DataLoader.__dict__.get("_index_sampler")


def install() -> Callable[[], None]:
    """Patch DataLoader; returns the undo.

    Raises:
        RuntimeError: this torch has no ``DataLoader._index_sampler`` property (torch 1.2 to
            2.13 have it).
    """
    if not isinstance(_original, property):
        raise RuntimeError("ringflow.torch.auto: this torch's DataLoader has no _index_sampler "
                           "property to shard through; use hvd.DistributedSampler explicitly")
    iter_original = DataLoader.__iter__
    DataLoader._index_sampler = property(_index_sampler)  # type: ignore[assignment]
    DataLoader.__iter__ = _warning_iter(iter_original)  # type: ignore[method-assign]

    def undo() -> None:
        DataLoader._index_sampler = _original  # type: ignore[assignment]
        DataLoader.__iter__ = iter_original  # type: ignore[method-assign]

    return undo
