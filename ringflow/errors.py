"""The exception hierarchy.

Every error ringflow raises derives from :class:`RingflowError` *and* the closest builtin, so that
``except ValueError`` in user code keeps working. Messages say what failed, which tensor and ranks,
expected versus actual, and the fix.

Every error a collective can raise -- at the call (a duplicate name, a tensor that cannot take
part) or from its handle (a mismatch, a stall, a dead peer, a shutdown) -- is also a
:class:`HorovodInternalError`, the ``RuntimeError`` that Horovod 0.28 raises when a collective
fails, so ``except hvd.HorovodInternalError`` (Horovod's elastic-training idiom) catches it while
``except ValueError`` still catches a misuse. Errors of configuration and launching are not.
"""

from __future__ import annotations

__all__ = [
    "TRAVELLING",
    "AdasumError",
    "AuthenticationError",
    "ConfigError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "LaunchError",
    "MismatchError",
    "NotInitializedError",
    "PeerError",
    "ProtocolError",
    "RankFailure",
    "RingflowError",
    "RingflowTimeoutError",
    "SharedMemoryError",
    "ShutdownError",
    "StallError",
    "TensorError",
    "UnsupportedError",
    "from_wire",
]


class RingflowError(Exception):
    """Base class of every ringflow error."""


class HorovodInternalError(RingflowError, RuntimeError):
    """A collective failed (Horovod's name; the base of every error a collective raises)."""


class HostsUpdatedInterrupt(RingflowError, RuntimeError):
    """Horovod's elastic interrupt: the set of hosts changed (workers wait to join, or a host
    left the discovery script's list); ``commit()`` / ``check_host_updates()`` raise it on every
    rank of an elastic job alike, and the job re-forms. ``skip_sync`` as in Horovod."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"the hosts of the job were updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class ConfigError(RingflowError, ValueError):
    """A RINGFLOW_* variable, flag or argument has a value that cannot be used."""


class NotInitializedError(RingflowError, ValueError):
    """An operation needs ``init()`` first (Horovod raises ValueError here too)."""


class TensorError(HorovodInternalError, ValueError):
    """A tensor cannot take part in a collective (dtype, layout, duplicate name, ...)."""


class MismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same tensor name with different op, dtype, shape, root, ..."""


class AdasumError(HorovodInternalError, NotImplementedError):
    """Adasum over a number of ranks that is not a power of two (Horovod raises
    NotImplementedError with the same text, at the call)."""


class UnsupportedError(HorovodInternalError, NotImplementedError):
    """An operation of a foreign API that ringflow does not implement (torch.distributed's
    receive from any source, ...); raised at the call, on the calling rank."""


class RingflowTimeoutError(RingflowError, TimeoutError):
    """Something did not happen within its deadline."""


class StallError(RingflowTimeoutError, HorovodInternalError):
    """Some ranks submitted a tensor and others did not, for longer than the stall limit."""


class PeerError(HorovodInternalError, ConnectionError):
    """A peer rank died, closed its connection, or could not be reached."""


class SharedMemoryError(HorovodInternalError, MemoryError):
    """Shared memory (``/dev/shm``) has no room for the segments the local ranks need."""


class AuthenticationError(PeerError):
    """A connection did not prove knowledge of the job secret."""


class ProtocolError(PeerError):
    """A peer sent bytes that do not follow the wire protocol (garbage, bad length, ...)."""


class ShutdownError(HorovodInternalError):
    """The engine was shut down (or failed) while the operation was pending."""


class LaunchError(RingflowError, RuntimeError):
    """ringflow-run or ringflow.run could not start or finish the job."""


class RankFailure(RingflowError, RuntimeError):
    """A rank of a job or test harness failed; ``rank`` says which, the message says how."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank


#: Every error that travels between ranks, by class name: the closed table a received name is
#: looked up in (never ``getattr`` on this module). Add a class here to let it travel.
TRAVELLING: dict[str, type[RingflowError]] = {cls.__name__: cls for cls in (
    AdasumError, AuthenticationError, ConfigError, HorovodInternalError, MismatchError,
    PeerError, ProtocolError, RingflowError, RingflowTimeoutError, SharedMemoryError,
    ShutdownError, StallError, TensorError,
)}


def from_wire(name: str, text: str) -> RingflowError:
    """The error a peer sent as (class name, text); an unknown name becomes a ShutdownError
    naming it, so a newer peer's class can never become something else silently."""
    cls = TRAVELLING.get(name)
    if cls is None:
        return ShutdownError(f"{name}: {text}")
    return cls(text)
