"""``hvd.elastic`` for torch (Horovod's ``horovod.torch.elastic``): ``run``, ``TorchState``,
``ElasticSampler``, and the core's ``ObjectState``.

The loop, the commit/restore/sync protocol and the sampler's arithmetic live in
:mod:`ringflow.elastic`; this module only knows how to copy, load and send torch objects:

* ``nn.Module``: ``state_dict()`` copied at ``commit()`` (into the previous commit's tensors),
  loaded back at ``restore()``;
  ``sync()`` broadcasts rank 0's parameters and buffers in place (``broadcast_parameters``);
* ``optim.Optimizer`` (a ``DistributedOptimizer`` too) and LR schedulers: their
  ``state_dict()`` likewise; ``sync()`` loads rank 0's whole ``state_dict`` (its structure
  pickled, its tensors broadcast as tensors: bit for bit), so that a newcomer whose optimizer
  never stepped gets the moments and step counts,
  except a compressor's error feedback, which stays each rank's own
  (:func:`ringflow.compressed.synced_state`);
* :class:`ElasticSampler`: ``(epoch, processed_num)``; ``sync()`` loads rank 0's and reshards.

Anything else given to :class:`TorchState` is a plain value
(:class:`~ringflow.elastic.ObjectState`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .. import elastic as _core
from ..compressed import synced_state
from ..elastic import ObjectState, PartsState, run
from . import (
    broadcast_async_,
    broadcast_object,
    broadcast_parameters,
    rank,
    size,
    synchronize,
)

__all__ = ["ElasticSampler", "ObjectState", "TorchState", "run"]

if os.environ.get("RINGFLOW_ELASTIC_ID"):
    # An elastic worker builds its optimizer right after init(), and torch's first optimizer
    # imports torch._dynamo (1.0 s on the development VM). Imported here, with ringflow.torch,
    # before init() asks to join, a newcomer does not keep its peers waiting for it in sync().
    with contextlib.suppress(ImportError):
        import torch._dynamo


class ElasticSampler(torch.utils.data.Sampler):
    """Shards ``dataset`` over the ranks and reshards what is left of the epoch after each reset
    (Horovod's ``ElasticSampler``, without its padding: every sample once per epoch).

    Record each step's batch with ``record_batch(batch_idx, batch_size)`` (``batch_size``: this
    rank's, the same on every rank) before ``state.commit()``, and call ``set_epoch(epoch + 1)``
    at the end of an epoch. Ranks hold ``len // size`` or one more of the remaining samples, so
    the last step of an epoch may find some ranks without a batch: give the loop a fixed number
    of steps (``ceil(remaining / size / batch_size)``) and let a rank without a batch contribute
    zeros, or call ``join()``.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the indices, with ``seed + epoch`` (Horovod's order).
        seed: the same on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (call it at the end of the previous one)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed a batch of ``batch_size`` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Reshard the rest of the epoch over the current ranks."""
        self.num_replicas, self.rank = size(), rank()
        self.indices = _core.shard(len(self.dataset), self.epoch, self.seed, self.shuffle,
                                   self.processed_num, self.rank, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class _Handler:
    """How one torch object is saved, restored and synced."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = _kept(getattr(self, "saved", None), self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))


def _kept(old: Any, new: Any) -> Any:
    """A deep copy of ``new`` that reuses the tensors of ``old``, the previous copy, where they
    match (``copy_`` into them): a commit every step allocates nothing. Measured on a 33 M
    parameter MLP with momentum (model and optimizer, 2 x 134 MB): 724 ms a commit with
    ``deepcopy``, 148 ms into kept tensors, on a loaded 2-core host."""
    if isinstance(new, torch.Tensor):
        if (isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype
                and old.device == new.device and not new.is_sparse):
            with torch.no_grad():
                return old.copy_(new)
        return copy.deepcopy(new.detach())
    if isinstance(new, dict):
        mine = old if isinstance(old, dict) else {}
        out = copy.copy(new)  # its type and attributes (a module's state_dict has _metadata)
        for k, v in new.items():
            out[k] = _kept(mine.get(k), v)
        if getattr(out, "__dict__", None):
            out.__dict__ = copy.deepcopy(out.__dict__)
        return out
    if isinstance(new, list):
        mine = old if isinstance(old, list) and len(old) == len(new) else [None] * len(new)
        return [_kept(a, b) for a, b in zip(mine, new, strict=True)]
    return copy.deepcopy(new)


class _Slot(NamedTuple):
    """Where rank 0's state dict holds a tensor: its place in the broadcast order, its shape,
    dtype and device type."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _broadcast_state(own: Any) -> Any:
    """Rank 0's ``own`` (a state dict) on every rank, bit for bit: its structure pickled, its
    tensors broadcast as tensors (the pickle of a 25 M MLP's momentum took 4-7x as long:
    benchmarks/RESULTS.md section 23)."""
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t.detach())
        return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype, t.device.type)

    theirs = broadcast_object(_mapped(own, _is_dense, slot), 0)
    slots: list[_Slot] = []
    _mapped(theirs, _is_slot, slots.append)
    if rank() == 0:
        bufs = [t.contiguous() for t in tensors]
    else:
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=_device(s.device))
                for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(b, 0, name=f"elastic.state.{i}") for i, b in enumerate(bufs)]
    for handle in handles:
        synchronize(handle)
    return _mapped(theirs, _is_slot, lambda s: bufs[s.index])


def _is_dense(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_sparse


def _is_slot(value: Any) -> bool:
    return isinstance(value, _Slot)


def _mapped(value: Any, leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn(x)`` for each ``x`` that is a ``leaf``, through dicts (their types
    kept), lists and tuples (not named tuples)."""
    if leaf(value):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _mapped(v, leaf, fn)
        return out
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_mapped(v, leaf, fn) for v in value)
    return value


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        abandon = getattr(self.value, "_abandon", None)
        if abandon is not None:  # a DistributedOptimizer: its failed step's allreduces are gone
            abandon()
        own = self.value.state_dict()
        state = _broadcast_state(own)
        if "ringflow_compression" in own and "ringflow_compression" in state:
            state["ringflow_compression"] = synced_state(state["ringflow_compression"],
                                                         own["ringflow_compression"])
        self.value.load_state_dict(state)


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


_LR_SCHEDULER = getattr(torch.optim.lr_scheduler, "LRScheduler",
                        getattr(torch.optim.lr_scheduler, "_LRScheduler", None))
_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    *([(_LR_SCHEDULER, _Handler)] if _LR_SCHEDULER is not None else []),
    (ElasticSampler, _Handler),
]


class TorchState(PartsState):
    """The state of a torch training (Horovod's ``TorchState``): ``model``, ``optimizer`` and
    every keyword argument become attributes; models, optimizers, LR schedulers and
    :class:`ElasticSampler` s are handled as the module doc says, other values are plain ones.
    Assigning a new object to a handled attribute tracks (and saves) the new one."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                handlers[name] = kind(value)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(handlers, bcast_object=broadcast_object, get_rank=rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_parts", {})
        if name in handlers:
            handlers[name] = type(handlers[name])(value)
        object.__setattr__(self, name, value)
