"""Optimizers under ``ringflow.torch.auto``: ranks start equal and step on averaged gradients.

1. Construction (``torch.optim.Optimizer.__init__``, patched): the optimizer's parameters are
   broadcast from rank 0, in place, fused (``broadcast_parameters``), so ranks start from rank
   0's model even when the script does not seed its initialisation.
2. Every ``step()`` (a global step pre-hook, torch's
   ``register_optimizer_step_pre_hook``): before the optimizer's own step runs, its gradients
   are averaged over the ranks, Jittor's way (its optimizers average in ``step``): one grouped
   Average allreduce of every dense gradient of the optimizer's parameters that require one
   (fused by the engine; sparse gradients take the sparse allreduce), in flight together with
   one small Sum allreduce of ``[k, k**2, has_grad_1, ..., has_grad_P]`` in float64, where
   ``k`` is the data clock (:func:`.loader.clock`: global batches passed, modulo ``2**20``).

   - ``has_grad``: a gradient that is None on every rank stays None (torch optimizers skip such
     parameters, as one process would); one that exists on some ranks only is averaged with
     zeros from the others.
   - ``k``: ``n * sum(k**2) == sum(k)**2`` holds exactly (integers below ``2**53``) iff every
     rank steps after the same batch. Otherwise every rank raises the same MismatchError instead
     of averaging gradients of different batches: a rank that had no share of a last batch and
     went on to the next epoch, a step that some ranks skipped (a GradScaler that found an
     infinity in this rank's gradients only) or took alone (``if rank == 0``) between two
     batches. (A count of steps could not see this: the k-th call pairs with the k-th call.)
     Scripts that do not draw their data from DataLoaders are not checked.
   - With a closure (``step(closure)``, LBFGS), the closure is wrapped instead: after each call
     its gradients are averaged as above and its loss is replaced by the average loss, so that
     every rank's optimizer sees the same values and takes the same path.

   Cost per step: the gradients' allreduce (``2 (n-1)/n`` of their bytes per rank on the ring)
   plus one coordinator round trip for the small tensor; no overlap with backward (Horovod's
   DistributedOptimizer overlaps; it needs the protocol of one backward per step, which
   unchanged scripts do not keep: accumulation, GANs, ``zero_grad`` anywhere).

An optimizer wrapped in ``hvd.DistributedOptimizer`` is left to it.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ... import Average, Sum, size
from ...errors import MismatchError
from ..functions import broadcast_parameters
from ..mpi_ops import (
    allreduce,
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from ..optimizer import _DistributedOptimizer
from . import active, ensure_init
from .loader import clock

__all__ = ["install"]

_CLOCK_MODULUS = 1 << 20  # k**2 * ranks stays below 2**53: exact in float64


class _Record:
    def __init__(self, ident: int) -> None:
        self.ident = ident

    @property
    def base(self) -> str:
        return f"ringflow.auto.optimizer{self.ident}"


_records: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Record] = \
    weakref.WeakKeyDictionary()
_ids = itertools.count()


def _record(opt: torch.optim.Optimizer) -> _Record:
    """The optimizer's number: the order in which optimizers first distribute, the same on every
    rank of a script that makes and steps them in the same order."""
    record = _records.get(opt)
    if record is None:
        record = _records[opt] = _Record(next(_ids))
    return record


def _constructed(opt: torch.optim.Optimizer) -> None:
    if isinstance(opt, _DistributedOptimizer) or not active():
        return
    ensure_init()
    base = _record(opt).base
    broadcast_parameters([(f"{base}.init.{g}.{i}", p.detach())
                          for g, group in enumerate(opt.param_groups)
                          for i, p in enumerate(group["params"])], root_rank=0)


def _pre_step(opt: torch.optim.Optimizer, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if isinstance(opt, _DistributedOptimizer) or not active():
        return None
    ensure_init()
    record = _record(opt)
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _average(opt, record)
        return None

    @functools.wraps(closure)
    def averaged() -> Any:
        loss = closure()
        _average(opt, record)
        if loss is None:
            return None
        value = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss))
        mean = allreduce(value.to(torch.float64), op=Average, name=f"{record.base}.loss")
        return mean.to(value.dtype) if torch.is_tensor(loss) else float(mean)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": averaged}
    return (args[0], averaged, *args[2:]), kwargs


def _average(opt: torch.optim.Optimizer, record: _Record) -> None:
    k = clock() % _CLOCK_MODULUS
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    meta = torch.tensor([k, k * k, *(p.grad is not None for p in params)], dtype=torch.float64)
    meta_handle = allreduce_async_(meta, name=f"{record.base}.meta", op=Sum)
    dense, sparse = [], []
    for i, p in enumerate(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            sparse.append((p, sparse_allreduce_async(p.grad, f"{record.base}.sparse.{i}",
                                                     Average)))
        else:
            dense.append(p.grad)
    handle = grouped_allreduce_async_(dense, name=f"{record.base}.grads", op=Average) \
        if dense else None
    meta = synchronize(meta_handle)
    if handle is not None:
        synchronize(handle)
    for p, wait in sparse:
        p.grad = wait()
    n, total, squares = size(), int(meta[0]), int(meta[1])
    if n * squares != total * total:
        raise MismatchError(
            f"ringflow.torch.auto: optimizer #{record.ident} ({type(opt).__name__}) stepped "
            f"after different DataLoader batches on different ranks (this rank: global batch "
            f"{k}; the mean over ranks: {total / n:g}), so its gradients would be averaged "
            "across different batches. Every rank must step after the same batches: a "
            "training DataLoader whose last batch has fewer samples than ranks leaves some "
            "ranks without it (set drop_last=True); a GradScaler skips a step on the ranks "
            "whose own gradients overflowed; a step under `if rank == 0` is taken alone")
    for p, present in zip(params, meta[2:].tolist(), strict=True):
        if present == 0:
            p.grad = None


def install() -> Callable[[], None]:
    """Patch optimizer construction and register the step pre-hook; returns the undo."""
    original = torch.optim.Optimizer.__init__

    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _constructed(self)

    torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign]
    hook = register_optimizer_step_pre_hook(_pre_step)

    def undo() -> None:
        hook.remove()
        torch.optim.Optimizer.__init__ = original  # type: ignore[method-assign]

    return undo
