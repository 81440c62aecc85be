"""The Ray resources of one started :class:`~ringflow.ray.RayExecutor` job, and how they end.

:class:`Job` holds the actors (in rank order once ranked), what each reported about itself, the
placement group (and whether the executor created it) and the rendezvous store.
:meth:`Job.close` frees them in this order: each actor shuts ringflow down (``graceful``; bounded
by :data:`STOP_GRACE_S`), every actor is killed (``ray.kill``), the actor processes of this node
are waited for (Ray kills asynchronously; bounded by :data:`EXIT_WAIT_S`), the placement group the
executor created is removed and the store is closed. A Job holds no reference to its executor, so
that a ``weakref.finalize`` of the executor can close it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

__all__ = ["EXIT_WAIT_S", "STOP_GRACE_S", "Job"]

log = logging.getLogger(__name__)

#: How long close() lets the actors shut ringflow down (goodbyes, the timeline) before it kills
#: them; ringflow's own goodbye linger is 2 s.
STOP_GRACE_S = 5.0
#: How long close() waits for the killed actor processes of this node to exit (they were gone
#: 24-41 ms after ray.kill here, 3 actors).
EXIT_WAIT_S = 10.0


class Job:
    """The actors, placement group and store of one started job; :meth:`close` frees them all."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.actors: list[Any] = []  # rank order once ranked
        self.infos: list[dict[str, Any]] = []
        self.placement_group: Any = None
        self.owns_placement_group = False
        self.server: Any = None
        self.local_node = ""
        self.stopped: str | None = None  # why the job is over, once it is
        self.closed = False

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.stopped = self.stopped or "shutdown() was called"
        ray = self.ray
        with contextlib.suppress(Exception):  # Ray may be shut down already (at exit)
            if graceful and self.actors:
                refs = [actor.stop_ringflow.remote() for actor in self.actors]
                ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._wait_for_exit()
        if self.placement_group is not None and self.owns_placement_group:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.close()
        self.actors = []

    def _wait_for_exit(self) -> None:
        """Wait until the actor processes of this node have exited (Ray kills asynchronously)."""
        pids = [i["pid"] for i in self.infos if i.get("node_id") == self.local_node]
        end = time.monotonic() + EXIT_WAIT_S
        while pids and time.monotonic() < end:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.02)
        if pids:
            log.warning("actor processes %s were still running %.0f s after ray.kill", pids,
                        EXIT_WAIT_S)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"  # a zombie has exited; the raylet, its parent, reaps it
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
