"""The machinery of :mod:`ringflow.torch.auto`: what is patched, and when it acts.

:func:`enable` installs three patches (:func:`disable` removes them, in reverse order):

- :mod:`.loader`: the ``DataLoader._index_sampler`` property, through which a DataLoader's
  iterator and ``len()`` read its batch sampler;
- :mod:`.optim`: ``torch.optim.Optimizer.__init__`` (parameters broadcast from rank 0 when an
  optimizer is made) and a global optimizer step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``: gradients averaged before every
  ``step()``);
- :mod:`.norm`: ``_BatchNorm.forward`` (BatchNorm1d/2d/3d and their lazy forms) and
  ``torch.nn.SyncBatchNorm.forward`` (statistics over every rank's batch in training).

Each patch acts only while :func:`active`: auto mode enabled, this thread outside
:func:`ringflow.single_process_scope`'s local mode, and a job of more than one rank. Otherwise
each one is torch's own behaviour, so a script runs alone unchanged. The first patch that needs
the other ranks calls ``ringflow.init()`` (:func:`ensure_init`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ... import init, is_initialized, size
from ...single_process import in_single_process_scope

__all__ = ["active", "disable", "enable", "enabled", "ensure_init"]

_lock = threading.Lock()
_undo: list[Callable[[], None]] = []


def enable() -> None:
    """Install the patches (idempotent)."""
    from . import loader, norm, optim

    with _lock:
        if not _undo:
            _undo.extend([loader.install(), optim.install(), norm.install()])


def disable() -> None:
    """Remove the patches; torch behaves as before :func:`enable`."""
    with _lock:
        while _undo:
            _undo.pop()()


def enabled() -> bool:
    return bool(_undo)


def active() -> bool:
    """Whether the patches distribute now (see the module doc).

    Raises:
        ConfigError: the launcher's environment is invalid (what ``ringflow.init()`` raises).
    """
    return bool(_undo) and not in_single_process_scope() and size() > 1


def ensure_init() -> None:
    if not is_initialized():
        init()
