"""Point-to-point messages: ``isend`` / ``irecv`` between two ranks, matched by (source, tag).

Spec. A message goes from the sender straight to the receiver over the engine's
:class:`~ringflow.transport.base.ControlChannel`, as :class:`~ringflow.messages.P2PData` frames;
no other rank (the coordinator included) sees it or is woken by it::

    sender   -> receiver : P2PData(tag, seq, dtype, shape, offset, data)   one per chunk
    receiver -> sender   : P2PReply(tag, seq, error, text)                 once, when matched

1. ``isend(array, dst, tag)`` takes the next ``seq`` of this rank (one counter for every message
   it sends, so (sender, seq) names a message for the life of the engine), registers the handle
   under ``(dst, seq)`` and sends the array in chunks of at most :data:`CHUNK_BYTES`, every chunk
   carrying the whole header. The chunks of one message are sent back to back under a lock per
   destination, and the control channel keeps each pair's frames in order, so messages of one
   (source, tag) arrive -- and are matched -- in the order they were sent (FIFO, as in MPI and
   torch.distributed).
2. The receiver handles frames on the transport's reader thread (no engine lock, no engine
   thread). The first chunk of a message is matched with the oldest receive posted for its
   (source, tag); if there is none the message is *unexpected*: it is kept (a buffer of its full
   size, filled as chunks arrive) in arrival order until ``irecv`` takes it. Either way later
   chunks are copied straight to where the message goes: the receive's ``out``, a fresh array,
   or the unexpected buffer (which becomes the result, without a copy, if the receive has no
   ``out``). A message of one chunk and no ``out`` is returned as a view of its frame, with no
   copy at all.
3. Matching checks that the receive's ``out`` / ``shape`` holds as many elements as were sent and
   that its dtype (``out``'s or ``dtype``) is the one sent. A disagreement fails the receive with
   a :class:`~ringflow.errors.MismatchError` naming both ranks' values, discards the message, and
   is sent back in the reply, so the sender's handle fails with the same class and text. Both
   ranks go on: the next message of that tag is matched by the next receive.
4. When the whole message has been received the receive completes and the receiver sends an
   empty reply; the send completes when that reply arrives. A send therefore completes only once
   the receiver has the data (MPI's synchronous mode, ``MPI_Ssend``): a blocking ``send`` waits
   for the matching receive, and a ring in which every rank sends first must use ``isend``.
5. An array the sender cannot send (a dtype ringflow does not move, an adapter's invalid tensor)
   fails its handle at once and travels as a message carrying the error, so the matching receive
   fails with the same text instead of waiting.

Failures. A peer that fails or says goodbye fails every pending send to it and receive from it
(a receive can still take a message that arrived complete before). A fatal job error or this
rank's shutdown fails everything pending, and every later call raises that error at the call.
Rank 0 leaving (``shutdown()``) ends the collectives of the other ranks but not their point to
point, in which it takes no part.

Tags are any Python int. Adapters send gradients on a separate tag space: the pair
``(tag, seq)`` of the forward message (see :mod:`ringflow._adapter`), which no int equals.

Cost per message of S bytes: ceil(S / CHUNK_BYTES) frames (at least 1) one way and one reply
back; besides the transport's own reads and writes, the sender copies the data once (into the
frames: the array travels out of band, :func:`ringflow.messages.encode`) and the receiver once
(out of each frame into place); nothing on any other rank.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from collections.abc import Callable
from typing import cast

import numpy as np

from . import ops as _ops
from .errors import MismatchError, RingflowError, ShutdownError, TensorError, from_wire
from .handles import Handle
from .messages import P2PData, P2PReply, encode

__all__ = ["CHUNK_BYTES", "P2PHandle", "PointToPoint", "Tag", "describe_tag"]

#: The most array bytes one P2PData frame carries (its header adds under 100 bytes), far below
#: MAX_CTRL_BYTES (64 MiB): the receiver copies each frame into place while the next arrives,
#: and no frame is a large allocation of its own. 1 MiB: a 64 MiB round trip took a median of
#: 123 ms against 149 with 4 MiB and 218-331 with 16 MiB (benchmarks/p2p_latency.py, 2 ranks;
#: benchmarks/RESULTS.md section 8).
CHUNK_BYTES = 1024 * 1024

# A receive is usually answered within ~100 us: poll that long before sleeping (see Handle).
_SPIN_S = 100e-6

Tag = int | tuple[int, int]  # a user's tag, or (tag, seq) of a forward message: a gradient's


class P2PHandle(Handle):
    """The handle of an ``isend`` / ``irecv``. ``wait()`` returns None for a send and the array for
    a receive. ``peer``, ``tag``; ``seq`` names the message (a send: at once; a receive: once it
    completed); ``tracked`` is the sender's flag that an adapter will want a gradient for it."""

    __slots__ = ("peer", "seq", "tag", "tracked")

    def __init__(self, name: str, peer: int, tag: Tag, seq: int = -1,
                 tracked: bool = False) -> None:
        super().__init__(name, _SPIN_S)
        self.peer, self.tag, self.seq, self.tracked = peer, tag, seq, tracked


