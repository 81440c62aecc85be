"""The engine's control protocol: every message between ranks, typed (spec: here and in
:mod:`ringflow.negotiation`).

Each message is one frozen dataclass, pickled into one control frame of the transport
(:class:`~ringflow.transport.base.ControlChannel`), which has authenticated its peer (HMAC) before
any frame is read; :func:`decode` accepts only the classes below. Rank 0 is the coordinator::

    worker -> rank 0 : Submit(requests, bits, data)   what became pending: new requests in full,
                                                      cached ones as bits, small tensors with them
    rank 0 -> all    : Plan(items)                    ready items in execution order, the same
                                                      for every rank (negotiation.py)
    worker -> rank 0 : Abort(error, text)             this rank found a fatal condition (a peer
                                                      died or froze, a data-plane error)
    rank 0 -> all    : Fatal(error, text)             the job's one verdict: every rank fails
                                                      every pending and later call with it
    either way       : Heartbeat()                    liveness, every min(1 s, timeout_s / 4)
    rank 0 -> all    : Handover(successor, ...)       the coordinator shuts down cleanly while
                                                      others go on: ``successor`` coordinates
                                                      from now on (sent after its last plan)

An empty frame is the transport's goodbye (the peer shuts down on purpose), not a message. Errors
travel as (class name, text) and are rebuilt from the closed table
:data:`ringflow.errors.TRAVELLING`.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

from .errors import ProtocolError, RingflowError, from_wire

__all__ = ["Abort", "Fatal", "Handover", "Heartbeat", "Message", "Plan", "Submit", "decode",
           "encode"]


@dataclasses.dataclass(frozen=True)
class Submit:
    requests: list[Any]  # negotiation.Request, new to the coordinator
    bits: list[int]  # response-cache bits of unchanged requests
    data: list[Any]  # per bit: the prescaled tensor (allreduce of at most EAGER_BYTES) or None


@dataclasses.dataclass(frozen=True)
class Plan:
    items: list[Any]  # negotiation.Response | negotiation.CachedAllreduce


@dataclasses.dataclass(frozen=True)
class _Verdict:
    error: str  # a class name of ringflow.errors.TRAVELLING
    text: str

    @classmethod
    def of(cls, error: BaseException) -> Any:
        return cls(type(error).__name__, str(error))

    def exception(self) -> RingflowError:
        return from_wire(self.error, self.text)


class Abort(_Verdict):
    """A worker's fatal error, for rank 0 to decide on."""


class Fatal(_Verdict):
    """Rank 0's verdict: the job's error."""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    pass


@dataclasses.dataclass(frozen=True)
class Handover:
    """The departing coordinator's state that the successor needs (everything else -- process
    sets, the response cache -- every rank has alike from the plans)."""

    successor: int
    gone: dict[int, str]  # ranks that left, and why (the departing coordinator among them)
    joined: list[int]  # ranks that called join() and wait for the others
    next_set_id: int


Message = Submit | Plan | Abort | Fatal | Heartbeat | Handover
_KINDS = (Submit, Plan, Abort, Fatal, Heartbeat, Handover)
_HEARTBEAT = pickle.dumps(Heartbeat(), protocol=5)


def encode(message: Message) -> bytes:
    if isinstance(message, Heartbeat):
        return _HEARTBEAT
    return pickle.dumps(message, protocol=5)


def decode(payload: bytes) -> Message:
    """The message in ``payload`` (from an authenticated peer).

    Raises:
        ProtocolError: it is not one of the protocol's messages.
    """
    try:
        message = pickle.loads(payload)
    except Exception as exc:
        raise ProtocolError(f"a control message could not be decoded: {exc!r}") from exc
    if type(message) not in _KINDS:
        raise ProtocolError(f"a control message of unknown kind {type(message).__name__!r}")
    return message  # type: ignore[no-any-return]
