"""The engine's control protocol: every message between ranks, typed (spec: here and in
:mod:`ringflow.negotiation`).

Each message is one frozen dataclass, pickled into one control frame of the transport
(:class:`~ringflow.transport.base.ControlChannel`), which has authenticated its peer (HMAC) before
any frame is read; :func:`decode` accepts only the classes below. Rank 0 is the coordinator::

    worker -> rank 0 : Submit(requests, bits, data)   what became pending: new requests in full,
                                                      cached ones as bits, small tensors with them
    rank 0 -> all    : Plan(items, params)            ready items in execution order, the same
                                                      for every rank (negotiation.py); params:
                                                      the autotuner's new values, or None
    worker -> rank 0 : Abort(error, text)             this rank found a fatal condition (a peer
                                                      died or froze, a data-plane error)
    rank 0 -> all    : Fatal(error, text)             the job's one verdict: every rank fails
                                                      every pending and later call with it
    either way       : Heartbeat()                    liveness, every min(1 s, timeout_s / 4)
    rank 0 -> all    : Handover(successor, ...)       the coordinator shuts down cleanly while
                                                      others go on: ``successor`` coordinates
                                                      from now on (sent after its last plan)

Plans and handovers form the job's one *coordinator stream*: each carries its position in it
(``seq``, counted from 0 across coordinators), and every rank takes them in in that order,
keeping any that arrives early. Messages of one sender arrive in order, but those of successive
coordinators come over different connections: a handover from rank 1 (or rank 1's first plan)
can reach rank 2 before rank 0's last plan, which rank 2 must take in first.

The timeline (:mod:`ringflow.timeline`), handled on the receiver's transport thread without
the engine's lock, and only while a timeline is recorded::

    rank 0 -> any    : ClockProbe(t)                  rank 0's clock, for the rank's offset
    any -> rank 0    : ClockReply(t, t_peer, rec)     the probe's t, the rank's clock at once,
                                                      whether it records a timeline
    any -> rank 0    : TraceEvents(records, last)     finished operations (last: the rank
                                                      stopped recording)

Point to point (:mod:`ringflow.p2p`), between the two ranks involved only, handled on the
receiver's transport thread without the engine's lock::

    sender -> receiver : P2PData(tag, seq, dtype, shape,   one chunk (at most p2p.CHUNK_BYTES of
                                 offset, data, tracked,    data) of message ``seq`` of the sender;
                                 error)                    every chunk carries the whole header
    receiver -> sender : P2PReply(tag, seq, error, text)   message ``seq`` was received (error
                                                           empty) or refused (a MismatchError)

P2PData and P2PReply frames are the pickled tuples of their fields behind a kind byte, and
P2PData carries its array out of band (after the header, 16-byte aligned; see :func:`encode`),
so that the data is copied once on each side. An empty frame is the transport's goodbye (the
peer shuts down on purpose), not a message. Errors travel as (class name, text) and are rebuilt
from the closed table :data:`ringflow.errors.TRAVELLING`.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np

from .errors import ProtocolError, RingflowError, from_wire
from .requests import CachedAllreduce, Request, Response

__all__ = ["TIMELINE", "Abort", "ClockProbe", "ClockReply", "Fatal", "Handover", "Heartbeat",
           "Message", "P2PData", "P2PReply", "Plan", "Submit", "TraceEvents", "decode", "encode"]


@dataclasses.dataclass(frozen=True)
class Submit:
    requests: list[Request]  # new to the coordinator
    bits: list[int]  # response-cache bits of unchanged requests
    #: per bit: the prescaled tensor (allreduce of at most collectives.EAGER_BYTES) or None
    data: list[np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class Plan:
    items: list[Response | CachedAllreduce]
    seq: int  # its place in the coordinator stream (see the module docstring)
    params: Any = None  # autotune.Params: the autotuner's new values, in force from this plan


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
    seq: int  # its place in the coordinator stream: after every plan of the departing one


# the timeline ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClockProbe:
    t: float  # rank 0's clock (time.perf_counter) when sent


@dataclasses.dataclass(frozen=True)
class ClockReply:
    t: float  # the probe's
    t_peer: float  # the answering rank's clock when it answered
    recording: bool  # it records a timeline: rank 0 waits for its last records at the end


@dataclasses.dataclass(frozen=True)
class TraceEvents:
    records: list[Any]  # ringflow.timeline.Record tuples
    last: bool  # the rank stopped recording (or shuts down)
    meta: dict[str, Any] | None = None  # the rank's metadata, with its first message


# point to point ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class P2PData:
    """One chunk of a point-to-point message (see :mod:`ringflow.p2p`)."""

    tag: int | tuple[int, int]  # the user's tag, or (tag, seq) of a forward message: a gradient
    seq: int  # the sender's message number (one counter for all its messages)
    dtype: str  # a name of ops.DTYPES; "" with ``error``
    shape: tuple[int, ...]
    offset: int  # of ``data`` in the message's bytes; chunks come in order
    data: Any  # numpy uint8 array: bytes offset .. offset + data.size of the message
    tracked: bool = False  # the sender's adapter tracks it for gradients (it will want one)
    error: str = ""  # the sender could not send (a TensorError's text): no data follows


@dataclasses.dataclass(frozen=True)
class P2PReply:
    """The receiver's answer to message ``seq``: received in full, or refused with an error."""

    tag: int | tuple[int, int]
    seq: int
    error: str  # "" or a class name of ringflow.errors.TRAVELLING (MismatchError)
    text: str


