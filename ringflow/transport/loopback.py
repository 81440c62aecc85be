"""Threads of one process as ranks: the transport the in-process tests run on.

A :class:`LoopbackWorld` holds one FIFO of messages per ordered pair ``(src, dst)``;
``world.transport(rank)`` is the :class:`~ringflow.transport.Transport` of one rank (one thread).

Semantics (the contract of :mod:`ringflow.transport`, made deterministic):

- ``isend`` is *eager*: it copies the bytes into the ``(src, dst)`` FIFO and is complete when it
  returns, so no posting order of sends and receives can deadlock.
- ``irecv`` takes a ticket in posting order; ``wait()`` blocks until the message with that ticket
  has arrived, checks that its size equals the posted buffer (else
  :class:`~ringflow.errors.ProtocolError` naming both sizes and ranks) and copies it in. Receives
  posted on one pair therefore match messages in order, whatever order they are waited in.
- A wait longer than ``timeout`` seconds raises :class:`~ringflow.errors.RingflowTimeoutError`
  naming the peer.
- :meth:`LoopbackWorld.abort` makes every pending and later operation on every rank raise the
  given error (the test harness uses it to release ranks blocked on a failed peer).
- ``close()`` on one rank makes that rank's later operations raise
  :class:`~ringflow.errors.PeerError`, and so do receives from it once its queued messages are
  consumed (like a TCP peer that sent, then hung up).

Cost: one copy of each message into the queue and one out of it; every operation takes one lock
shared by the world (contention is irrelevant at test scale). ``world.sent[(src, dst)]`` counts
``(messages, bytes)`` sent on each pair for structural tests (message counts, neighbours).
"""

from __future__ import annotations

import threading
import time

from ..config import Config
from ..errors import ConfigError, PeerError, ProtocolError, RingflowTimeoutError

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
        # (src, dst) -> {ticket: payload}; tickets number messages of a pair from 0.
        self._queues: dict[tuple[int, int], dict[int, bytes]] = {}
        self._sent_seq: dict[tuple[int, int], int] = {}
        self._posted_seq: dict[tuple[int, int], int] = {}
        #: ``(src, dst) -> (messages, bytes)`` sent so far, for every ordered pair.
        self.sent: dict[tuple[int, int], tuple[int, int]] = {
            (s, d): (0, 0) for s in range(size) for d in range(size)
        }

    def transport(self, rank: int) -> LoopbackTransport:
        """The transport of ``rank`` (0 <= rank < size)."""
        self._check_rank(rank, "rank")
        return LoopbackTransport(self, rank)

    def abort(self, exc: BaseException) -> None:
        """Make every pending and later operation on every rank raise ``exc``."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def reset_counts(self) -> None:
        """Zero :attr:`sent` (e.g. after a warm-up collective)."""
        with self._cond:
            for key in self.sent:
                self.sent[key] = (0, 0)

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

    def _close(self, rank: int) -> None:
        with self._cond:
            self._closed.add(rank)
            self._cond.notify_all()


class LoopbackTransport:
    """One rank of a :class:`LoopbackWorld`."""

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size

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

    def close(self) -> None:
        self.world._close(self.rank)

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
