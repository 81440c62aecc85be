"""SyncBatchNorm: batch normalization over the global batch, on CPU tensors too.

Forward (training), per channel: each rank computes its sample count ``n_r``, mean ``m_r`` and sum
of squared deviations ``M2_r``; one allgather of these ``2C + 1`` numbers per rank lets every rank
merge them with Chan's parallel formula (``mean = sum n_r m_r / N``,
``M2 = sum M2_r + n_r (m_r - mean)^2``), which is exact in closed form and avoids the cancellation
of ``E[x^2] - E[x]^2``. Statistics are accumulated in float64 whatever the input dtype; ranks may
hold different batch sizes (even zero). Running statistics use the unbiased global variance, as
``nn.BatchNorm``.

Backward: with ``xhat = (x - mean) * invstd`` and upstream ``dy``, the input gradient needs the
global per-channel sums ``sum dy`` and ``sum dy * xhat``: one allreduce (Sum) of ``2C`` numbers,
then ``dx = weight * invstd * (dy - sum_dy / N - xhat * sum_dy_xhat / N)``. The weight and bias
gradients returned are this rank's *local* ``sum dy * xhat`` and ``sum dy`` (as torch's and
Horovod's SyncBatchNorm): DistributedOptimizer then averages them across ranks.

Cost per call: forward one allgather of ``(2C + 1) * 8`` bytes per rank; backward one allreduce of
``2C * 8`` bytes. Outside training, or with one rank, it is plain ``F.batch_norm``.

:func:`batch_norm` is that forward for any ``_BatchNorm`` module (``ringflow.torch.auto`` runs
every BatchNorm layer through it); ``SyncBatchNorm.convert_sync_batchnorm(model)`` replaces a
model's BatchNorm layers, keeping their parameters and buffers, as torch's classmethod does.

``torch.nn.SyncBatchNorm`` synchronises only through a torch.distributed process group. Without
one (as under ringflow) torch 2.13 silently falls back to ``F.batch_norm`` on this rank's batch;
with one, CPU tensors raise ``ValueError``. Importing ``ringflow.torch`` wraps its forward to warn
once when that fallback happens in training in a job of several ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import ProcessSet, global_process_set, size
from ..errors import RingflowError
from ..ops import Sum
from .mpi_ops import allgather, allreduce

__all__ = ["SyncBatchNorm", "batch_norm"]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float, process_set: ProcessSet) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        x64 = x.detach().to(torch.float64)
        count = x.numel() // channels if channels else 0
        if count:
            local_mean = x64.mean(dim=dims)
            local_m2 = ((x64 - _bcast(local_mean, x.dim())) ** 2).sum(dim=dims)
        else:
            local_mean = local_m2 = torch.zeros(channels, dtype=torch.float64)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64), local_mean, local_m2])
        rows = allgather(row.unsqueeze(0), process_set=process_set)
        counts, means, m2s = rows[:, 0:1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1 and running_var is not None:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(x.shape)} (global batch {int(total)})")
        mean = (counts * means).sum(dim=0) / total
        m2 = m2s.sum(dim=0) + (counts * (means - mean) ** 2).sum(dim=0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased = m2 / max(total - 1, 1)
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        xhat = (x64 - _bcast(mean, x.dim())) * _bcast(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _bcast(weight.detach().to(torch.float64), x.dim())
        if bias is not None:
            y = y + _bcast(bias.detach().to(torch.float64), x.dim())
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = total
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        nd = xhat.dim()
        dims = [0, *range(2, nd)]
        dy64 = dy.to(torch.float64)
        channels = xhat.shape[1]
        if xhat.numel():
            sum_dy = dy64.sum(dim=dims)
            sum_dy_xhat = (dy64 * xhat).sum(dim=dims)
        else:
            sum_dy = sum_dy_xhat = torch.zeros(channels, dtype=torch.float64)
        both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                         process_set=ctx.process_set)
        g_dy, g_dy_xhat = both[:channels], both[channels:]
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        dx = _bcast(scale, nd) * (dy64 - _bcast(g_dy / ctx.total, nd)
                                  - xhat * _bcast(g_dy_xhat / ctx.total, nd))
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype) \
            if ctx.has_bias else None
        return dx.to(dy.dtype), grad_weight, grad_bias, None, None, None, None, None


def _bcast(v: torch.Tensor, nd: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor."""
    return v.view(1, -1, *([1] * (nd - 2)))