Message = (Submit | Plan | Abort | Fatal | Heartbeat | Handover | ClockProbe | ClockReply
           | TraceEvents | P2PData | P2PReply)
_KINDS = (Submit, Plan, Abort, Fatal, Heartbeat, Handover, ClockProbe, ClockReply, TraceEvents,
          P2PData, P2PReply)
#: The timeline's messages (handled without the engine's lock).
TIMELINE = (ClockProbe, ClockReply, TraceEvents)
_HEARTBEAT = pickle.dumps(Heartbeat(), protocol=5)


# Point-to-point frames are not pickled dataclasses (30 us to pickle one with its array, 7 us a
# reply; a tuple of their fields takes 2): the first byte, never the first byte of a pickle,
# says which; then the pickled tuple of the fields. A P2PData frame carries its array out of
# band, so that neither side copies it through pickle: ``_P2P_DATA``, the header's length (4
# bytes, big-endian), the pickled fields but ``data``, zeros up to a multiple of 16 bytes, the
# data. The receiver's array is a view of the frame, as aligned as the frame itself.
_P2P_DATA = b"\x01"
_P2P_REPLY = b"\x02"
_ALIGN = 16


def _data_offset(header: int) -> int:
    return -(-(5 + header) // _ALIGN) * _ALIGN


def encode(message: Message) -> bytes | bytearray:
    if isinstance(message, Heartbeat):
        return _HEARTBEAT
    if isinstance(message, P2PData):
        m = message
        header = pickle.dumps((m.tag, m.seq, m.dtype, tuple(m.shape), m.offset, m.tracked,
                               m.error), protocol=5)
        pad = bytes(_data_offset(len(header)) - 5 - len(header))
        head = bytearray(_P2P_DATA + len(header).to_bytes(4, "big") + header + pad)
        return head + memoryview(m.data)  # the one copy of the data on the sending side
    if isinstance(message, P2PReply):
        r = message
        return _P2P_REPLY + pickle.dumps((r.tag, r.seq, r.error, r.text), protocol=5)
    return pickle.dumps(message, protocol=5)


def decode(payload: bytes | bytearray) -> Message:
    """The message in ``payload`` (from an authenticated peer).

    Raises:
        ProtocolError: it is not one of the protocol's messages.
    """
    try:
        kind = payload[:1]
        if kind == _P2P_DATA:
            view = memoryview(payload)
            header = int.from_bytes(view[1:5], "big")
            tag, seq, dtype, shape, offset, tracked, error = pickle.loads(view[5:5 + header])
            data = np.frombuffer(view[_data_offset(header):], np.uint8)
            message = P2PData(tag, seq, dtype, shape, offset, data, tracked, error)
        elif kind == _P2P_REPLY:
            message = P2PReply(*pickle.loads(memoryview(payload)[1:]))
        else:
            message = pickle.loads(payload)
    except Exception as exc:
        raise ProtocolError(f"a control message could not be decoded: {exc!r}") from exc
    if type(message) not in _KINDS:
        raise ProtocolError(f"a control message of unknown kind {type(message).__name__!r}")
    return message  # type: ignore[no-any-return]
