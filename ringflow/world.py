"""An elastic worker's generations: the world it belongs to re-forms while its process lives on.

Under ``ringflow-run --min-np/--max-np`` (the driver, :mod:`ringflow.runner.elastic`) a worker
has a stable id (``RINGFLOW_ELASTIC_ID``), not a rank: each *generation* of the job gives it a
rank, a size and local/cross values, or removes it. :func:`ringflow.runtime.init` asks the
:class:`World` for the next generation instead of reading ``RINGFLOW_RANK``, and builds a fresh
engine and fresh connections for it under the key prefix ``elastic<g>/``;
:func:`ringflow.runtime.shutdown` ends the engine of the current one (its pending operations
fail with the usual error). The store connection, the worker id and the process stay.

Protocol (keys in the launcher's store, which outlives every generation; values are text):

1. ``elastic/req/<id>`` = ``n``: the worker asks for a generation for the n-th time (at its
   first ``init()``, and at each ``init()`` after a reset) and then waits, at most
   ``RINGFLOW_ELASTIC_TIMEOUT_S`` plus a margin, for
2. ``elastic/resp/<id>/<n>`` = ``"g rank size local_rank local_size cross_rank cross_size
   host"``, or ``"removed"`` (its host left the discovery script's list: ``init()`` ends the
   process with exit code 0, as Horovod's removed workers end).
3. ``elastic/update`` = ``g``: generation ``g`` must re-form (workers wait to join, or a host
   left). ``State.commit()`` checks it on every rank and agrees through an allreduce (max).

4. ``elastic/abort/<g>`` = 1: a member of generation ``g`` exited with an error. The engine of
   ``g`` sees the store through :class:`GenerationStore`, whose waits for a key end at once with
   PeerError then: a member that dies while the others connect costs them 0.1 s, not
   ``RINGFLOW_TIMEOUT_S`` (measured before: 30 s).

The driver answers a round of requests only when every live member of the running generation
has asked (or exited). So a worker is placed in a generation only while it waits for one, and
every member of a generation is there to connect to it: a generation never waits for a worker
that is still busy in the previous one. Cost per generation: two store round trips per worker,
plus the engine's connection setup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import ConfigError, PeerError, RingflowTimeoutError
from .topology import RankInfo

__all__ = ["Assignment", "GenerationStore", "World", "format_assignment", "parse_assignment"]

log = logging.getLogger(__name__)

#: How much longer than the driver's elastic timeout a worker waits for its answer; past it the
#: driver is gone (and the lifeline ends the worker anyway).
ANSWER_MARGIN_S = 60.0

#: How often a wait of a generation's engine for a key checks whether the generation is lost.
ABORT_POLL_S = 0.1

Assignment = tuple[int, RankInfo]
_T = TypeVar("_T")


def format_assignment(generation: int, info: RankInfo) -> bytes:
    """The driver's answer placing a worker in ``generation`` as ``info`` says."""
    return (f"{generation} {info.rank} {info.size} {info.local_rank} {info.local_size} "
            f"{info.cross_rank} {info.cross_size} {info.hostname}").encode()


def parse_assignment(value: bytes) -> Assignment | None:
    """``(generation, info)`` from the driver's answer; None for ``removed``.

    Raises:
        ConfigError: the answer is malformed (a driver of another ringflow version).
    """
    text = value.decode()
    if text == "removed":
        return None
    parts = text.split(" ")
    try:
        g, rank, size, lrank, lsize, crank, csize = (int(p) for p in parts[:7])
        host = parts[7]
    except (ValueError, IndexError):
        raise ConfigError(f"the elastic driver's answer {text!r} is not 'g rank size local_rank "
                          "local_size cross_rank cross_size host'; are the launcher and the "
                          "workers the same ringflow version?") from None
    return g, RankInfo(rank, size, lrank, lsize, crank, csize, host, "ringflow")


class World:
    """The generations one elastic worker lives through, over the launcher's ``store``
    (``default_timeout_s``: its waits' default, ``RINGFLOW_TIMEOUT_S``)."""

    def __init__(self, store: Any, worker_id: int, timeout_s: float,
                 default_timeout_s: float = 30.0) -> None:
        self.store = store
        self.id = worker_id
        self.timeout_s = timeout_s
        self.default_timeout_s = default_timeout_s
        self.generation = -1  # the one joined last
        self._asked = 0

    def join(self) -> Assignment | None:
        """Ask the driver for the next generation and wait for it: ``(generation, info)``, or
        None when this worker is removed from the job.

        Raises:
            RingflowTimeoutError: no answer within the elastic timeout (plus a margin).
        """
        self._asked += 1
        self.store.set(f"elastic/req/{self.id}", str(self._asked).encode())
        log.debug("worker %d asks for a generation after %d", self.id, self.generation)
        answer = parse_assignment(self.store.get(f"elastic/resp/{self.id}/{self._asked}",
                                                 timeout=self.timeout_s + ANSWER_MARGIN_S))
        if answer is not None:
            self.generation = answer[0]
        return answer

    def update_pending(self) -> bool:
        """Whether the driver asked the running generation to re-form."""
        return self.generation >= 0 and self.store.add("elastic/update", 0) >= self.generation

    def store_of(self, generation: int) -> GenerationStore:
        """The store as the engine of ``generation`` is to see it."""
        return GenerationStore(self.store, generation, self.default_timeout_s)


class GenerationStore:
    """The launcher's store for the engine of one generation: the same keys, but a wait for a
    key ends with PeerError as soon as the driver says the generation lost a member
    (``elastic/abort/<g>``), checked every :data:`ABORT_POLL_S`. ``close()`` leaves the
    launcher's store open (the next generation uses it)."""

    def __init__(self, store: Any, generation: int, default_timeout_s: float) -> None:
        self._store = store
        self.generation = generation
        self._default = default_timeout_s

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def delete(self, key: str) -> bool:
        return bool(self._store.delete(key))

    def close(self) -> None:
        pass

    def local_address(self) -> str:  # the TCP transport binds where the store is reached
        return str(self._store.local_address())

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._waiting(lambda t: self._store.get(key, timeout=t), [key], timeout)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._waiting(lambda t: self._store.wait(keys, timeout=t), list(keys), timeout)

    def _waiting(self, call: Callable[[float], _T], keys: list[str],
                 timeout: float | None) -> _T:
        total = self._default if timeout is None else timeout
        end = time.monotonic() + total
        while True:
            try:
                return call(max(0.0, min(ABORT_POLL_S, end - time.monotonic())))
            except RingflowTimeoutError:
                if self._store.add(f"elastic/abort/{self.generation}", 0) > 0:
                    raise PeerError(
                        f"generation {self.generation} of the elastic job lost a worker (the "
                        f"driver saw it exit) while this rank waited for {keys[0]!r}"
                        ) from None
                if time.monotonic() >= end:
                    raise RingflowTimeoutError(
                        f"store key {keys[0]!r} was not set within {total:g} s; the process "
                        "that sets it may have failed (see its log) or needs longer: raise "
                        "RINGFLOW_TIMEOUT_S") from None
