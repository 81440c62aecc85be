"""``ringflow-run --auto``: this directory goes first on the workers' ``PYTHONPATH``.

It holds only a ``sitecustomize`` module, which Python's ``site`` imports at startup in every
worker (and in every Python process a worker starts). It imports nothing heavy: it waits for the
program to import ``torch`` and then imports :mod:`ringflow.torch.auto`, so a worker that never
imports torch pays nothing. It then imports the ``sitecustomize`` it hides, if there is one.
``python -S`` / ``-I`` / ``-E`` skip it (no auto mode), as they skip every ``sitecustomize``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["DIRECTORY", "worker_pythonpath"]

DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def worker_pythonpath(env: Mapping[str, str]) -> str:
    """``env``'s ``PYTHONPATH`` with this directory first."""
    return os.pathsep.join([DIRECTORY, *filter(None, [env.get("PYTHONPATH")])])