class _Recv:
    __slots__ = ("dtype", "handle", "out", "shape", "size", "src", "tag")

    def __init__(self, handle: P2PHandle, src: int, tag: Tag, out: np.ndarray | None,
                 shape: tuple[int, ...] | None, dtype: np.dtype | None) -> None:
        self.handle, self.src, self.tag, self.out = handle, src, tag, out
        self.shape = out.shape if out is not None else shape
        self.size = None if self.shape is None else math.prod(self.shape)
        self.dtype = out.dtype if out is not None else dtype


class _Incoming:
    """One message as it arrives: its header, where its bytes go, how many have come."""

    __slots__ = ("dest", "dropped", "dtype", "error", "filled", "nbytes", "recv", "seq", "shape",
                 "src", "tag", "tracked")

    def __init__(self, src: int, msg: P2PData) -> None:
        self.src, self.tag, self.seq, self.error = src, msg.tag, msg.seq, msg.error
        self.shape, self.tracked = tuple(msg.shape), msg.tracked
        self.dtype = _ops.DTYPES.get(msg.dtype)
        self.nbytes = 0 if self.dtype is None else math.prod(self.shape) * self.dtype.itemsize
        self.dest: np.ndarray | None = None  # flat uint8 view of where the bytes go
        self.filled = 0
        self.recv: _Recv | None = None
        self.dropped = False  # matched with an error: its remaining chunks are discarded

    @property
    def complete(self) -> bool:
        return self.filled >= self.nbytes

    def write(self, offset: int, data: np.ndarray) -> None:
        if self.dest is None:
            if offset == 0 and data.size == self.nbytes and data.flags.writeable:
                self.dest = data  # one chunk: keep the decoded array (a view of the frame)
            else:
                self.dest = np.empty(self.nbytes, np.uint8)
        if self.dest is not data and data.size:
            self.dest[offset:offset + data.size] = data
        self.filled = offset + data.size

    def retarget(self, out: np.ndarray) -> None:
        """Receive into ``out`` from now on (what arrived so far is copied there)."""
        flat = _bytes_of(out)
        if self.filled:
            flat[:self.filled] = self.dest[:self.filled]
        self.dest = flat

    def value(self, recv: _Recv) -> np.ndarray:
        """The received array (a matched, complete message without error)."""
        if recv.out is not None:
            return recv.out  # retarget() made the bytes arrive there
        flat = self.dest if self.dest is not None else np.empty(0, np.uint8)
        dtype = cast(np.dtype, self.dtype)  # known: the match checked it
        return flat.view(dtype).reshape(recv.shape if recv.shape is not None else self.shape)


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _clone(error: BaseException) -> BaseException:
    try:
        return type(error)(*error.args)
    except Exception:
        return ShutdownError(str(error))


def describe_tag(tag: Tag) -> str:
    return f"tag {tag}" if isinstance(tag, int) else f"gradient tag {tag[0]} (message #{tag[1]})"


