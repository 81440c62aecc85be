"""The exception hierarchy.

Every error ringflow raises derives from :class:`RingflowError` *and* the closest builtin, so that
``except ValueError`` in user code keeps working. Messages say what failed, which tensor and ranks,
expected versus actual, and the fix.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "LaunchError",
    "MismatchError",
    "NotInitializedError",
    "PeerError",
    "ProtocolError",
    "RankFailure",
    "RingflowError",
    "RingflowTimeoutError",
    "ShutdownError",
    "StallError",
    "TensorError",
]


class RingflowError(Exception):
    """Base class of every ringflow error."""


class ConfigError(RingflowError, ValueError):
    """A RINGFLOW_* variable, flag or argument has a value that cannot be used."""


class NotInitializedError(RingflowError, ValueError):
    """An operation needs ``init()`` first (Horovod raises ValueError here too)."""


class TensorError(RingflowError, ValueError):
    """A tensor cannot take part in a collective (dtype, layout, duplicate name, ...)."""


class MismatchError(RingflowError, ValueError):
    """Ranks submitted the same tensor name with different op, dtype, shape, root, ..."""


class RingflowTimeoutError(RingflowError, TimeoutError):
    """Something did not happen within its deadline."""


class StallError(RingflowTimeoutError):
    """Some ranks submitted a tensor and others did not, for longer than the stall limit."""


class PeerError(RingflowError, ConnectionError):
    """A peer rank died, closed its connection, or could not be reached."""


class AuthenticationError(PeerError):
    """A connection did not prove knowledge of the job secret."""


class ProtocolError(PeerError):
    """A peer sent bytes that do not follow the wire protocol (garbage, bad length, ...)."""


class ShutdownError(RingflowError, RuntimeError):
    """The engine was shut down (or failed) while the operation was pending."""


class LaunchError(RingflowError, RuntimeError):
    """ringflow-run or ringflow.run could not start or finish the job."""


class RankFailure(RingflowError, RuntimeError):
    """A rank of a job or test harness failed; ``rank`` says which, the message says how."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
