"""BatchNorm under ``ringflow.torch.auto``: statistics over every rank's batch in training.

``_BatchNorm.forward`` (BatchNorm1d/2d/3d and the lazy forms share it) and
``torch.nn.SyncBatchNorm.forward`` (when torch.distributed has no process group: otherwise it is
torch's own) run :func:`ringflow.torch.sync_batch_norm.batch_norm` over the global process set
while training: the layers stay what they are (same class, parameters, buffers and
``state_dict``), and a model is synchronised wherever and whenever it was built. Outside
training they are torch's forward (running statistics, identical on every rank because every
rank updated them with the global statistics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ... import global_process_set
from ..sync_batch_norm import _torch_group, batch_norm
from . import active, ensure_init

__all__ = ["install"]


def _synchronised(original: Callable[..., Any], torch_sync: bool) -> Callable[..., Any]:
    def forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
        if self.training and not (torch_sync and _torch_group()) and active():
            ensure_init()
            self._check_input_dim(input)
            return batch_norm(self, input, global_process_set)
        return original(self, input)  # type: ignore[no-any-return]

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def install() -> Callable[[], None]:
    """Patch both forwards; returns the undo."""
    bn, sbn = _BatchNorm.forward, torch.nn.SyncBatchNorm.forward
    _BatchNorm.forward = _synchronised(bn, False)  # type: ignore[method-assign]
    torch.nn.SyncBatchNorm.forward = _synchronised(sbn, True)  # type: ignore[method-assign]

    def undo() -> None:
        _BatchNorm.forward = bn  # type: ignore[method-assign]
        torch.nn.SyncBatchNorm.forward = sbn  # type: ignore[method-assign]

    return undo