def batch_norm(module: _BatchNorm, input: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    """``module``'s forward (any ``_BatchNorm``: its weight, bias, running statistics, eps and
    momentum) with the statistics of the whole batch of ``process_set`` in training, as
    :class:`SyncBatchNorm` computes them; ``F.batch_norm`` outside training or alone."""
    average_factor = 0.0
    if module.training and module.track_running_stats:
        module.num_batches_tracked.add_(1)  # type: ignore[union-attr, operator]
        if module.momentum is None:  # cumulative moving average
            average_factor = 1.0 / float(module.num_batches_tracked)  # type: ignore[arg-type]
        else:
            average_factor = module.momentum
    if not module.training or process_set.size() == 1:
        return F.batch_norm(input, module.running_mean, module.running_var, module.weight,
                            module.bias, module.training or not module.track_running_stats,
                            average_factor, module.eps)
    return _SyncBatchNormFunction.apply(
        input, module.weight, module.bias,
        module.running_mean if module.track_running_stats else None,
        module.running_var if module.track_running_stats else None,
        module.eps, average_factor, process_set)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose statistics are computed over all ranks' batches.

    A drop-in for ``horovod.torch.SyncBatchNorm`` (same arguments) that also runs on CPU tensors.
    ``process_set`` (a ringflow extension) limits the synchronization to some ranks.
    :meth:`convert_sync_batchnorm` converts a model's BatchNorm layers, as torch's does.

    Raises:
        ValueError: the input has fewer than 2 dimensions (Horovod's message).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        return batch_norm(self, input, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """``module`` with every ``BatchNorm*d`` in it (torch's ``SyncBatchNorm`` too) replaced
        by a ringflow :class:`SyncBatchNorm` over ``process_set``: torch's classmethod of the
        same name, with a process set for its process group.

        The new layers take over the old ones' parameters and buffers themselves (the same
        ``Parameter`` objects, so an optimizer built before still updates them), and their
        training flag. ``module`` itself is returned converted when it is a BatchNorm layer;
        its children are replaced in place otherwise.

        Raises:
            TypeError: ``process_set`` is not a ringflow ``ProcessSet`` (a torch process group).
        """
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"convert_sync_batchnorm: process_set must be a ringflow "
                            f"ProcessSet, got {type(process_set).__name__}; torch process "
                            "groups do not apply (ringflow.add_process_set makes a set)")
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return converted


# torch.nn.SyncBatchNorm under ringflow ------------------------------------------------------------
# torch's SyncBatchNorm synchronises through torch.distributed only: without a process group it
# falls back to F.batch_norm on this rank's batch, silently (torch 2.13, checked; with one, CPU
# tensors raise ValueError). Under ringflow that is a quiet divergence from the global batch, so
# its forward is wrapped to warn once. ringflow.torch.auto synchronises those layers instead.
_torch_forward = torch.nn.SyncBatchNorm.forward
_warned = False


def _warn_unsynchronised(self: torch.nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    global _warned
    if self.training and not _warned and not _torch_group() and _in_job():
        _warned = True
        warnings.warn(
            "torch.nn.SyncBatchNorm is not synchronising: torch.distributed has no process "
            "group, so torch normalises over this rank's batch only (it falls back to "
            "BatchNorm without saying so). Convert the model with "
            "ringflow.torch.SyncBatchNorm.convert_sync_batchnorm(model), or run it under "
            "ringflow-run --auto / import ringflow.torch.auto, which synchronise it",
            RuntimeWarning, stacklevel=2)
    return _torch_forward(self, input)  # type: ignore[no-any-return]


def _torch_group() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def _in_job() -> bool:
    try:
        return size() > 1
    except RingflowError:  # a launcher environment that init() would refuse: not ours to judge
        return False


torch.nn.SyncBatchNorm.forward = _warn_unsynchronised  # type: ignore[method-assign]
