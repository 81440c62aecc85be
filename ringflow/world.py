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

The driver answers a round of requests only when every live member of the running generation
has asked (or exited). So a worker is placed in a generation only while it waits for one, and
every member of a generation is there to connect to it: a generation never waits for a worker
that is still busy in the previous one. Cost per generation: two store round trips per worker,
plus the engine's connection setup.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import ConfigError
from .topology import RankInfo

__all__ = ["Assignment", "World", "format_assignment", "parse_assignment"]

log = logging.getLogger(__name__)

#: How much longer than the driver's elastic timeout a worker waits for its answer; past it the
#: driver is gone (and the lifeline ends the worker anyway).
ANSWER_MARGIN_S = 60.0

Assignment = tuple[int, RankInfo]


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
    """The generations one elastic worker lives through, over the launcher's ``store``."""

    def __init__(self, store: Any, worker_id: int, timeout_s: float) -> None:
        self.store = store
        self.id = worker_id
        self.timeout_s = timeout_s
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
