"""The elastic driver's loop, whatever starts the workers: ``ringflow-run``'s processes
(:mod:`ringflow.runner.elastic`) or Ray actors (:mod:`ringflow.ray.elastic`).

The driver keeps a pool of workers that grows and shrinks, and answers their requests for a
generation through the job's store (:mod:`ringflow.world` has the protocol); the workers keep
their processes and re-form their world in generations. Where workers may run comes from a
``discover()`` callable, run on a thread of its own every ``poll_s`` (a slow one must not delay
the loop): host name -> slots. How a worker starts and stops is a :class:`Workers`, which reports
each worker's end with :meth:`ElasticDriver.exited`.

The loop (every 20 ms):

1. A worker that exits non-zero blacklists its host name: for good, or with a cooldown range
   ``(LO, HI)`` for ``min(HI, LO * 2**(k-1))`` seconds at its k-th failure. Its peers'
   collectives fail (HorovodInternalError); they roll back and ask for a new generation. A
   worker that exits 0 finished the training: no worker is started after it.
2. Free slots on hosts that are listed and not blacklisted get new workers, up to ``max_np``: a
   host of ``s`` slots runs at most ``s`` live workers, each in the lowest slot not taken.
3. When every live member of the running generation has asked for a new one (or exited), the
   driver answers: the survivors in their old rank order (so rank 0 stays with the oldest
   worker, which holds the committed state), then the newcomers that wait, up to ``max_np``;
   a member whose host left the list is answered ``removed``. Fewer than ``min_np`` waiting: it
   waits for workers up to the elastic timeout, then fails the job. Each generation after the
   first counts against the reset limit.
4. While a generation runs, newcomers waiting to join, or a member's host leaving the list, set
   ``elastic/update``: the workers raise HostsUpdatedInterrupt at their next ``commit()``.

:meth:`ElasticDriver.run` ends when every worker has exited, or once every member of the running
generation has (newcomers still starting are stopped); it returns None if one finished (exit 0,
not removed), else the reason the job failed. It fails at once when a generation has no live
member left (the in-memory state is gone), past the reset limit, or below ``min_np`` for longer
than the elastic timeout; a member that does not ask within the elastic timeout once another
member has asked is stopped (newcomers alone do not start that clock: they wait for the
members' next ``commit()``, however long their steps). At the end every worker is stopped and
its exit waited for.

Error messages name the setting to change in the caller's words (:class:`Names`: ``--min-np``
under ringflow-run, ``min_num_proc`` under Ray).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import LaunchError, RingflowError
from ..topology import RankInfo, place
from ..world import format_assignment
from .hosts import WorkerSpec

__all__ = ["ElasticDriver", "Names", "Policy", "Workers", "elastic_environ"]

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the pool may grow and shrink (``ringflow-run``'s elastic flags, or Ray's settings)."""

    min_np: int
    max_np: int
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    elastic_timeout_s: float = 600.0
    poll_s: float = 1.0


@dataclasses.dataclass(frozen=True)
class Names:
    """What the caller calls the settings the driver's messages tell the user to change."""

    min_np: str = "--min-np"
    reset_limit: str = "--reset-limit"
    elastic_timeout: str = "--elastic-timeout"
    hosts: str = "the discovery script's output"


class Workers(Protocol):
    """How the driver's workers start and stop. Each worker's end is reported, exactly once, with
    :meth:`ElasticDriver.exited` (from any thread)."""

    def start(self, spec: WorkerSpec, env: dict[str, str]) -> None:
        """Start worker ``spec.rank`` (its id) on host ``spec.host``, slot ``spec.local_rank``,
        with ``env`` added to its environment (:func:`elastic_environ`).

        Raises:
            LaunchError: it could not be started (the job fails).
        """

    def stop(self, wid: int) -> None:
        """Stop worker ``wid`` without waiting for it; safe on a worker that has ended."""


def elastic_environ(wid: int, elastic_timeout_s: float) -> dict[str, str]:
    """The variables that make a worker elastic (its id, how long it waits for an answer)."""
    return {"HOROVOD_ELASTIC": "1", "RINGFLOW_ELASTIC_ID": str(wid),
            "RINGFLOW_ELASTIC_TIMEOUT_S": str(elastic_timeout_s)}


@dataclasses.dataclass
class _Worker:
    id: int
    host: str
    slot: int
    code: int | None = None  # its exit code, once it exited
    asked: int = 0  # requests for a generation seen (ringflow.world)
    answered: int = 0
    removed: bool = False

    @property
    def live(self) -> bool:
        return self.code is None


