"""Threads of one process as ranks: the transport the in-process tests run on.

A :class:`LoopbackWorld` holds one FIFO of messages per ordered pair ``(src, dst)`` and one
mailbox of control messages per rank; ``world.transport(rank)`` is the
:class:`~ringflow.transport.base.Transport` of one rank (one thread, or one
:class:`~ringflow.engine.Engine`).

Link semantics (the contract of :mod:`ringflow.transport.base`, made deterministic):

- ``isend`` is *eager*: it copies the bytes into the ``(src, dst)`` FIFO and is complete when it
  returns, so no posting order of sends and receives can deadlock.
- ``irecv`` takes a ticket in posting order; ``wait()`` blocks until the message with that ticket
  has arrived, checks that its size equals the posted buffer (else
  :class:`~ringflow.errors.ProtocolError` naming both sizes and ranks) and copies it in. Receives
  posted on one pair therefore match messages in order, whatever order they are waited in.
- A wait longer than ``timeout`` seconds raises :class:`~ringflow.errors.RingflowTimeoutError`
  naming the peer.
- :meth:`LoopbackWorld.abort` makes every pending and later operation on every rank raise the
  given error, and reports it to every rank's failure handler for each of its peers (the test
  harness uses it to release ranks blocked on a failed peer).
- ``close()`` on one rank makes that rank's later operations raise
  :class:`~ringflow.errors.PeerError`, and so do receives from it once its queued messages are
  consumed (like a TCP peer that sent, then hung up).

ControlChannel semantics (as :mod:`ringflow.transport.tcp`'s):

- ``send_ctrl`` copies the payload (1 to ``MAX_CTRL_BYTES`` bytes) into ``dst``'s mailbox and
  returns; it never runs ``dst``'s handler on the sender's thread. A rank's mailbox is emptied,
  in arrival order, by that rank's *delivery thread*, started by ``set_ctrl_handler``: what
  arrived before is delivered then (early buffering). Messages of one sender arrive in the order
  they were sent.
- ``close(linger)`` says goodbye: each peer's failure handler gets ``(rank, ShutdownError("rank r
  has shut down"))`` after every message the closing rank sent it, and ``send_ctrl`` to the
  closed rank raises that error. The closing rank keeps delivering until every peer's goodbye
  has been delivered to it, or ``linger`` seconds pass, then stops its delivery thread. Failures
  of peers are not reported to a rank that is closing.
- ``check_peers(ranks)`` raises the goodbye of the first of ``ranks`` that closed, or the
  world's abort error; no waiting.

Cost: one copy of each message into the queue and one out of it; every data operation takes one
lock shared by the world (contention is irrelevant at test scale), a control message its
sender's check of that lock and the receiver's mailbox lock. ``world.sent[(src, dst)]`` counts
``(messages, bytes)`` of data sent on each pair for structural tests (message counts,
neighbours), ``world.ctrl_sent[(src, dst)]`` the same for control messages.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable

from ..config import Config
from ..errors import ConfigError, PeerError, ProtocolError, RingflowTimeoutError, ShutdownError
from .base import MAX_CTRL_BYTES, Transport

log = logging.getLogger(__name__)

__all__ = ["LoopbackTransport", "LoopbackWorld", "create"]


class _Done:
    """A send that completed when it was posted."""

    def wait(self) -> None:
        return None


class _Recv:
    def __init__(self, world: LoopbackWorld, buf: memoryview, src: int, dst: int, ticket: int):
        self._world = world
        self._buf = buf
        self._src = src
        self._dst = dst
        self._ticket = ticket
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._world._deliver(self._buf, self._src, self._dst, self._ticket)
            self._done = True


class _Mailbox:
    """One rank's control messages and peer failures, in arrival order.

    Items are ``(src, payload)`` (a message) or ``(src, error)`` (that peer said goodbye or
    failed). Lock order: the world's lock, then a mailbox's; never the other way round.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: collections.deque[tuple[int, bytes | BaseException]] = collections.deque()
        self.stopped = False

    def put(self, src: int, item: bytes | BaseException) -> None:
        with self.cond:
            if not self.stopped:
                self.items.append((src, item))
                self.cond.notify_all()


