"""``ringflow-run --min-np N --max-np M --host-discovery-script S``: elastic jobs of processes.

The loop that grows and shrinks the pool of workers, answers their requests for a generation and
blacklists the hosts of failed workers is :mod:`.elastic_driver` (shared with Ray's elastic
executor); this module gives it the hosts of the discovery script and starts workers as
processes. Every ``poll_s`` the discovery script prints the hosts that may run workers, one
``HOST[:SLOTS]`` a line (``--slots-per-host`` where a line gives none); on this machine one may
list it under several names (``localhost``, ``127.0.0.1``, its host name), each with its own
slots, and each name counts as a host of its own (its own local ranks, its own blacklisting).

The job ends when every worker has exited, or once every member of the running generation
has (newcomers still starting are stopped): code 0 if one finished (exit 0, not removed), else
the first failure's. It fails at once, stopping every worker, when a generation has no live
member left (the in-memory state is gone), past ``--reset-limit``, or below ``--min-np`` for
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

import dataclasses
import logging
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from ..errors import LaunchError
from .elastic_driver import ElasticDriver, Policy
from .hosts import Host, WorkerSpec, is_local, parse_hosts
from .launch import DEFAULT_GRACE_S, LocalJob, start_store
from .netif import interface_ipv4, store_address
from .ssh import SshOptions

__all__ = ["ElasticSettings", "discover", "run_elastic"]

log = logging.getLogger(__name__)


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


class _Processes:
    """The :class:`~.elastic_driver.Workers` of ringflow-run: each worker a :class:`LocalJob`
    of one process (under its supervisor, here or over ssh), its end waited for on a thread."""

    def __init__(self, command: Sequence[str], base_env: Mapping[str, str],
                 secret: bytes, store: tuple[str, int], settings: ElasticSettings,
                 stdout: IO[str] | None, stderr: IO[str] | None, grace_s: float) -> None:
        self.command, self.base_env, self.secret, self.store = (list(command), dict(base_env),
                                                                secret, store)
        self.settings, self.stdout, self.stderr, self.grace_s = settings, stdout, stderr, grace_s
        self.job_id = secrets.token_hex(8)
        self.jobs: dict[int, LocalJob] = {}
        self.driver: ElasticDriver | None = None  # told of each exit

    def start(self, spec: WorkerSpec, env: dict[str, str]) -> None:
        wid = spec.rank
        job = LocalJob(self.command, [spec], secret=self.secret, rendezvous=self.store,
                       job_id=f"{self.job_id}w{wid}", base_env={**self.base_env, **env},
                       stdout=self.stdout, stderr=self.stderr, grace_s=self.grace_s,
                       ssh=self.settings.ssh)
        job.start()
        self.jobs[wid] = job
        threading.Thread(target=self._wait, args=(wid, job), name=f"ringflow-elastic-{wid}",
                         daemon=True).start()

    def _wait(self, wid: int, job: LocalJob) -> None:
        end = job.wait().exits[0]  # None: stopped by this driver (job.stop)
        if self.driver is not None:
            self.driver.exited(wid, -signal.SIGTERM if end is None else end.returncode)

    def stop(self, wid: int) -> None:
        self.jobs[wid].stop(signal.SIGTERM)


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


def _script_hosts(settings: ElasticSettings, local_only: bool) -> Callable[[], dict[str, int]]:
    """The discovery script's hosts; with the store on loopback, only this machine's names."""
    warned: set[str] = set()

    def hosts() -> dict[str, int]:
        found = discover(settings.discovery_script, settings.slots_per_host)
        for host in [h for h in found if local_only and not is_local(h)]:
            if host not in warned:
                warned.add(host)
                log.warning("ignoring host %r of the discovery script: the job's store "
                            "listens on 127.0.0.1, since the script listed no other "
                            "host at the start; pass --network-interface NAME to let "
                            "other hosts join", host)
            del found[host]
        return found

    return hosts


def run_elastic(command: Sequence[str], settings: ElasticSettings, *,
                base_env: Mapping[str, str], stdout: IO[str] | None = None,
                stderr: IO[str] | None = None, grace_s: float = DEFAULT_GRACE_S,
                start_timeout_s: float = 30.0, handle_signals: bool = False) -> int:
    """Run an elastic job to its end; its exit code (see the module doc).

    Raises:
        LaunchError: the store or a worker could not be started.
    """
    if settings.ssh.connect_timeout is None:
        settings = dataclasses.replace(settings, ssh=dataclasses.replace(
            settings.ssh, connect_timeout=start_timeout_s))
    secret, server = start_store([], None, start_timeout_s, host=_listen_on(settings))
    from ..rendezvous import TCPStore

    previous: dict[int, Any] = {}
    store = None
    try:
        store = TCPStore(server.host, server.port, secret, start_timeout_s)
        workers = _Processes(command, base_env, secret, (server.host, server.port), settings,
                             stdout, stderr, grace_s)
        policy = Policy(settings.min_np, settings.max_np, settings.reset_limit,
                        settings.cooldown, settings.elastic_timeout_s, settings.poll_s)
        driver = ElasticDriver(policy, store, _script_hosts(settings,
                                                            server.host == "127.0.0.1"),
                               workers, exit_wait_s=2 * grace_s + 5)
        workers.driver = driver
        if handle_signals:
            def stop(signum: int, _frame: object) -> None:
                driver.stop_signal = signum

            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, stop)
        failure = driver.run()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if store is not None:
            store.close()
        server.close()
    if failure is not None:
        print(f"ringflow-run: {failure}; stopping the job", file=sys.stderr, flush=True)
        return driver.first_failure or 1
    if driver.stop_signal is not None:
        return 128 + driver.stop_signal
    return 0 if driver.finished else (driver.first_failure or 1)