class ElasticDriver:
    """The loop of the module doc over the job's ``store`` (a client of the store the workers
    reach), the hosts ``discover()`` lists (it raises LaunchError when it cannot tell; the hosts
    found before are kept) and the ``workers``. ``exit_wait_s`` bounds the wait for the workers'
    exits once they are stopped at the end."""

    def __init__(self, policy: Policy, store: Any, discover: Callable[[], dict[str, int]],
                 workers: Workers, *, names: Names | None = None,
                 exit_wait_s: float = 15.0) -> None:
        self.policy, self.store, self.discover = policy, store, discover
        self.pool, self.names, self.exit_wait_s = workers, names or Names(), exit_wait_s
        self.store.set("elastic/update", b"-1")
        self.workers: dict[int, _Worker] = {}
        self.exits: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.members: list[int] = []  # the running generation's workers, in rank order
        self.generation = -1
        self.resets = 0
        self.noticed = -1  # the generation asked to re-form last
        self.blacklist: dict[str, float] = {}  # host -> monotonic time it may run workers again
        self.failures: dict[str, int] = {}
        self.first_failure: int | None = None  # the first failed worker's exit code
        self.finished = False  # a worker exited 0
        self.hosts: dict[str, int] = {}
        self.waiting_since: float | None = None
        #: Set (from a signal handler, another thread) to end the job: every worker is stopped.
        self.stop_signal: int | None = None
        self._closed = threading.Event()
        self.started = time.monotonic()

    def exited(self, wid: int, code: int) -> None:
        """Worker ``wid`` ended with exit code ``code`` (negative: killed by that signal)."""
        self.exits.put((wid, code))

    def rank_of(self, wid: int) -> int | None:
        """Worker ``wid``'s rank in the running (or last) generation; None if not a member."""
        return self.members.index(wid) if wid in self.members else None

    # discovery, on a thread of its own: a slow one must not delay the loop ------------------
    def _discover(self) -> None:
        while not self._closed.is_set():
            try:
                self.hosts = dict(self.discover())
            except LaunchError as exc:
                log.warning("%s; keeping the hosts found before", exc)
            self._closed.wait(self.policy.poll_s)

    # workers ---------------------------------------------------------------------------------
    def _spawn(self, host: str, slot: int) -> None:
        wid = len(self.workers)
        slots = max(self.hosts.get(host, 1), slot + 1)
        self.pool.start(WorkerSpec(wid, wid + 1, slot, slots, 0, 1, host),
                        elastic_environ(wid, self.policy.elastic_timeout_s))
        # Its exit is read by this thread only (run's loop): registered before it can be.
        self.workers[wid] = _Worker(wid, host, slot)
        log.info("started worker %d on %s (slot %d)", wid, host, slot)
        if self.generation < 0:
            self.members.append(wid)  # the first generation waits for every first worker

    def _exited(self, wid: int, code: int) -> None:
        worker = self.workers[wid]
        worker.code = code
        if code == 0:  # the training is over, unless it was removed or never joined
            self.finished = self.finished or (wid in self.members and not worker.removed)
            return
        if self.stop_signal is not None or self._closed.is_set():
            return  # stopped by this driver
        if wid in self.members and self.generation >= 0:
            # Its peers may wait for its keys while they connect: end their wait now.
            self.store.set(f"elastic/abort/{self.generation}", b"1")
        count = self.failures[worker.host] = self.failures.get(worker.host, 0) + 1
        lo_hi = self.policy.cooldown
        wait = float("inf") if lo_hi is None else min(lo_hi[1], lo_hi[0] * 2 ** (count - 1))
        self.blacklist[worker.host] = time.monotonic() + wait
        if self.first_failure is None:
            self.first_failure = 128 - code if code < 0 else code
        log.warning("worker %d on %s exited with code %d; host %s is blacklisted %s; the job "
                    "goes on without it", wid, worker.host, code, worker.host,
                    "for good" if lo_hi is None else f"for {wait:.0f} s")

    def _fill(self, now: float) -> None:
        """Start workers on the free slots of listed, not blacklisted hosts, up to max_np."""
        if self.finished:
            return
        live = [w for w in self.workers.values() if w.live]
        for host, slots in list(self.hosts.items()):
            if self.blacklist.get(host, 0.0) > now:
                continue
            taken = {w.slot for w in live if w.host == host}
            for slot in range(slots + len(taken)):
                if len(live) >= self.policy.max_np:
                    return
                if len(taken) >= slots:
                    break
                if slot not in taken:
                    self._spawn(host, slot)
                    live.append(self.workers[len(self.workers) - 1])
                    taken.add(slot)

    # generations -----------------------------------------------------------------------------
    def _form(self, now: float) -> str | None:
        """Answer the waiting workers with a new generation when its time has come; the reason
        the job must fail, if it must."""
        policy, names = self.policy, self.names
        if self.generation < 0 and now - self.started > policy.elastic_timeout_s:
            return (f"no first generation of at least {names.min_np} {policy.min_np} workers "
                    f"within {names.elastic_timeout} {policy.elastic_timeout_s:.0f} s (workers "
                    f"started: {len(self.workers)}); check {names.hosts}")
        live = {wid: w for wid, w in self.workers.items() if w.live}
        for w in live.values():
            w.asked = self.store.add(f"elastic/req/{w.id}", 0)
        waiting = [w for w in live.values() if w.asked > w.answered]
        members = [m for m in self.members if m in live]
        if self.generation >= 0 and not members and not self.finished:
            return self._lost()
        gone = [m for m in members if live[m].host not in self.hosts]
        if not waiting or any(live[m].asked == live[m].answered for m in members):
            newcomers = any(w.id not in self.members for w in waiting)
            if self.generation >= 0 and (newcomers or gone) and self.noticed < self.generation:
                self.noticed = self.generation
                self.store.set("elastic/update", str(self.generation).encode())
                log.info("asking generation %d to re-form (%s)", self.generation,
                         "workers wait to join" if newcomers else "a host left")
            lagging = [m for m in members if live[m].asked == live[m].answered]
            # Only a member that left its generation starts the clock: newcomers alone wait
            # for the members' next commit, however long their steps are.
            if lagging and any(w.id in self.members for w in waiting):
                self.waiting_since = self.waiting_since or now
                if now - self.waiting_since > policy.elastic_timeout_s:
                    log.warning("stopping workers %s: they did not leave generation %d within "
                                "%s while their peers waited", lagging, self.generation,
                                names.elastic_timeout)
                    for m in lagging:
                        self.pool.stop(m)
                    self.waiting_since = now
            return None
        keep = [live[m] for m in members if m not in gone]
        joining = sorted((w for w in waiting if w.id not in self.members), key=lambda w: w.id)
        chosen = (keep + joining)[:policy.max_np]
        if len(chosen) < policy.min_np:
            self.waiting_since = self.waiting_since or now
            if now - self.waiting_since > policy.elastic_timeout_s:
                return (f"only {len(chosen)} workers for at least {names.min_np} "
                        f"{policy.min_np} within {names.elastic_timeout} "
                        f"{policy.elastic_timeout_s:.0f} s")
            return None
        if self.generation >= 0:
            self.resets += 1
            if policy.reset_limit is not None and self.resets > policy.reset_limit:
                return f"the job re-formed more than {names.reset_limit} {policy.reset_limit} times"
        self.generation += 1
        self.waiting_since = None
        hosts = [w.host for w in chosen]
        for rank, w in enumerate(chosen):
            info = place(RankInfo(rank, len(chosen), 0, 0, 0, 0, w.host, "ringflow"), hosts)
            self._answer(w, format_assignment(self.generation, info))
        for m in gone:
            live[m].removed = True
            self._answer(live[m], b"removed")
        self.members = [w.id for w in chosen]
        log.info("generation %d: workers %s (size %d)", self.generation, self.members,
                 len(chosen))
        return None

    def _lost(self) -> str:
        if self.generation < 0:
            return "every worker exited before the first generation formed"
        return (f"every worker of generation {self.generation} is gone, and the training "
                "state with them")

    def _answer(self, worker: _Worker, value: bytes) -> None:
        self.store.set(f"elastic/resp/{worker.id}/{worker.asked}", value)
        worker.answered = worker.asked

    # the whole job ---------------------------------------------------------------------------
    def run(self) -> str | None:
        """Run the job to its end (module doc): None when the training finished, else why the
        job failed (``stop_signal`` set, or every worker failed: see :attr:`first_failure`)."""
        discovery = threading.Thread(target=self._discover, name="ringflow-elastic-discovery",
                                     daemon=True)
        discovery.start()
        failure: str | None = None
        try:
            while self.stop_signal is None:
                now = time.monotonic()
                self._drain()
                if self.workers and not any(w.live for w in self.workers.values()):
                    if not self.finished:
                        failure = self._lost()
                    break
                if self.finished and not any(self.workers[m].live for m in self.members):
                    break  # the training is over: newcomers that never joined are stopped
                self._fill(now)
                failure = self._form(now)
                if failure is not None:
                    break
                time.sleep(_POLL_S)
        except (RingflowError, OSError) as exc:
            failure = f"the elastic driver failed: {exc}"
        finally:
            self._closed.set()
            for w in self.workers.values():
                self.pool.stop(w.id)
            end = time.monotonic() + self.exit_wait_s
            while any(w.live for w in self.workers.values()) and time.monotonic() < end:
                with contextlib.suppress(queue.Empty):
                    self._exited(*self.exits.get(timeout=max(0.0, end - time.monotonic())))
            discovery.join(5.0)
        return failure

    def _drain(self) -> None:
        while True:
            try:
                self._exited(*self.exits.get_nowait())
            except queue.Empty:
                return
