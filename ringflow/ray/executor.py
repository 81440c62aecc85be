"""``RayExecutor``: the ranks of a ringflow job as Ray actors (``horovod.ray.RayExecutor``).

Start (:meth:`RayExecutor.start`), in the driver process, which must have called ``ray.init``:

1. Placement: ``num_workers`` actors in a ``PACK`` placement group of one bundle per worker, or
   ``num_hosts`` bundles of ``num_workers_per_host`` workers each in a ``STRICT_SPREAD`` group
   (one bundle per node), or the placement group the caller runs in
   (``use_current_placement_group``). Bundles hold ``cpus_per_worker`` CPUs (and
   ``gpus_per_worker`` GPUs with ``use_gpu``) per worker. The group must be ready within
   ``placement_group_timeout_s``.
2. Ranks: every actor reports its Ray node id; actors are grouped by node (nodes in the order
   their first actor was created) and ranked host by host with
   :func:`ringflow.runner.hosts.assign_ranks`, so ``local_rank``/``local_size`` count the actors
   of one node and ``cross_rank``/``cross_size`` index the nodes, as under ``ringflow-run``.
   ``RINGFLOW_HOSTNAME`` is the node's host name.
3. Rendezvous: the executor draws a fresh secret and starts a :class:`~ringflow.rendezvous.
   StoreServer` in the driver process, on 127.0.0.1 when every actor is on the driver's node,
   else on the address of the first of ``nics`` or, without ``nics``, the driver node's Ray IP.
4. Environment: each actor gets DESIGN.md section 5's variables in its ``os.environ`` and the
   secret on a pipe named by ``RINGFLOW_SECRET_FD`` (:mod:`._worker`), so a function run there
   calls ``ringflow.init()`` / ``hvd.init()`` unchanged. The secret travels as an argument of one
   actor method call, which Ray sends directly from the driver's process to the actor's (not in
   the actor-creation spec, which the GCS keeps), the channel that carries the user's functions
   (whoever can use the Ray cluster can run code in the actors anyway); it is never in a command
   line, an environment value or a log line.

Calls. :meth:`~RayExecutor.run` / :meth:`~RayExecutor.execute` / :meth:`~RayExecutor.
execute_single` send the function once (``ray.put``), run it on every rank (rank 0 only), and
return the results in rank order. They are *supervised*: the first failure -- an exception on a
rank, or an actor that died (a killed process, ``ray.kill``, a lost node) -- ends the job: every
actor is killed, the store stops, and :class:`~ringflow.errors.RankFailure` names the rank, with
the remote traceback (or Ray's account of the death), chained from the original exception where
it unpickles. A :class:`~ringflow.errors.PeerError` or :class:`~ringflow.errors.ShutdownError` is
what a rank gets because *another* rank failed, so when such an error arrives first the executor
waits up to :data:`FAILURE_GRACE_S` for the failure behind it. :meth:`~RayExecutor.run_remote`
returns Ray object refs and is not supervised.

Stop: :meth:`~RayExecutor.shutdown` (also on leaving a ``with`` block, and when the executor is
garbage collected) lets each actor shut ringflow down, kills every actor, waits until the actor
processes on this node are gone, removes the placement group it created and closes the store.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, LaunchError, RankFailure, RingflowTimeoutError
from ..runner.hosts import Host, WorkerSpec, assign_ranks
from ..runner.launch import worker_environ
from ._job import Job

__all__ = ["FAILURE_GRACE_S", "RayExecutor", "RaySettings", "actor_environ", "rank_by_node"]

log = logging.getLogger(__name__)

_INSTALL = "pip install 'ringflow[ray]'"
#: After a rank fails with an error that another rank's failure causes (PeerError,
#: ShutdownError), how long to wait for that other failure before reporting this one. A peer's
#: death reaches the other ranks as PeerError within milliseconds, and Ray reported the dead actor
#: to the driver 3-12 ms after SIGKILL or ray.kill (run() raised 27-41 ms after the kill; Ray
#: 2.60, one node, 2 CPUs); 2 s leaves room for a loaded machine and a remote node.
FAILURE_GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's ``MiniSettings``).

    ``timeout_s`` bounds the start: each actor's first answer, and each wait of the rendezvous
    store on a rank that connects to it. ``placement_group_timeout_s`` bounds the wait for the
    placement group. ``nics``: interfaces that connect the Ray nodes; the store listens on the
    first one's address and each rank binds its sockets to its own address on the first of them
    that it has (``RINGFLOW_BIND_ADDR``).
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"RayExecutor.create_settings({name}={getattr(self, name)!r}) "
                                  "must be a positive number of seconds")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"ringflow.ray needs Ray, which cannot be imported ({exc}); {_INSTALL}"
        ) from exc
    return ray


@dataclasses.dataclass(frozen=True)
class _Failure:
    rank: int
    text: str
    cause: BaseException | None
    #: A PeerError or ShutdownError: caused by another rank's failure.
    consequence: bool


class RayExecutor:
    """Runs functions on the ranks of a ringflow job made of Ray actors.

    ``settings`` comes from :meth:`create_settings` (``None``: the defaults). Give either
    ``num_workers`` (packed onto as few nodes as fit) or ``num_hosts`` with
    ``num_workers_per_host`` (exactly that many on each of that many nodes). Each worker
    reserves ``cpus_per_worker`` CPUs and, with ``use_gpu``, ``gpus_per_worker`` GPUs (default
    1); with ``use_gpu`` every rank sees the GPUs of all the ranks of its node in
    ``CUDA_VISIBLE_DEVICES``, in local-rank order, so ``torch.cuda.set_device(hvd.local_rank())``
    picks its own (one GPU per worker), as under Horovod. With ``use_current_placement_group``
    an executor created inside a placement group (a Ray Tune trial) places its actors there.

    Raises:
        ConfigError: Ray cannot be imported, or the arguments do not describe a job.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: Iterable[str] | None = None,
    ) -> RaySettings:
        """Settings for a :class:`RayExecutor` (Horovod's signature). ringflow starts nothing
        over ssh under Ray, so ``ssh_identity_file`` and ``ssh_str`` are ignored (Horovod writes
        ``ssh_str``, a private key, to ``ssh_identity_file``; ringflow never does)."""
        if ssh_identity_file is not None or ssh_str is not None:
            log.warning("RayExecutor.create_settings: ssh_identity_file and ssh_str are ignored; "
                        "ringflow starts nothing over ssh under Ray")
        return RaySettings(float(timeout_s), float(placement_group_timeout_s),
                           tuple(nics or ()))

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
    ) -> None:
        if settings is None:
            settings = RaySettings()
        if not isinstance(settings, RaySettings):
            raise ConfigError(f"RayExecutor(settings=...) needs RayExecutor.create_settings(...), "
                              f"got {type(settings).__name__}")
        if (num_workers is None) == (num_hosts is None):
            raise ConfigError(
                f"RayExecutor needs exactly one of num_workers and num_hosts (got num_workers="
                f"{num_workers}, num_hosts={num_hosts}); pass num_workers=N, or num_hosts=H with "
                "num_workers_per_host=W"
            )
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"RayExecutor({name}={value!r}) must be an integer >= 1")
        if gpus_per_worker is not None and not use_gpu:
            raise ConfigError(f"RayExecutor(gpus_per_worker={gpus_per_worker}) needs "
                              "use_gpu=True")
        gpus = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        if cpus_per_worker < 0 or gpus < 0 or (cpus_per_worker == 0 and gpus == 0):
            raise ConfigError(
                f"RayExecutor(cpus_per_worker={cpus_per_worker}, gpus_per_worker={gpus}): each "
                "worker must reserve some CPU or GPU (Ray places nothing with no resources)"
            )
        self._ray = _ray()
        self.settings = settings
        self.num_workers = num_workers if num_workers is not None else (
            num_hosts * num_workers_per_host)  # type: ignore[operator]
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus
        self.use_current_placement_group = use_current_placement_group
        self._job: Job | None = None
        self._finalizer: weakref.finalize | None = None

    # -- life cycle ------------------------------------------------------------------------

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Create the actors, rank them, start the store, and give each rank its environment;
        then ``executable_cls(*executable_args, **executable_kwargs)`` on every rank (the object
        :meth:`execute` passes to its function). ``extra_env_vars`` go into every actor's
        environment first (``RINGFLOW_TIMEOUT_S``, ...); the job's own variables win.

        Raises:
            LaunchError: the executor is running already, Ray is not initialized (call
                ``ray.init`` first) or is a Ray Client connection, or an actor could not start.
            RingflowTimeoutError: the placement group or an actor was not ready in time.
        """
        if self._job is not None and self._job.stopped is None:
            raise LaunchError("RayExecutor.start(): the executor is running already; call "
                              "shutdown() before starting it again")
        self.shutdown()
        ray = self._ray
        if not ray.is_initialized():
            raise LaunchError("RayExecutor.start() needs a Ray cluster: call ray.init() (or "
                              "ray.init(address=...)) first")
        if ray.util.client.ray.is_connected():
            raise LaunchError(
                "RayExecutor does not run over Ray Client (ray://): the rendezvous store runs in "
                "the driver process, which the actors must reach; run the driver on a node of the "
                "cluster (e.g. as a Ray job)"
            )
        job = Job(ray)
        self._job = job
        self._finalizer = weakref.finalize(self, job.close, False)
        try:
            self._start(job, executable_cls, executable_args, executable_kwargs,
                        dict(extra_env_vars or {}))
        except BaseException:
            job.stopped = "start() failed"
            job.close(graceful=False)
            raise

    def _start(self, job: Job, cls: type | None, cls_args: Sequence[Any] | None,
               cls_kwargs: Mapping[str, Any] | None, extra_env: dict[str, str]) -> None:
        from .. import wire
        from ..rendezvous import StoreServer
        from ._worker import Worker

        ray = self._ray
        job.local_node = ray.get_runtime_context().get_node_id()
        strategies = self._placement(job)
        remote_cls = ray.remote(Worker)
        resources: dict[str, Any] = {"num_cpus": self.cpus_per_worker}
        if self.gpus_per_worker:
            resources["num_gpus"] = self.gpus_per_worker
        actors = [remote_cls.options(**resources, scheduling_strategy=s).remote()
                  for s in strategies]
        job.actors = actors
        infos = self._wait(job, [a.describe.remote() for a in actors], "describe itself")

        order, specs = rank_by_node([i["node_id"] for i in infos], [i["hostname"] for i in infos])
        job.actors = [actors[i] for i in order]
        job.infos = [infos[i] for i in order]

        secret = wire.new_secret()
        host = self._store_host(job, [i["node_id"] for i in infos])
        try:
            job.server = StoreServer(secret, host=host, port=0, timeout=self.settings.timeout_s)
        except (OSError, ConfigError) as exc:
            raise LaunchError(f"could not start the rendezvous store on {host}: {exc}") from exc
        log.info("rendezvous store on %s:%d for %d Ray actors on %d nodes", job.server.host,
                 job.server.port, len(specs), specs[0].cross_size)
        job_id = secrets.token_hex(8)
        gpus = self._visible_gpus(job.infos, specs)
        setups = []
        for spec, actor in zip(specs, job.actors, strict=True):
            env = {**extra_env, **self._environ(spec, job, job_id)}
            if spec.rank in gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[spec.rank]
            setups.append(actor.setup.remote(spec.rank, env, secret, self.settings.nics))
        self._wait(job, setups, "set up its environment")
        self._wait(job, [a.start_executable.remote(cls, cls_args, cls_kwargs)
                         for a in job.actors], f"create {getattr(cls, '__name__', cls)}")

    def _placement(self, job: Job) -> list[Any]:
        """A scheduling strategy per actor; creates the placement group when needed."""
        ray = self._ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def strategy(bundle: int) -> Any:
            return PlacementGroupSchedulingStrategy(
                job.placement_group, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=False,
            )

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            log.info("placing the actors in the current placement group (pass "
                     "use_current_placement_group=False to create one)")
            job.placement_group = current
            return [strategy(-1) for _ in range(self.num_workers)]
        # Ray refuses a bundle entry of 0.
        per_worker = {k: v for k, v in (("CPU", self.cpus_per_worker),
                                        ("GPU", self.gpus_per_worker)) if v}
        if self.num_hosts is None:
            bundles = [dict(per_worker) for _ in range(self.num_workers)]
            kind, bundle_of = "PACK", list(range(self.num_workers))
        else:
            w = self.num_workers_per_host
            bundles = [{k: v * w for k, v in per_worker.items()} for _ in range(self.num_hosts)]
            kind, bundle_of = "STRICT_SPREAD", [i // w for i in range(self.num_workers)]
        job.placement_group = ray.util.placement_group(bundles, strategy=kind)
        job.owns_placement_group = True
        ready, _ = ray.wait([job.placement_group.ready()],
                            timeout=self.settings.placement_group_timeout_s)
        if not ready:
            raise RingflowTimeoutError(
                f"the {kind} placement group of {len(bundles)} bundles of {bundles[0]} was not "
                f"ready within placement_group_timeout_s={self.settings.placement_group_timeout_s}"
                f" s; the cluster has {ray.available_resources()} free: lower num_workers / "
                "cpus_per_worker, add nodes, or raise placement_group_timeout_s"
            )
        return [strategy(b) for b in bundle_of]

    def _wait(self, job: Job, refs: list[Any], what: str) -> list[Any]:
        ray = self._ray
        try:
            return list(ray.get(refs, timeout=self.settings.timeout_s))
        except ray.exceptions.GetTimeoutError as exc:
            raise RingflowTimeoutError(
                f"a Ray actor of the job did not {what} within timeout_s="
                f"{self.settings.timeout_s} s; raise create_settings(timeout_s=...)"
            ) from exc
        except ray.exceptions.RayError as exc:
            raise LaunchError(
                f"a Ray actor of the job could not {what}: {exc}\n(ringflow and everything the "
                "job imports must be importable on every node: install them there or pass a "
                "runtime_env to ray.init)"
            ) from exc

    def _store_host(self, job: Job, nodes: list[str]) -> str:
        if all(n == job.local_node for n in nodes):
            return "127.0.0.1"  # a single-node job never listens beyond loopback
        if self.settings.nics:
            from ..runner.netif import interface_ipv4

            return interface_ipv4(self.settings.nics[0])
        return str(self._ray.util.get_node_ip_address())

    def _environ(self, spec: WorkerSpec, job: Job, job_id: str) -> dict[str, str]:
        return actor_environ(spec, job.server.host, job.server.port, job_id)

    @staticmethod
    def _visible_gpus(infos: list[dict[str, Any]], specs: list[WorkerSpec]) -> dict[int, str]:
        """CUDA_VISIBLE_DEVICES per rank: the GPUs of its node's ranks, in local-rank order."""
        by_host: dict[int, list[str]] = {}
        for spec, info in zip(specs, infos, strict=True):
            by_host.setdefault(spec.cross_rank, []).extend(info["gpu_ids"])
        return {s.rank: ",".join(by_host[s.cross_rank]) for s in specs if by_host[s.cross_rank]}

    def shutdown(self) -> None:
        """Shut ringflow down on every rank, kill the actors, remove the placement group this
        executor created and stop the store. Safe to call twice; :meth:`start` may follow."""
        job, self._job = self._job, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if job is not None:
            job.close(graceful=job.stopped is None)

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- calls -------------------------------------------------------------------------------

    @property
    def workers(self) -> list[Any]:
        """The actor handles, in rank order (empty before :meth:`start`)."""
        return list(self._job.actors) if self._job is not None else []

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        ``timeout`` bounds the call in seconds (``None``: no bound).

        Raises:
            RankFailure: a rank raised, its actor died, or it was still running at ``timeout``;
                the first failure is named, and the job is over (every actor was killed).
            LaunchError: the executor is not started, or its job ended.
        """
        return self._supervise(self._job_for("run"), (fn, tuple(args or ()), dict(kwargs or {})),
                               False, None, timeout)

    def execute(self, fn: Callable[[Any], Any], *, timeout: float | None = None) -> list[Any]:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` made; None
        without one); the results in rank order. Raises as :meth:`run`."""
        return self._supervise(self._job_for("execute"), (fn, (), {}), True, None, timeout)

    def execute_single(self, fn: Callable[[Any], Any], *, timeout: float | None = None) -> Any:
        """``fn(executable)`` on rank 0 only; its result. Raises as :meth:`run`."""
        return self._supervise(self._job_for("execute_single"), (fn, (), {}), True, 1,
                               timeout)[0]

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank, without waiting: Ray object refs in rank order
        (``ray.get`` them). Not supervised: an exception on a rank is raised by its ref (the rank
        shuts ringflow down first, so the others' collectives fail instead of waiting), and the
        job goes on until :meth:`shutdown`."""
        job = self._job_for("run_remote")
        payload = self._put((fn, tuple(args or ()), dict(kwargs or {})))
        return [actor.call.remote(payload) for actor in job.actors]

    def _job_for(self, method: str) -> Job:
        job = self._job
        if job is None:
            raise LaunchError(f"RayExecutor.{method}() before start(); call start() first")
        if job.stopped is not None:
            raise LaunchError(f"RayExecutor.{method}(): the job is over ({job.stopped}); call "
                              "start() for a new one")
        return job

    def _supervise(self, job: Job, payload: tuple[Any, ...], with_executable: bool,
                   count: int | None, timeout: float | None) -> list[Any]:
        data = self._put(payload)
        refs = [actor.invoke.remote(data, with_executable) for actor in job.actors[:count]]
        try:
            values, failures, unfinished = self._gather(job, refs, timeout)
        except BaseException:  # KeyboardInterrupt included: nothing keeps running unwatched
            job.stopped = "a call was interrupted"
            job.close(graceful=False)
            raise
        if not failures and not unfinished:
            return values
        if failures:
            first = next((f for f in failures if not f.consequence), failures[0])
        else:
            first = _Failure(unfinished[0], f"did not finish within the deadline of {timeout} s "
                             "(a hang, or raise the deadline)", None, False)
        job.stopped = f"rank {first.rank} failed"
        job.close(graceful=False)
        raise RankFailure(first.rank, _report(first, failures, unfinished)) from first.cause

    def _put(self, payload: tuple[Any, ...]) -> Any:
        try:
            return self._ray.put(payload)
        except Exception as exc:  # pickling raises anything a __reduce__ raises
            raise ConfigError(
                f"RayExecutor could not serialize {payload[0]!r} and its arguments ({exc}); pass "
                "a picklable function and arguments"
            ) from exc

    def _gather(self, job: Job, refs: list[Any], timeout: float | None
                ) -> tuple[list[Any], list[_Failure], list[int]]:
        """Wait for every ref until the first failure that is not a consequence, the grace after
        a consequence, or the deadline: (values, failures in arrival order, unfinished ranks)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        failures: list[_Failure] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end: float | None = None
        pending = list(refs)
        while pending and all(f.consequence for f in failures):
            ends = [t for t in (deadline, grace_end) if t is not None]
            wait_s = None if not ends else max(0.0, min(ends) - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                break
            for ref in ready:
                failure = self._outcome(job, rank_of[ref], ref, values)
                if failure is not None:
                    failures.append(failure)
                    if grace_end is None:
                        grace_end = time.monotonic() + FAILURE_GRACE_S
        return values, failures, sorted(rank_of[ref] for ref in pending)

    def _outcome(self, job: Job, rank: int, ref: Any, values: list[Any]) -> _Failure | None:
        ray = self._ray
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            info = job.infos[rank]
            return _Failure(rank, f"its Ray actor (pid {info['pid']} on {info['hostname']}) "
                            f"died: {exc}", exc, False)
        except ray.exceptions.RayError as exc:
            return _Failure(rank, f"{type(exc).__name__}: {exc}", exc, False)
        if outcome[0] == "ok":
            values[rank] = outcome[1]
            return None
        _, text, trace, consequence, pickled = outcome
        return _Failure(rank, f"{text}\n{trace}".rstrip(), _unpickle(pickled), consequence)


def actor_environ(spec: WorkerSpec, host: str, port: int, job_id: str) -> dict[str, str]:
    """The environment of DESIGN.md section 5 for the actor of ``spec``, with the store at
    ``host:port``: ``ringflow-run``'s, less what has no meaning in an actor."""
    env = worker_environ(spec, rendezvous_addr=host, rendezvous_port=port, job_id=job_id,
                         base_env={})
    # The driver's pid means nothing on another node; GLIBC_TUNABLES is read by glibc at
    # process start, and Ray started the actor process already (set it in a runtime_env).
    for name in ("RINGFLOW_LAUNCHER_PID", "GLIBC_TUNABLES"):
        env.pop(name, None)
    return env


def rank_by_node(node_ids: Sequence[str], hostnames: Sequence[str]
                 ) -> tuple[list[int], list[WorkerSpec]]:
    """Ranks for actors on the Ray nodes ``node_ids`` (one entry per actor, in creation order):
    ``(order, specs)``, where rank ``r`` is actor ``order[r]`` and ``specs[r]`` its placement.

    Nodes are taken in the order their first actor was created, and ranks are assigned host by
    host (:func:`~ringflow.runner.hosts.assign_ranks`): the actors of one node get consecutive
    ranks, in creation order. ``specs[r].host`` is the actor's host name.
    """
    nodes = list(dict.fromkeys(node_ids))
    order = sorted(range(len(node_ids)), key=lambda i: (nodes.index(node_ids[i]), i))
    counts = [node_ids.count(node) for node in nodes]
    specs = assign_ranks([Host(n, c) for n, c in zip(nodes, counts, strict=True)], len(order))
    return order, [dataclasses.replace(s, host=hostnames[i]) for s, i in zip(specs, order,
                                                                             strict=True)]


def _unpickle(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:  # e.g. a class that is not importable here: the text says enough
        return None
    return exc if isinstance(exc, BaseException) else None


def _report(first: _Failure, failures: list[_Failure], unfinished: list[int]) -> str:
    lines = [first.text]
    lines += [f"(also rank {f.rank}: {f.text.splitlines()[0]})" for f in failures if f is not first]
    if unfinished:
        lines.append(f"(ranks {unfinished} were still running and were stopped)")
    return "\n".join(lines)