class PointToPoint:
    """The point-to-point state of one rank: sends awaiting their reply, posted receives and
    unexpected messages, per (source, tag). Thread-safe; called by framework threads (``isend``,
    ``irecv``) and by the transport's reader threads (:meth:`on_message`, :meth:`peer_failed`).

    ``send_ctrl(payload, dst)`` is the transport's; ``stats`` is the engine's counter dict.
    """

    #: The messages the engine routes to :meth:`on_message`.
    MESSAGES = (P2PData, P2PReply)

    def __init__(self, rank: int, size: int, send_ctrl: Callable[[bytes, int], None],
                 stats: dict[str, int], chunk_bytes: int = CHUNK_BYTES) -> None:
        self.rank, self.size = rank, size
        self._send_ctrl = send_ctrl
        self._chunk = max(1, chunk_bytes)
        self.stats = stats
        for key in ("p2p_sent", "p2p_received", "p2p_bytes_sent", "p2p_bytes_received"):
            stats.setdefault(key, 0)
        self._lock = threading.Lock()
        self._send_locks = [threading.Lock() for _ in range(size)]
        self._seq = 0
        self._sends: dict[tuple[int, int], P2PHandle] = {}  # (dst, seq) -> awaiting its reply
        self._posted: dict[tuple[int, Tag], collections.deque[_Recv]] = {}
        self._arrived: dict[tuple[int, Tag], collections.deque[_Incoming]] = {}
        self._incoming: dict[tuple[int, int], _Incoming] = {}  # (src, seq) -> still arriving
        self._gone: dict[int, BaseException] = {}
        self._refuse: BaseException | None = None

    # framework side ----------------------------------------------------------------------------
    def isend(self, array: np.ndarray | None, dst: int, tag: Tag, tracked: bool = False,
              error: str = "") -> P2PHandle:
        """Send ``array`` (C-contiguous, a dtype of DTYPES) to ``dst``; or, with ``error`` (and
        no array), tell ``dst``'s matching receive that this send failed with that text.

        Raises:
            HorovodInternalError: the job failed or was shut down (its error, at the call).
        """
        with self._lock:
            if self._refuse is not None:
                raise _clone(self._refuse)
            seq = self._seq
            self._seq += 1
            handle = P2PHandle(f"send to rank {dst}, {describe_tag(tag)}", dst, tag, seq, tracked)
            gone = self._gone.get(dst)
            if gone is None and not error:
                self._sends[(dst, seq)] = handle
        if gone is not None:
            handle._finish(None, _clone(gone))
            return handle
        if error or array is None:
            dtype, shape, data = "", (), np.empty(0, np.uint8)
        else:
            dtype, shape, data = _ops.dtype_name(array.dtype), array.shape, _bytes_of(array)
        try:
            with self._send_locks[dst]:
                offset = 0
                while True:  # at least one frame, even for an empty array
                    chunk = data[offset:offset + self._chunk]
                    self._send_ctrl(encode(P2PData(tag, seq, dtype, shape, offset, chunk,
                                                   tracked, error)), dst)
                    offset += chunk.size
                    if offset >= data.size:
                        break
        except RingflowError as exc:
            with self._lock:
                self._sends.pop((dst, seq), None)
            handle._finish(None, exc)
            return handle
        with self._lock:
            self.stats["p2p_sent"] += 1
            self.stats["p2p_bytes_sent"] += data.size
        if error:
            handle._finish(None, TensorError(error))
        return handle

    def irecv(self, src: int, tag: Tag, out: np.ndarray | None = None,
              shape: tuple[int, ...] | None = None, dtype: np.dtype | None = None) -> P2PHandle:
        """Receive the next message of (``src``, ``tag``): into ``out`` if given; else an array of
        ``shape`` (default: the sender's) and the sender's dtype (``dtype``, if given, must be it).

        Raises:
            HorovodInternalError: the job failed or was shut down (its error, at the call).
        """
        handle = P2PHandle(f"receive from rank {src}, {describe_tag(tag)}", src, tag)
        recv = _Recv(handle, src, tag, out, shape, dtype)
        replies: list = []
        finished: list = []
        with self._lock:
            if self._refuse is not None:
                raise _clone(self._refuse)
            arrived = self._arrived.get((src, tag))
            if arrived:
                inc = arrived.popleft()
                if not arrived:
                    del self._arrived[(src, tag)]
                self._match(inc, recv, replies, finished)
                if inc.complete and not inc.dropped:
                    self._complete(inc, replies, finished)
            elif src in self._gone:
                finished.append((handle, None, _clone(self._gone[src])))
            else:
                self._posted.setdefault((src, tag), collections.deque()).append(recv)
        self._flush(replies, finished)
        return handle

    # reader threads ----------------------------------------------------------------------------
    def on_message(self, src: int, msg: P2PData | P2PReply) -> None:
        """A frame from ``src`` (on the transport's thread; never blocks)."""
        if isinstance(msg, P2PReply):
            error = from_wire(msg.error, msg.text) if msg.error else None
            self._finish_send(src, msg.seq, error)
            return
        replies: list = []
        finished: list = []
        with self._lock:
            if self._refuse is not None:
                return
            inc = self._incoming.pop((src, msg.seq), None)
            if inc is None:  # the first chunk of a new message
                inc = _Incoming(src, msg)
                self.stats["p2p_received"] += 1
                posted = self._posted.get((src, msg.tag))
                if posted:
                    recv = posted.popleft()
                    if not posted:
                        del self._posted[(src, msg.tag)]
                    self._match(inc, recv, replies, finished)
                else:
                    self._arrived.setdefault((src, msg.tag), collections.deque()).append(inc)
            self.stats["p2p_bytes_received"] += msg.data.size
            if not inc.dropped:
                inc.write(msg.offset, msg.data)
            else:
                inc.filled = msg.offset + msg.data.size
            if not inc.complete:
                self._incoming[(src, msg.seq)] = inc
            elif inc.recv is not None and not inc.dropped:
                self._complete(inc, replies, finished)
        self._flush(replies, finished)

    def peer_failed(self, peer: int, error: BaseException) -> None:
        """``peer`` failed or said goodbye: fail what is pending with it."""
        finished: list = []
        with self._lock:
            self._gone.setdefault(peer, error)
            for (dst, seq) in [k for k in self._sends if k[0] == peer]:
                finished.append((self._sends.pop((dst, seq)), None, _clone(error)))
            for key in [k for k in self._posted if k[0] == peer]:
                finished.extend((r.handle, None, _clone(error)) for r in self._posted.pop(key))
            for key in [k for k in self._incoming if k[0] == peer]:
                inc = self._incoming.pop(key)
                if inc.recv is not None and not inc.dropped:
                    finished.append((inc.recv.handle, None, _clone(error)))
                else:  # a partial unexpected message can never be completed
                    arrived = self._arrived.get((peer, inc.tag))
                    if arrived is not None and inc in arrived:
                        arrived.remove(inc)
        self._flush([], finished)

    def close(self, error: BaseException) -> None:
        """Fail everything pending with ``error``; later calls raise it (the engine's _close)."""
        finished: list = []
        with self._lock:
            if self._refuse is None:
                self._refuse = error
            finished += [(h, None, _clone(error)) for h in self._sends.values()]
            finished += [(r.handle, None, _clone(error))
                         for q in self._posted.values() for r in q]
            finished += [(inc.recv.handle, None, _clone(error))
                         for inc in self._incoming.values()
                         if inc.recv is not None and not inc.dropped]
            self._sends.clear()
            self._posted.clear()
            self._arrived.clear()
            self._incoming.clear()
        self._flush([], finished)

    # matching (under _lock) --------------------------------------------------------------------
    def _match(self, inc: _Incoming, recv: _Recv, replies: list, finished: list) -> None:
        inc.recv = recv
        if inc.error:  # the sender could not send: fail this receive with its text
            inc.dropped = True
            finished.append((recv.handle, None, TensorError(inc.error)))
            return
        text = self._mismatch(inc, recv)
        if text:
            inc.dropped = True
            finished.append((recv.handle, None, MismatchError(text)))
            replies.append((inc.src, P2PReply(inc.tag, inc.seq, "MismatchError", text)))
            return
        if recv.out is not None and inc.nbytes:
            inc.retarget(recv.out)  # else write() allocates (or keeps a one-chunk message)

    def _mismatch(self, inc: _Incoming, recv: _Recv) -> str:
        size = math.prod(inc.shape)
        sent_dtype = "an unknown dtype" if inc.dtype is None else str(inc.dtype)
        if (recv.size is None or recv.size == size) and (
                recv.dtype is None or recv.dtype == inc.dtype) and inc.dtype is not None:
            return ""
        expected = "any number of" if recv.size is None else str(recv.size)
        dtype = "any dtype" if recv.dtype is None else str(recv.dtype)
        shape = "" if recv.shape is None else f" (shape {recv.shape})"
        return (f"point-to-point message #{inc.seq} from rank {inc.src} to rank {self.rank}, "
                f"{describe_tag(inc.tag)}: rank {inc.src} sent {size} elements of {sent_dtype} "
                f"(shape {inc.shape}), rank {self.rank} expected {expected} elements of {dtype}"
                f"{shape}; give recv an out=, shape= and dtype= that match the send (or no "
                "shape and dtype, to take the sender's)")

    def _complete(self, inc: _Incoming, replies: list, finished: list) -> None:
        recv = cast(_Recv, inc.recv)  # only matched messages complete
        recv.handle.seq, recv.handle.tracked = inc.seq, inc.tracked
        finished.append((recv.handle, inc.value(recv), None))
        replies.append((inc.src, P2PReply(inc.tag, inc.seq, "", "")))

    def _finish_send(self, dst: int, seq: int, error: BaseException | None) -> None:
        with self._lock:
            handle = self._sends.pop((dst, seq), None)
        if handle is not None:
            handle._finish(None, error)

    def _flush(self, replies: list, finished: list) -> None:
        """Outside the lock: send replies, then complete handles (callbacks may call back)."""
        for dst, reply in replies:
            # A sender that has gone fails its side through its own peer failure.
            with contextlib.suppress(RingflowError):
                self._send_ctrl(encode(reply), dst)
        for handle, value, error in finished:
            handle._finish(value, error)
