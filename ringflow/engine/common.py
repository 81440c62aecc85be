"""What the engine's parts share: the engine thread's inbox items, and cloned errors."""

from __future__ import annotations

import enum

from ..errors import ShutdownError
from ..requests import Key

__all__ = ["Key", "Wake", "clone"]

class Wake(enum.Enum):
    """What an item of the engine thread's inbox asks of it: ``(Wake.X, *arguments)``."""

    ENQUEUE = "enqueue"  # (entry,): accept it (submitted while the engine was busy)
    MESSAGE = "message"  # (src, Abort | Fatal): act on a verdict
    PEER = "peer"  # (rank, error): a peer failed or said goodbye
    ERROR = "error"  # (exception,): another thread failed doing control work
    RUN = "run"  # (): plan items are ready to execute
    TICK = "tick"  # (): check liveness, stalls and the fusion window
    STOP = "stop"  # (): shut down


def clone(error: BaseException) -> BaseException:
    """A fresh exception of the same class and text, so tracebacks do not pile up across waits."""
    try:
        return type(error)(*error.args)
    except Exception:
        return ShutdownError(str(error))
