"""Liveness: heartbeats between every rank and rank 0, and the verdict on a silent peer.

Rank 0 expects to hear from every worker, and every worker from rank 0: any control message
counts, and a thread sends a :class:`~ringflow.messages.Heartbeat` every ``interval`` =
``min(1 s, timeout_s / 4)`` so that an idle job stays heard. A peer is frozen (SIGSTOP, a
livelock, an overloaded host) when it has owed a heartbeat for longer than ``timeout_s``: when
nothing came for ``timeout_s + interval``. The heartbeat thread itself checks
(:meth:`Liveness.silent`) at every beat, so the verdict comes while the engine thread is blocked
in a data-plane wait: between ``timeout_s`` and ``timeout_s + 2 interval`` (at most 2 s more)
after the peer froze, never sooner. Its text is the same on every rank that watches that peer
(for a frozen rank 0, every rank), so survivors that decide without rank 0 still agree. It names
the peer's host where the transport knows it: between hosts, a silent peer is as often an
unreachable host (a link down, a partition, a host that lost power) as a frozen process. A dead
peer is found sooner, by its transport (a closed connection).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from .errors import PeerError
from .transport.base import heartbeat_interval

__all__ = ["Liveness"]


class Liveness:
    """When each peer was last heard of; the heartbeat thread."""

    def __init__(self, rank: int, size: int, timeout_s: float,
                 host: Callable[[int], str] = lambda _rank: "") -> None:
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self._host = host
        self.interval = heartbeat_interval(timeout_s)
        self._last_heard: dict[int, float] = {}
        self.follow(0)
        self._stop = threading.Event()

    def follow(self, coordinator: int, gone: Iterable[int] = ()) -> None:
        """Watch the peers of a job coordinated by ``coordinator``: every live rank if this is
        it, else just the coordinator; ranks in ``gone`` left on purpose."""
        now = time.monotonic()
        left = set(gone)
        peers = ([r for r in range(self.size) if r != self.rank and r not in left]
                 if coordinator == self.rank else [coordinator])
        self._last_heard = {r: now for r in peers}

    def heard(self, src: int) -> None:
        if src in self._last_heard:
            self._last_heard[src] = time.monotonic()

    def forget(self, peer: int) -> None:
        """``peer`` said goodbye: its silence is no sign of a frozen process from now on."""
        if peer in self._last_heard:
            self._last_heard[peer] = math.inf  # (the dict keeps its size: silent() iterates it)

    def silent(self) -> tuple[int, PeerError] | None:
        """The first peer that has owed a heartbeat for longer than ``timeout_s``, and its error
        (one text wherever it is found), if any."""
        now = time.monotonic()
        for peer, heard in list(self._last_heard.items()):
            if now - heard > self.timeout_s + self.interval:
                host = self._host(peer)
                unreachable = f", or host {host} cannot be reached" if host else ""
                return peer, PeerError(
                    f"rank {peer} has not responded for more than {self.timeout_s:g} s: it is "
                    f"frozen or overloaded{unreachable} (RINGFLOW_TIMEOUT_S sets this limit)")
        return None

    def start(self, owner: object, beat: Callable[[object], None], name: str) -> None:
        """Call ``beat(owner)`` every ``interval`` until :meth:`stop` or ``owner`` is gone
        (the thread holds only a weak reference to it)."""
        if self.size == 1:
            return
        ref = weakref.ref(owner)
        threading.Thread(target=self._run, args=(ref, beat), name=name, daemon=True).start()

    def _run(self, ref: weakref.ReferenceType, beat: Callable[[object], None]) -> None:
        while not self._stop.wait(self.interval):
            owner = ref()
            if owner is None:
                return
            beat(owner)
            del owner

    def stop(self) -> None:
        self._stop.set()
