"""``ElasticRayExecutor``: an elastic ringflow job of Ray actors (``horovod.ray.
ElasticRayExecutor``).

The driver is ringflow-run's (:class:`~ringflow.runner.elastic_driver.ElasticDriver`: the
generations, blacklisting, ``min_num_proc``/``max_num_proc``, the reset limit and the elastic
timeout), run in the caller's process by :meth:`ElasticRayExecutor.run`; here it gets its hosts
from the Ray cluster and starts its workers as actors:

* *Hosts* are the live Ray nodes, named by their node id (two raylets on one machine are two
  hosts; a node's IP is not unique then). A node has as many slots as this job's live actors on
  it plus its free CPUs (and GPUs, with ``use_gpu``) over ``cpus_per_slot`` (``gpus_per_slot``),
  capped by its total: :class:`RayHostDiscovery` reports the free slots, the executor adds its
  own actors. While an actor of the job is still being placed on a node, that node does not
  grow (Ray's account of free resources lags behind a placement). A node that joins the
  cluster adds slots; one that leaves takes its actors with it.
* *Workers* are actors (:class:`~ringflow.ray._worker.ElasticWorker`) pinned to their node
  (``NodeAffinitySchedulingStrategy``, not soft), each reserving ``cpus_per_slot`` CPUs. One
  thread per worker creates it, hands it the environment of ``ringflow-run``'s elastic workers
  (DESIGN.md section 5, ``RINGFLOW_ELASTIC_ID``, the secret on a pipe: :mod:`._worker`) within
  ``timeout_s``, runs the user's ``worker_fn()`` in it once, and reports its end to the driver
  as an exit code: 0 when ``worker_fn`` returned (or the driver removed the worker), 1 when it
  raised or the actor could not be placed in time, -9 when the actor died (``ray.kill``, a
  SIGKILLed process, a lost node). A failed worker blacklists its node as a failed process
  blacklists its host under ringflow-run (for good, or for ``cooldown_range``); once the
  cooldown is over, the node's free CPUs get a new actor, which receives the state from its
  peers. Every ended actor is killed, so its CPUs are free again.
* *The store* (the workers' rendezvous, the generations' keys) runs in the driver process, on
  the first of ``nics``' address, else on the driver node's Ray address, where every node of the
  cluster reaches it (127.0.0.1 for a loopback cluster).

``run`` returns the results of the workers that finished, in their last rank order; it raises
:class:`~ringflow.errors.LaunchError` with the driver's reason when the job failed (every worker
of a generation gone, past the reset limit, below ``min_num_proc`` for the elastic timeout),
chained from the first worker's exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pickle
import secrets
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..errors import ConfigError, LaunchError
from ..runner.elastic_driver import ElasticDriver, Names, Policy
from ..runner.hosts import WorkerSpec
from ._job import Job
from .executor import _ray, actor_environ

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "HostDiscovery", "RayHostDiscovery"]

log = logging.getLogger(__name__)

#: The settings' names, as the driver's messages give them.
_NAMES = Names(min_np="min_num_proc", reset_limit="reset_limit",
               elastic_timeout="elastic_timeout", hosts="the Ray cluster's nodes and free CPUs")
#: An unbounded max_num_proc (Horovod's None).
_UNBOUNDED = 2**31 - 1


class HostDiscovery(Protocol):
    """Where workers may start now (Horovod's ``HostDiscovery``): Ray node id (or a node's IP,
    where it names one node) -> slots free for new workers, not counting the job's own."""

    def find_available_hosts_and_slots(self) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True)
class ElasticRaySettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns (Horovod's ``ElasticSettings``).

    ``elastic_timeout`` bounds the wait for ``min_num_proc`` workers (and for a worker to leave
    its generation while its peers wait); ``timeout_s`` bounds an actor's placement and setup;
    ``discovery_interval_s`` is how often the hosts are asked (1 s, as ringflow-run's script).
    """

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600.0
    timeout_s: float = 30.0
    nics: tuple[str, ...] = ()
    cooldown_range: tuple[float, float] | None = None
    discovery: HostDiscovery | None = None
    discovery_interval_s: float = 1.0

    def __post_init__(self) -> None:
        low, high = self.min_num_proc, self.max_num_proc
        if not isinstance(low, int) or low < 1 or (high is not None and (
                not isinstance(high, int) or high < low)):
            raise ConfigError(f"ElasticRayExecutor.create_settings(min_num_proc={low!r}, "
                              f"max_num_proc={high!r}): need integers with 1 <= min_num_proc "
                              "<= max_num_proc (max_num_proc=None: no bound)")
        for name in ("elastic_timeout", "timeout_s", "discovery_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ElasticRayExecutor.create_settings({name}="
                                  f"{getattr(self, name)!r}) must be a positive number of "
                                  "seconds")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"ElasticRayExecutor.create_settings(reset_limit="
                              f"{self.reset_limit!r}) must be >= 0 (None: no limit)")
        if self.cooldown_range is not None and not 0 < self.cooldown_range[0] <= (
                self.cooldown_range[1]):
            raise ConfigError(f"ElasticRayExecutor.create_settings(cooldown_range="
                              f"{self.cooldown_range!r}) must be (low, high) seconds with "
                              "0 < low <= high (None: a failed node is blacklisted for good)")


class RayHostDiscovery:
    """The live Ray nodes and their free slots: ``floor(free CPU / cpus_per_slot)`` (with
    ``use_gpu``, no more than ``floor(free GPU / gpus_per_slot)``), nodes without one left out.
    Keys are Ray node ids."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1) -> None:
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = (use_gpu, cpus_per_slot,
                                                                gpus_per_slot)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        ray = _ray()
        free = _free_per_node(ray)
        hosts = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = free.get(node["NodeID"], {})
            slots = _slots(have.get("CPU", 0.0), self.cpus_per_slot)
            if self.use_gpu:
                slots = min(slots, _slots(have.get("GPU", 0.0), self.gpus_per_slot))
            if slots:
                hosts[node["NodeID"]] = slots
        return hosts


def _slots(amount: float, per_slot: float) -> int:
    return math.floor(amount / per_slot + 1e-9) if per_slot > 0 else _UNBOUNDED


def _free_per_node(ray: Any) -> dict[str, dict[str, float]]:
    try:
        from ray._private.state import available_resources_per_node
    except ImportError:  # another Ray: the totals, as Horovod counts
        return {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
    return dict(available_resources_per_node())


@dataclasses.dataclass
class _Actor:
    handle: Any
    host: str
    placed: bool = False  # its setup returned: it runs, and holds its resources
    stopping: bool = False


class _Actors:
    """The :class:`~ringflow.runner.elastic_driver.Workers` of the executor: one actor each."""

    def __init__(self, executor: ElasticRayExecutor, job: Job, secret: bytes, fn_ref: Any,
                 job_id: str) -> None:
        self.executor, self.job, self.secret, self.fn_ref = executor, job, secret, fn_ref
        self.job_id = job_id
        self.ray = job.ray
        self.actors: dict[int, _Actor] = {}
        self.results: dict[int, Any] = {}
        self.errors: dict[int, tuple[str, BaseException | None]] = {}
        self.lock = threading.Lock()
        self.driver: ElasticDriver | None = None
        self.threads: list[threading.Thread] = []

    def start(self, spec: WorkerSpec, env: dict[str, str]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ._worker import ElasticWorker

        ex = self.executor
        options: dict[str, Any] = {"num_cpus": ex.cpus_per_slot, "max_restarts": 0,
                                   "scheduling_strategy": NodeAffinitySchedulingStrategy(
                                       spec.host, soft=False)}
        if ex.use_gpu:
            options["num_gpus"] = ex.gpus_per_slot
        handle = self.ray.remote(ElasticWorker).options(**options).remote()
        with self.lock:
            self.actors[spec.rank] = _Actor(handle, spec.host)
            self.job.actors.append(handle)
        full = {**ex.env_vars, "PYTHONUNBUFFERED": "1", **env,
                **actor_environ(spec, self.job.server.host, self.job.server.port,
                                f"{self.job_id}w{spec.rank}")}
        thread = threading.Thread(target=self._life, args=(spec.rank, handle, full),
                                  name=f"ringflow-ray-elastic-{spec.rank}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _life(self, wid: int, handle: Any, env: dict[str, str]) -> None:
        code = self._run(wid, handle, env)
        with contextlib.suppress(Exception):
            self.ray.kill(handle, no_restart=True)  # its CPUs are free again
        if self.driver is not None:
            self.driver.exited(wid, code)

    def _run(self, wid: int, handle: Any, env: dict[str, str]) -> int:
        ray, actor = self.ray, self.actors[wid]
        timeout = self.executor.settings.timeout_s
        try:
            info, _ = ray.get([handle.describe.remote(), handle.setup.remote(
                wid, env, self.secret, self.executor.settings.nics)], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            log.warning("the actor of worker %d was not placed and set up on node %s within "
                        "timeout_s=%s s; raise create_settings(timeout_s=...) or free CPUs",
                        wid, actor.host, timeout)
            return 1
        except ray.exceptions.RayError as exc:
            return self._died(wid, exc)
        with self.lock:
            actor.placed = True
            self.job.infos.append(info)
        try:
            outcome = ray.get(handle.run_elastic.remote(self.fn_ref))
        except ray.exceptions.RayError as exc:
            return self._died(wid, exc)
        if outcome[0] == "ok":
            self.results[wid] = outcome[1]
            return 0
        if outcome[0] == "removed":
            return 0
        _, text, trace, _, pickled = outcome
        self.errors[wid] = (f"{text}\n{trace}".rstrip(), _unpickle(pickled))
        log.warning("worker %d raised %s", wid, text)
        return 1

    def _died(self, wid: int, exc: BaseException) -> int:
        if self.actors[wid].stopping:
            return -signal.SIGTERM
        self.errors[wid] = (f"its Ray actor died: {exc}", exc)
        return -signal.SIGKILL

    def stop(self, wid: int) -> None:
        actor = self.actors[wid]
        actor.stopping = True
        with contextlib.suppress(Exception):
            self.ray.kill(actor.handle, no_restart=True)

    def _live(self, wid: int) -> bool:
        known = None if self.driver is None else self.driver.workers.get(wid)
        return known is None or known.live  # None: started, not yet registered

    def hosts(self, discovery: HostDiscovery) -> Callable[[], dict[str, int]]:
        """The driver's discover(): each node's free slots plus the job's live actors there."""
        ray = self.ray

        def hosts() -> dict[str, int]:
            try:
                free = discovery.find_available_hosts_and_slots()
                nodes = [n for n in ray.nodes() if n.get("Alive")]
            except Exception as exc:  # a GCS hiccup: the driver keeps the hosts found before
                raise LaunchError(f"the Ray cluster's nodes could not be listed: {exc}") from exc
            totals = {n["NodeID"]: _slots(n.get("Resources", {}).get("CPU", 0.0),
                                          self.executor.cpus_per_slot) for n in nodes}
            found = dict.fromkeys(totals, 0)
            for key, slots in free.items():
                node = _node_of(key, nodes)
                if node is None:
                    log.warning("the discovery names %r, which is neither a live Ray node's id "
                                "nor the IP of exactly one; ignored", key)
                else:
                    found[node] += slots
            with self.lock:
                live = {wid: a for wid, a in self.actors.items() if self._live(wid)}
            for node in found:
                mine = [a for a in live.values() if a.host == node]
                if any(not a.placed for a in mine):
                    found[node] = len(mine)  # Ray's free count may not show it yet
                else:
                    found[node] = min(totals[node], found[node] + len(mine))
            return {node: slots for node, slots in found.items() if slots}

        return hosts


def _node_of(key: str, nodes: list[dict[str, Any]]) -> str | None:
    if any(n["NodeID"] == key for n in nodes):
        return key
    by_ip = [n["NodeID"] for n in nodes if n.get("NodeManagerAddress") == key]
    return by_ip[0] if len(by_ip) == 1 else None


def _unpickle(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:  # a class that is not importable here: the text says enough
        return None
    return exc if isinstance(exc, BaseException) else None


class ElasticRayExecutor:
    """An elastic job of Ray actors (Horovod's ``ElasticRayExecutor``; module doc).

    ``settings`` from :meth:`create_settings`. Each worker reserves ``cpus_per_slot`` CPUs and,
    with ``use_gpu``, ``gpus_per_slot`` GPUs (default 1); ``env_vars`` go into every actor's
    environment. With ``override_discovery`` (the default) the hosts are the Ray cluster's nodes
    (:class:`RayHostDiscovery`); without it, ``settings.discovery``'s.

    Raises:
        ConfigError: Ray cannot be imported, or the arguments do not describe a job.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics: Iterable[str] | None = None, min_np: int | None = None,
                        max_np: int | None = None, *,
                        cooldown_range: tuple[float, float] | None = None,
                        discovery: HostDiscovery | None = None,
                        discovery_interval_s: float = 1.0) -> ElasticRaySettings:
        """Settings for an :class:`ElasticRayExecutor` (Horovod's signature; ``min_np`` and
        ``max_np`` are its deprecated names of ``min_num_proc`` and ``max_num_proc``).
        ``ssh_identity_file`` is ignored: ringflow starts nothing over ssh under Ray."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np if min_num_proc == 1 else min_num_proc
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_np if max_num_proc is None else max_num_proc
        if ssh_identity_file is not None:
            log.warning("ElasticRayExecutor.create_settings: ssh_identity_file is ignored; "
                        "ringflow starts nothing over ssh under Ray")
        return ElasticRaySettings(
            min_num_proc, max_num_proc, reset_limit, float(elastic_timeout), float(timeout_s),
            tuple(nics or ()),
            None if cooldown_range is None else (float(cooldown_range[0]),
                                                 float(cooldown_range[1])),
            discovery, float(discovery_interval_s))

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float | None = None,
                 env_vars: Mapping[str, str] | None = None,
                 override_discovery: bool = True) -> None:
        if not isinstance(settings, ElasticRaySettings):
            raise ConfigError("ElasticRayExecutor(settings=...) needs ElasticRayExecutor."
                              f"create_settings(...), got {type(settings).__name__}")
        if gpus_per_slot is not None and not use_gpu:
            raise ConfigError(f"ElasticRayExecutor(gpus_per_slot={gpus_per_slot}) needs "
                              "use_gpu=True")
        gpus = (1 if gpus_per_slot is None else gpus_per_slot) if use_gpu else 0
        if cpus_per_slot < 0 or gpus < 0 or (cpus_per_slot == 0 and gpus == 0):
            raise ConfigError(f"ElasticRayExecutor(cpus_per_slot={cpus_per_slot}, "
                              f"gpus_per_slot={gpus}): each worker must reserve some CPU or GPU")
        if not override_discovery and settings.discovery is None:
            raise ConfigError("ElasticRayExecutor(override_discovery=False) needs "
                              "create_settings(discovery=...): an object whose "
                              "find_available_hosts_and_slots() lists the Ray nodes to use")
        self._ray = _ray()
        self.settings = settings
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus
        self.env_vars = dict(env_vars or {})
        self.discovery: HostDiscovery = (
            RayHostDiscovery(use_gpu, cpus_per_slot, gpus) if override_discovery
            else settings.discovery)  # type: ignore[assignment]
        self._job: Job | None = None
        self._actors: _Actors | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        """Start the rendezvous store (the workers start in :meth:`run`).

        Raises:
            LaunchError: Ray is not initialized (call ``ray.init`` first) or is a Ray Client
                connection, or the store could not listen.
        """
        from .. import wire
        from ..rendezvous import StoreServer, TCPStore

        ray = self._ray
        if not ray.is_initialized():
            raise LaunchError("ElasticRayExecutor.start() needs a Ray cluster: call ray.init() "
                              "(or ray.init(address=...)) first")
        if ray.util.client.ray.is_connected():
            raise LaunchError("ElasticRayExecutor does not run over Ray Client (ray://): the "
                              "store runs in the driver process, which the actors must reach; "
                              "run the driver on a node of the cluster")
        self.shutdown()
        job = Job(ray)
        job.local_node = ray.get_runtime_context().get_node_id()
        if self.settings.nics:
            from ..runner.netif import interface_ipv4

            host = interface_ipv4(self.settings.nics[0])
        else:
            host = str(ray.util.get_node_ip_address())
        self._secret = wire.new_secret()
        try:
            job.server = StoreServer(self._secret, host=host, port=0,
                                     timeout=self.settings.timeout_s)
            self._store = TCPStore(job.server.host, job.server.port, self._secret,
                                   self.settings.timeout_s)
        except (OSError, ConfigError) as exc:
            job.close(graceful=False)
            raise LaunchError(f"could not start the rendezvous store on {host}: {exc}") from exc
        self._job = job
        self._finalizer = weakref.finalize(self, _close, job, self._store)
        log.info("elastic Ray job: store on %s:%d", job.server.host, job.server.port)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: list[Callable[[Any], None]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` on every worker, as workers come and go, until the training
        finished: the results of the workers that finished, in their last rank order.
        ``worker_fn`` calls ``init()`` and runs its ``@hvd.elastic.run`` function, as a script
        under ``ringflow-run --min-np`` does.

        Raises:
            LaunchError: before :meth:`start`, a second time, or the job failed (the reason,
                chained from the first worker's exception).
            ConfigError: ``callbacks`` (not supported), or ``worker_fn`` does not pickle.
        """
        if callbacks:
            raise ConfigError("ElasticRayExecutor.run(callbacks=...) is not supported: return "
                              "values from worker_fn, or log from the workers")
        job = self._job
        if job is None:
            raise LaunchError("ElasticRayExecutor.run() needs a fresh start(): call start() "
                              "first (once per run)")
        self._job = None  # one run per start(); shutdown() below frees the job
        try:
            fn_ref = self._ray.put(worker_fn)
        except Exception as exc:  # pickling raises anything a __reduce__ raises
            raise ConfigError(f"ElasticRayExecutor could not serialize {worker_fn!r} ({exc}); "
                              "pass a picklable function") from exc
        s = self.settings
        actors = _Actors(self, job, self._secret, fn_ref, secrets.token_hex(8))
        policy = Policy(s.min_num_proc, s.max_num_proc or _UNBOUNDED, s.reset_limit,
                        s.cooldown_range, s.elastic_timeout, s.discovery_interval_s)
        driver = ElasticDriver(policy, self._store, actors.hosts(self.discovery), actors,
                               names=_NAMES, exit_wait_s=s.timeout_s)
        actors.driver = driver
        self._actors = actors
        try:
            failure = driver.run()
            for thread in actors.threads:
                thread.join(s.timeout_s)
        finally:
            self._actors = None
            self.shutdown()  # every actor killed, this node's actor processes gone, no store
        if failure is None and driver.finished:
            ranks = {wid: driver.rank_of(wid) for wid in actors.results}
            return [actors.results[w] for w in sorted(
                (w for w in actors.results if ranks[w] is not None), key=lambda w: ranks[w])]
        first = next(iter(actors.errors.items()), None)
        why = failure or "no worker finished the training"
        if first is not None:
            why += f"\nthe first failed worker, {first[0]}: {first[1][0]}"
        raise LaunchError(f"the elastic Ray job failed: {why}") from (
            first[1][1] if first is not None else None)

    @property
    def workers(self) -> dict[int, Any]:
        """The actor handles of the workers alive now, by worker id (while :meth:`run` runs;
        empty otherwise)."""
        actors = self._actors
        if actors is None:
            return {}
        with actors.lock:
            return {wid: a.handle for wid, a in actors.actors.items() if actors._live(wid)}

    def shutdown(self) -> None:
        """Kill any actor left and stop the store (:meth:`run` does it when it returns). Safe to
        call twice; :meth:`start` may follow."""
        job, self._job = self._job, None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        elif job is not None:
            _close(job, None)

    def __enter__(self) -> ElasticRayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _close(job: Job, store: Any) -> None:
    if store is not None:
        with contextlib.suppress(Exception):
            store.close()
    job.close(graceful=False)