class LoopbackWorld:
    """``size`` ranks that live as threads of this process."""

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        if size < 1:
            raise ConfigError(f"a loopback world needs at least 1 rank, got size={size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed: set[int] = set()
        self._aborted: dict[int, BaseException] = {}  # rank -> its job's error (abort())
        self._mail = [_Mailbox() for _ in range(size)]
        # (src, dst) -> {ticket: payload}; tickets number messages of a pair from 0.
        self._queues: dict[tuple[int, int], dict[int, bytes]] = {}
        self._sent_seq: dict[tuple[int, int], int] = {}
        self._posted_seq: dict[tuple[int, int], int] = {}
        #: ``(src, dst) -> (messages, bytes)`` sent so far, for every ordered pair.
        self.sent: dict[tuple[int, int], tuple[int, int]] = {
            (s, d): (0, 0) for s in range(size) for d in range(size)
        }
        #: The same for control messages (``send_ctrl``).
        self.ctrl_sent: dict[tuple[int, int], tuple[int, int]] = dict(self.sent)

    def transport(self, rank: int) -> LoopbackTransport:
        """The transport of ``rank`` (0 <= rank < size)."""
        self._check_rank(rank, "rank")
        return LoopbackTransport(self, rank)

    def abort(self, exc: BaseException) -> None:
        """Make every pending and later operation on every rank raise ``exc``, and report it to
        every rank's failure handler once for each of its peers (the first abort wins)."""
        with self._cond:
            if self._error is not None:
                return
            self._error = exc
            self._cond.notify_all()
            for rank, box in enumerate(self._mail):
                for peer in range(self.size):
                    if peer != rank:
                        box.put(peer, exc)

    def reset_counts(self) -> None:
        """Zero :attr:`sent` and :attr:`ctrl_sent` (e.g. after a warm-up collective)."""
        with self._cond:
            for key in self.sent:
                self.sent[key] = (0, 0)
                self.ctrl_sent[key] = (0, 0)

    # -- used by LoopbackTransport ---------------------------------------------------------------

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise ConfigError(
                f"{what} {rank} is outside the loopback world of size {self.size}; "
                f"expected 0 <= {what} < {self.size}"
            )

    def _check_open(self, rank: int) -> None:
        # Called with the lock held.
        if self._error is not None:
            raise self._error
        if rank in self._aborted:
            raise self._aborted[rank]
        if rank in self._closed:
            raise PeerError(f"rank {rank}: the loopback transport was closed; create a new one")

    def _post_send(self, buf: memoryview, src: int, dst: int) -> None:
        self._check_rank(dst, "destination rank")
        payload = bytes(buf)  # the eager copy: the caller may reuse buf at once
        key = (src, dst)
        with self._cond:
            self._check_open(src)
            if dst in self._closed:
                raise PeerError(
                    f"rank {src} cannot send {len(payload)} bytes to rank {dst}: rank {dst} closed "
                    f"its transport"
                )
            seq = self._sent_seq.get(key, 0)
            self._queues.setdefault(key, {})[seq] = payload
            self._sent_seq[key] = seq + 1
            messages, nbytes = self.sent[key]
            self.sent[key] = (messages + 1, nbytes + len(payload))
            self._cond.notify_all()

    def _post_recv(self, src: int, dst: int) -> int:
        self._check_rank(src, "source rank")
        key = (src, dst)
        with self._cond:
            self._check_open(dst)
            ticket = self._posted_seq.get(key, 0)
            self._posted_seq[key] = ticket + 1
            return ticket

    def _deliver(self, buf: memoryview, src: int, dst: int, ticket: int) -> None:
        key = (src, dst)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                self._check_open(dst)
                queue = self._queues.get(key)
                if queue is not None and ticket in queue:
                    payload = queue.pop(ticket)
                    break
                if src in self._closed:
                    raise PeerError(
                        f"rank {dst} waits for message #{ticket} from rank {src}, but rank {src} "
                        f"closed its transport after sending {self._sent_seq.get(key, 0)} messages"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingflowTimeoutError(
                        f"rank {dst} waited {self.timeout:g}s for message #{ticket} "
                        f"({buf.nbytes} bytes) from rank {src}, which did not send it; check that "
                        f"rank {src} runs the same collectives in the same order, or raise "
                        f"RINGFLOW_TIMEOUT_S"
                    )
                self._cond.wait(left)
        if len(payload) != buf.nbytes:
            raise ProtocolError(
                f"rank {dst} posted a receive of {buf.nbytes} bytes from rank {src}, but "
                f"rank {src} sent {len(payload)} bytes (message #{ticket}); the ranks disagree "
                f"on the tensor's size or the order of collectives"
            )
        if payload:
            buf.cast("B")[:] = payload

    def _post_ctrl(self, payload: bytes, src: int, dst: int) -> None:
        with self._cond:
            self._check_open(src)
            if dst in self._closed:
                raise _goodbye(dst)
            messages, nbytes = self.ctrl_sent[(src, dst)]
            self.ctrl_sent[(src, dst)] = (messages + 1, nbytes + len(payload))
            # Under the world's lock, so that a goodbye of src cannot overtake it.
            self._mail[dst].put(src, payload)

    def _abort_rank(self, rank: int, error: BaseException) -> None:
        with self._cond:
            self._aborted.setdefault(rank, error)
            self._cond.notify_all()

    def _check_peers(self, rank: int, ranks: Iterable[int]) -> None:
        with self._cond:
            if self._error is not None:
                raise self._error
            if rank in self._aborted:
                raise self._aborted[rank]
            for peer in ranks:
                if peer != rank and peer in self._closed:
                    raise _goodbye(peer)

    def _close(self, rank: int) -> None:
        """``rank`` leaves: later operations with it fail, and its peers get its goodbye."""
        with self._cond:
            if rank in self._closed:
                return
            self._closed.add(rank)
            self._cond.notify_all()
            for peer, box in enumerate(self._mail):
                if peer != rank:  # a peer that is closing itself lingers for it
                    box.put(rank, _goodbye(rank))


def _goodbye(rank: int) -> ShutdownError:
    return ShutdownError(f"rank {rank} has shut down")


class LoopbackTransport(Transport):
    """One rank of a :class:`LoopbackWorld`: a Link and a ControlChannel (see the module doc)."""

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.closed = False
        self._box = world._mail[rank]
        self._on_ctrl: Callable[[int, bytes], None] | None = None
        self._on_failure: Callable[[int, BaseException], None] | None = None
        self._delivery: threading.Thread | None = None
        self._farewells: set[int] = set()  # peers whose goodbye or failure was delivered

    def isend(self, buf: memoryview, dst: int) -> _Done:
        self.world._post_send(buf, self.rank, dst)
        return _Done()

    def irecv(self, buf: memoryview, src: int) -> _Recv:
        if buf.readonly:
            raise ProtocolError(
                f"rank {self.rank} posted a receive from rank {src} into a read-only buffer; "
                f"pass a writable memoryview"
            )
        ticket = self.world._post_recv(src, self.rank)
        return _Recv(self.world, buf, src, self.rank, ticket)

    # control channel ---------------------------------------------------------------------------
    def send_ctrl(self, payload: bytes, dst: int) -> None:
        """Put ``payload`` in ``dst``'s mailbox; ``dst``'s delivery thread hands it on.

        Raises:
            ProtocolError: the payload is empty or larger than ``MAX_CTRL_BYTES``.
            ConfigError: ``dst`` is this rank or outside the world.
            ShutdownError: ``dst`` has closed (said goodbye).
            PeerError: this rank has closed, or the world's abort error.
        """
        payload = bytes(payload)
        if not 0 < len(payload) <= MAX_CTRL_BYTES:
            raise ProtocolError(f"a control message must have 1 to {MAX_CTRL_BYTES} bytes, not "
                                f"{len(payload)}")
        self.world._check_rank(dst, "destination rank")
        if dst == self.rank:
            raise ConfigError(f"rank {dst} is not a peer of rank {self.rank} (size {self.size})")
        self.world._post_ctrl(payload, self.rank, dst)

    def set_ctrl_handler(
        self,
        on_ctrl: Callable[[int, bytes], None],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        """Route control messages (src, payload) and peer failures (rank, error) to callbacks.

        They run on this rank's delivery thread (started here), one at a time, in arrival order,
        beginning with what arrived before; they must not block.
        """
        with self._box.cond:
            self._on_ctrl, self._on_failure = on_ctrl, on_failure
            start = self._delivery is None and not self.closed
            if start:
                self._delivery = threading.Thread(target=self._delivery_loop, daemon=True,
                                                  name=f"ringflow-loopback-{self.rank}-ctrl")
        if start:
            self._delivery.start()

    def peer_host(self, rank: int) -> str:
        """Not known here ("": errors name the rank alone)."""
        return ""

    def check_peers(self, ranks: Iterable[int] | None = None) -> None:
        """Raise the goodbye of the first of ``ranks`` (default: every peer) that has closed, or
        the world's abort error; no waiting."""
        self.world._check_peers(self.rank, range(self.size) if ranks is None else ranks)

    def abort(self, error: BaseException) -> None:
        """See :meth:`ControlChannel.abort`: this rank's data-plane waits fail with ``error``."""
        self.world._abort_rank(self.rank, error)

    def _delivery_loop(self) -> None:
        box = self._box
        while True:
            with box.cond:
                while not box.items and not box.stopped:
                    box.cond.wait()
                if box.stopped:
                    return
                src, item = box.items.popleft()
                on_ctrl, on_failure = self._on_ctrl, self._on_failure
            try:
                if isinstance(item, bytes):
                    on_ctrl(src, item)  # type: ignore[misc]
                elif not self.closed:
                    on_failure(src, item)  # type: ignore[misc]
            except Exception:  # a broken handler must not stop the deliveries after it
                log.exception("rank %d: the control handler failed on a message from rank %d",
                              self.rank, src)
            if not isinstance(item, bytes):
                with box.cond:
                    self._farewells.add(src)
                    box.cond.notify_all()

    def close(self, linger: float = 2.0) -> None:
        """Say goodbye to every peer; with a handler set, deliver what arrives until every
        peer's goodbye (or failure) has been delivered, or ``linger`` s pass; then stop."""
        if self.closed:
            return
        self.closed = True
        self.world._close(self.rank)
        box, peers = self._box, self.size - 1
        deadline = time.monotonic() + linger
        with box.cond:
            if self._delivery is not None:
                while len(self._farewells) < peers and (left := deadline - time.monotonic()) > 0:
                    box.cond.wait(left)
            box.stopped = True
            box.items.clear()
            box.cond.notify_all()
        thread = self._delivery
        if thread is not None and thread is not threading.current_thread():
            # A handler still running past the linger is left to finish on its own.
            thread.join(max(0.1, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return f"LoopbackTransport(rank={self.rank}, size={self.size})"


def create(
    rank: int,
    size: int,
    store: object = None,
    config: Config | None = None,
    world: LoopbackWorld | None = None,
) -> LoopbackTransport:
    """Registry factory. ``world`` is shared by the ranks; a world of size 1 is made if absent.

    ``store`` is unused (threads of one process need no rendezvous); ``config.timeout_s`` sets the
    timeout of a world created here.
    """
    if world is None:
        if size != 1:
            raise ConfigError(
                f"the loopback transport connects threads of one process; rank {rank} of {size} "
                f"needs world=LoopbackWorld({size}) shared by all ranks "
                f"(ringflow.testing.run_ranks does this), or RINGFLOW_TRANSPORT=tcp for "
                f"separate processes"
            )
        world = LoopbackWorld(1, timeout=config.timeout_s if config is not None else 30.0)
    if world.size != size:
        raise ConfigError(
            f"loopback world has {world.size} ranks but rank {rank} was created with size={size}; "
            f"pass the same size"
        )
    return world.transport(rank)
