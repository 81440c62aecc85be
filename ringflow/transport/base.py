"""What the engine and the algorithms need from a transport, declared as Protocols.

A transport connects the ``size`` ranks of one job. It offers two things:

* :class:`Link` -- point-to-point messages of *exact-size* byte buffers. Messages between one
  pair arrive in the order they were sent, and a receive must be posted with the size the sender
  sends (a different size is a ProtocolError, never a silent truncation). Algorithms
  (:mod:`ringflow.algorithms`) are written once over this interface and import nothing else
  from the transport layer.
* :class:`ControlChannel` -- small messages for the engine (submissions, plans, verdicts,
  heartbeats; at most :data:`MAX_CTRL_BYTES`), delivered to a handler on the transport's own
  thread in the order they were sent, and notice of peers that failed or said goodbye.

:class:`Transport` is both: what :class:`~ringflow.engine.Engine` is given. A transport may also
declare :class:`NativeAllreduce` (MPI: the library's own allreduce), which the executor offers as
one of its allreduce implementations. Capabilities are declared by subclassing these Protocols,
never discovered by probing attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ..ops import ReduceOp

__all__ = ["MAX_CTRL_BYTES", "ControlChannel", "Link", "NativeAllreduce", "Subset", "Transport",
           "Work", "data_wait_s", "heartbeat_interval", "recv", "send", "sendrecv"]

#: The largest control message a transport must carry.
MAX_CTRL_BYTES = 64 * 1024 * 1024


def heartbeat_interval(timeout_s: float) -> float:
    """How often ranks send heartbeats (:mod:`ringflow.liveness`): ``min(1 s, timeout_s / 4)``."""
    return min(1.0, timeout_s / 4)


def data_wait_s(timeout_s: float) -> float:
    """The longest one data-plane wait on a peer lasts: ``timeout_s`` plus two heartbeat
    intervals and a second. A frozen rank is declared by the heartbeats of the rank that watches
    it (rank 0, or every rank for rank 0) within ``timeout_s`` plus two intervals, and that
    verdict aborts every rank's data plane (:meth:`ControlChannel.abort`); a data wait that
    expired first would name the peer it waits for, which in a ring is often a healthy rank
    blocked on the frozen one."""
    return timeout_s + 2 * heartbeat_interval(timeout_s) + 1.0


class Work(Protocol):
    """A pending send or receive."""

    def wait(self) -> None:
        """Block until done. Raises PeerError / RingflowTimeoutError / ProtocolError."""


@runtime_checkable
class Link(Protocol):
    """Point-to-point messages between the ranks ``0 .. size-1``."""

    rank: int
    size: int

    def isend(self, buf: memoryview, dst: int) -> Work:
        """Start sending ``buf``; it must stay unchanged until ``wait()`` returns."""

    def irecv(self, buf: memoryview, src: int) -> Work:
        """Start receiving exactly ``buf.nbytes`` bytes from ``src`` into ``buf``."""

    def close(self) -> None:
        """Release sockets/threads; pending and later operations raise PeerError."""


@runtime_checkable
class ControlChannel(Protocol):
    """The engine's messages: a handler per transport, called on the transport's thread."""

    def send_ctrl(self, payload: bytes, dst: int) -> None:
        """Send 1 to MAX_CTRL_BYTES bytes to ``dst``'s handler. Raises PeerError if ``dst`` has
        gone."""

    def set_ctrl_handler(self, on_ctrl: Callable[[int, bytes], None],
                         on_failure: Callable[[int, BaseException], None]) -> None:
        """Route messages ``(src, payload)`` and peer failures ``(rank, error)`` to callbacks
        that must not block; what arrived before is delivered now, in order. A peer that said
        goodbye fails with ShutdownError, one that vanished with PeerError."""

    def check_peers(self, ranks: Iterable[int] | None = None) -> None:
        """Raise the error of the first of ``ranks`` (default: every peer) that has gone; no
        I/O."""

    def peer_host(self, rank: int) -> str:
        """The name of ``rank``'s host, for error texts: the same on every rank (the name that
        rank gave itself), "" where the transport does not know it."""

    def abort(self, error: BaseException) -> None:
        """The job has failed with ``error``: every pending data-plane send and receive fails
        with it now, and so does every later one and :meth:`check_peers` (control messages and
        goodbyes still go through). Called from any thread."""

    def close(self, linger: float = 2.0) -> None:
        """Say goodbye to every peer, wait up to ``linger`` s for theirs, then close."""


@runtime_checkable
class Transport(Link, ControlChannel, Protocol):
    """A Link and a ControlChannel over the same ranks: what the engine runs on."""


@runtime_checkable
class NativeAllreduce(Protocol):
    """A transport whose library reduces in place itself (MPI's ``MPI_Iallreduce``)."""

    def native_supported(self, dtype: np.dtype, op: ReduceOp) -> bool:
        """Whether :meth:`native_allreduce` can reduce ``dtype`` with ``op``."""

    def native_allreduce(self, flat: np.ndarray, op: ReduceOp) -> None:
        """Reduce the 1-D ``flat`` over every rank, in place, unscaled (AVERAGE as SUM)."""


def send(t: Link, buf: memoryview, dst: int) -> None:
    t.isend(buf, dst).wait()


def recv(t: Link, buf: memoryview, src: int) -> None:
    t.irecv(buf, src).wait()


def sendrecv(t: Link, sbuf: memoryview, dst: int, rbuf: memoryview, src: int) -> None:
    """Send to ``dst`` and receive from ``src`` at the same time (no deadlock in a ring)."""
    r = t.irecv(rbuf, src)
    s = t.isend(sbuf, dst)
    r.wait()
    s.wait()


class Subset:
    """The ranks ``members`` (global ranks, sorted) of ``base`` seen as their own Link.

    Used for process sets: algorithms see ranks 0..len(members)-1. Only the members may use it.
    """

    def __init__(self, base: Link, members: Sequence[int]) -> None:
        self.base = base
        self.members = list(members)
        self.rank = self.members.index(base.rank)
        self.size = len(self.members)

    def isend(self, buf: memoryview, dst: int) -> Work:
        return self.base.isend(buf, self.members[dst])

    def irecv(self, buf: memoryview, src: int) -> Work:
        return self.base.irecv(buf, self.members[src])

    def close(self) -> None:
        """The base link is owned by someone else."""
