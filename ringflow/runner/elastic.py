"""The elastic driver: ``ringflow-run --min-np N --max-np M --host-discovery-script S``.

The launcher keeps the job's store and a pool of workers that grows and shrinks; the workers
keep their processes and re-form their world in generations (:mod:`ringflow.world` has the
store protocol). Every ``poll_s`` the discovery script prints the hosts that may run workers, one
``HOST[:SLOTS]`` a line (``--slots-per-host`` where a line gives none); on this machine one may
list it under several names (``localhost``, ``127.0.0.1``, its host name), each with its own
slots, and each name counts as a host of its own (its own local ranks, its own blacklisting).

The loop (every 20 ms):

1. A worker that exits non-zero blacklists its host name: for good, or with
   ``--blacklist-cooldown-range LO HI`` for ``min(HI, LO * 2**(k-1))`` seconds at its k-th
   failure. Its peers' collectives fail (HorovodInternalError); they roll back and ask for a
   new generation. A worker that exits 0 finished the training: no worker is started after it.
2. Free slots on hosts that are listed and not blacklisted get new workers, up to ``--max-np``.
3. When every live member of the running generation has asked for a new one (or exited), the
   driver answers: the survivors in their old rank order (so rank 0 stays with the oldest
   worker, which holds the committed state), then the newcomers that wait, up to ``--max-np``;
   a member whose host left the list is answered ``removed``. Fewer than ``--min-np`` waiting:
   it waits for workers up to ``--elastic-timeout``, then fails the job. Each generation after
   the first counts against ``--reset-limit``.
4. While a generation runs, newcomers waiting to join, or a member's host leaving the list, set
   ``elastic/update``: the workers raise HostsUpdatedInterrupt at their next ``commit()``.

The job ends when every worker has exited, or once every member of the running generation
has (newcomers still starting are stopped): code 0 if one finished (exit 0, not removed), else
the first failure's. It fails at once, stopping every worker, when a generation has no live
member left (the in-memory state is gone), past the reset limit, or below ``--min-np`` for
longer than ``--elastic-timeout``; a member that does not ask within ``--elastic-timeout``
once another member has asked is stopped (newcomers alone do not start that clock: they wait for
the members' next ``commit()``, however long their steps).

Workers run under the supervisor, on this machine or over ssh on the listed host (the remote
bootstrap of :mod:`.remote`, as ``-H`` jobs do; ``-p``, ``-i``, ``--ssh-config-file``, ``-x``
apply), with the environment contract of :mod:`.launch`, plus ``RINGFLOW_ELASTIC_ID`` and
``RINGFLOW_ELASTIC_TIMEOUT_S``. Each has a job id of its own (``RINGFLOW_JOB_ID``, which names its
shared-memory segments): the supervisor of a worker that died removes that worker's names in
/dev/shm, never its live peers'. Output lines are prefixed with the worker id, which stays while
ranks change.

Where the store listens is decided once, at the start: on ``--network-interface``'s address if
given, else on the address that reaches the first other host the discovery script lists then,
else (only this machine listed, or no other host resolves) on 127.0.0.1, and then a host that is
not this machine is ignored with a warning that says to pass ``--network-interface``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ..errors import LaunchError, RingflowError
from ..topology import RankInfo, place
from ..world import format_assignment
from .hosts import Host, WorkerSpec, is_local, parse_hosts
from .launch import DEFAULT_GRACE_S, LocalJob, start_store
from .netif import interface_ipv4, store_address
from .ssh import SshOptions

__all__ = ["ElasticSettings", "discover", "run_elastic"]

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """What ``--min-np``, ``--max-np`` and the other elastic flags ask for."""

    min_np: int
    max_np: int
    discovery_script: str
    slots_per_host: int = 1
    reset_limit: int | None = None
    cooldown: tuple[float, float] | None = None
    elastic_timeout_s: float = 600.0
    poll_s: float = 1.0
    #: How workers on other hosts are reached (``-p``, ``-i``, ``--ssh-config-file``, ``-x``).
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)
    #: ``--network-interface``: where the store listens (see the module doc).
    network_interface: str | None = None


def discover(script: str, slots_per_host: int, timeout_s: float = 10.0) -> dict[str, int]:
    """The hosts the discovery script lists now: name -> slots.

    Raises:
        LaunchError: the script failed, timed out or printed a line that is not HOST[:SLOTS].
    """
    try:
        done = subprocess.run([script], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"the host discovery script {script!r} failed: {exc}") from exc
    if done.returncode != 0:
        raise LaunchError(f"the host discovery script {script!r} exited with code "
                          f"{done.returncode}: {done.stderr.decode(errors='replace')[-200:]}")
    hosts: dict[str, int] = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        host: Host = parse_hosts(line)[0]
        given = line.rpartition(":")[2].isdigit() and not line.endswith("]")
        hosts[host.name] = host.slots if given else slots_per_host
    return hosts


@dataclasses.dataclass
class _Worker:
    id: int
    host: str
    slot: int
    job: LocalJob
    code: int | None = None  # its exit code, once it exited
    asked: int = 0  # requests for a generation seen (ringflow.world)
    answered: int = 0
    removed: bool = False

    @property
    def live(self) -> bool:
        return self.code is None


class _Driver:
    def __init__(self, command: Sequence[str], settings: ElasticSettings,
                 base_env: Mapping[str, str], stdout: IO[str] | None, stderr: IO[str] | None,
                 grace_s: float, start_timeout_s: float) -> None:
        self.command, self.settings = list(command), settings
        self.base_env, self.stdout, self.stderr = dict(base_env), stdout, stderr
        self.grace_s = grace_s
        if settings.ssh.connect_timeout is None:
            settings = dataclasses.replace(settings, ssh=dataclasses.replace(
                settings.ssh, connect_timeout=start_timeout_s))
            self.settings = settings
        self.secret, self.server = start_store([], None, start_timeout_s,
                                               host=self._listen_on(settings))
        #: The store is on loopback: hosts other than this machine cannot join.
        self.local_only = self.server.host == "127.0.0.1"
        from ..rendezvous import TCPStore

        self.store = TCPStore(self.server.host, self.server.port, self.secret, start_timeout_s)
        self.store.set("elastic/update", b"-1")
        self.job_id = secrets.token_hex(8)
        self.workers: dict[int, _Worker] = {}
        self.exits: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.members: list[int] = []  # the running generation's workers, in rank order
        self.generation = -1
        self.resets = 0
        self.noticed = -1  # the generation asked to re-form last
        self.blacklist: dict[str, float] = {}  # host -> monotonic time it may run workers again
        self.failures: dict[str, int] = {}
        self.first_failure: int | None = None
        self.finished = False  # a worker exited 0
        self.hosts: dict[str, int] = {}
        self.warned: set[str] = set()
        self.waiting_since: float | None = None
        self.stop_signal: int | None = None
        self._closed = threading.Event()
        self.started = time.monotonic()

    @staticmethod
    def _listen_on(settings: ElasticSettings) -> str:
        """The store's address (see the module doc): it cannot move once workers know it."""
        if settings.network_interface:
            return interface_ipv4(settings.network_interface)
        try:
            first = discover(settings.discovery_script, settings.slots_per_host)
        except LaunchError:
            first = {}  # the loop says so, every poll
        try:
            return store_address([h for h in first if not is_local(h)])
        except LaunchError as exc:  # no other host listed resolves: none can join
            log.warning("%s; the store listens on 127.0.0.1", exc)
            return "127.0.0.1"

    # discovery, on a thread of its own: a slow script must not delay the loop ---------------
    def _discover(self) -> None:
        while not self._closed.is_set():
            try:
                found = discover(self.settings.discovery_script, self.settings.slots_per_host)
            except LaunchError as exc:
                log.warning("%s; keeping the hosts found before", exc)
            else:
                for host in [h for h in found if self.local_only and not is_local(h)]:
                    if host not in self.warned:
                        self.warned.add(host)
                        log.warning("ignoring host %r of the discovery script: the job's store "
                                    "listens on 127.0.0.1, since the script listed no other "
                                    "host at the start; pass --network-interface NAME to let "
                                    "other hosts join", host)
                    del found[host]
                self.hosts = found
            self._closed.wait(self.settings.poll_s)

    # workers ---------------------------------------------------------------------------------
    def _spawn(self, host: str, slot: int) -> None:
        wid = len(self.workers)
        slots = max(self.hosts.get(host, 1), slot + 1)
        spec = WorkerSpec(wid, wid + 1, slot, slots, 0, 1, host)
        env = {**self.base_env, "HOROVOD_ELASTIC": "1", "RINGFLOW_ELASTIC_ID": str(wid),
               "RINGFLOW_ELASTIC_TIMEOUT_S": str(self.settings.elastic_timeout_s)}
        job = LocalJob(self.command, [spec], secret=self.secret,
                       rendezvous=(self.server.host, self.server.port),
                       job_id=f"{self.job_id}w{wid}",
                       base_env=env, stdout=self.stdout, stderr=self.stderr,
                       grace_s=self.grace_s, ssh=self.settings.ssh)
        job.start()
        worker = _Worker(wid, host, slot, job)
        self.workers[wid] = worker
        log.info("started worker %d on %s (slot %d)", wid, host, slot)
        threading.Thread(target=self._wait, args=(worker,), name=f"ringflow-elastic-{wid}",
                         daemon=True).start()
        if self.generation < 0:
            self.members.append(wid)  # the first generation waits for every first worker

    def _wait(self, worker: _Worker) -> None:
        end = worker.job.wait().exits[0]  # None: stopped by this driver (job.stop)
        self.exits.put((worker.id, -signal.SIGTERM if end is None else end.returncode))

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
        lo_hi = self.settings.cooldown
        wait = float("inf") if lo_hi is None else min(lo_hi[1], lo_hi[0] * 2 ** (count - 1))
        self.blacklist[worker.host] = time.monotonic() + wait
        if self.first_failure is None:
            self.first_failure = 128 - code if code < 0 else code
        log.warning("worker %d on %s exited with code %d; host %s is blacklisted %s; the job "
                    "goes on without it", wid, worker.host, code, worker.host,
                    "for good" if lo_hi is None else f"for {wait:.0f} s")

    def _fill(self, now: float) -> None:
        """Start workers on the free slots of listed, not blacklisted hosts, up to max-np."""
        if self.finished:
            return
        live = [w for w in self.workers.values() if w.live]
        taken = {(w.host, w.slot) for w in live}
        for host, slots in list(self.hosts.items()):
            if self.blacklist.get(host, 0.0) > now:
                continue
            for slot in range(slots):
                if len(live) >= self.settings.max_np:
                    return
                if (host, slot) not in taken:
                    self._spawn(host, slot)
                    live.append(self.workers[len(self.workers) - 1])

    # generations -----------------------------------------------------------------------------
    def _form(self, now: float) -> str | None:
        """Answer the waiting workers with a new generation when its time has come; the reason
        the job must fail, if it must."""
        if self.generation < 0 and now - self.started > self.settings.elastic_timeout_s:
            return (f"no first generation of at least --min-np {self.settings.min_np} workers "
                    f"within --elastic-timeout {self.settings.elastic_timeout_s:.0f} s (workers "
                    f"started: {len(self.workers)}); check the discovery script's output")
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
                if now - self.waiting_since > self.settings.elastic_timeout_s:
                    log.warning("stopping workers %s: they did not leave generation %d within "
                                "--elastic-timeout while their peers waited", lagging,
                                self.generation)
                    for m in lagging:
                        live[m].job.stop(signal.SIGTERM)
                    self.waiting_since = now
            return None
        keep = [live[m] for m in members if m not in gone]
        joining = sorted((w for w in waiting if w.id not in self.members), key=lambda w: w.id)
        chosen = (keep + joining)[:self.settings.max_np]
        if len(chosen) < self.settings.min_np:
            self.waiting_since = self.waiting_since or now
            if now - self.waiting_since > self.settings.elastic_timeout_s:
                return (f"only {len(chosen)} workers for at least --min-np "
                        f"{self.settings.min_np} within --elastic-timeout "
                        f"{self.settings.elastic_timeout_s:.0f} s")
            return None
        if self.generation >= 0:
            self.resets += 1
            limit = self.settings.reset_limit
            if limit is not None and self.resets > limit:
                return f"the job re-formed more than --reset-limit {limit} times"
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
    def run(self) -> int:
        discovery = threading.Thread(target=self._discover, name="ringflow-elastic-discovery",
                                     daemon=True)
        discovery.start()
        failure: str | None = None
        try:
            while self.stop_signal is None:
                now = time.monotonic()
                while True:
                    try:
                        self._exited(*self.exits.get_nowait())
                    except queue.Empty:
                        break
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
                w.job.stop(signal.SIGTERM)
            for _ in [w for w in self.workers.values() if w.live]:
                with contextlib.suppress(queue.Empty):
                    self._exited(*self.exits.get(timeout=2 * self.grace_s + 5))
            discovery.join(5.0)
            self.store.close()
            self.server.close()
        if failure is not None:
            print(f"ringflow-run: {failure}; stopping the job", file=sys.stderr, flush=True)
            return self.first_failure or 1
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0 if self.finished else (self.first_failure or 1)


def run_elastic(command: Sequence[str], settings: ElasticSettings, *,
                base_env: Mapping[str, str], stdout: IO[str] | None = None,
                stderr: IO[str] | None = None, grace_s: float = DEFAULT_GRACE_S,
                start_timeout_s: float = 30.0, handle_signals: bool = False) -> int:
    """Run an elastic job to its end; its exit code (see the module doc).

    Raises:
        LaunchError: the store or a worker could not be started.
    """
    driver = _Driver(command, settings, base_env, stdout, stderr, grace_s, start_timeout_s)
    previous: dict[int, Any] = {}
    if handle_signals:
        def stop(signum: int, _frame: object) -> None:
            driver.stop_signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
    try:
        return driver.run()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
