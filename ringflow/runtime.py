"""The process's place in a job: :func:`init`, :func:`shutdown` and what they hold.

One engine per process at a time. :func:`init` detects the job (:mod:`ringflow.topology`), reaches
the rendezvous store (:mod:`ringflow.bootstrap`), places the ranks on hosts if the launcher did
not, connects the backends (:mod:`ringflow.backends`) and starts the
:class:`~ringflow.engine.Engine`; :func:`shutdown` stops it, and a later :func:`init` forms a
fresh job of the same ranks (DESIGN §8).

A thread may instead act as one rank of a job whose ranks are threads of this process
(:func:`ringflow.testing.run_engines`): inside :func:`bound`, every function of the public API
called on that thread reads that rank's :class:`Binding` instead of the process's state.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import devices, failure, injection
from .client import Client, local_client
from .config import Config
from .errors import ConfigError, NotInitializedError
from .topology import RankInfo

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Binding", "bound", "cross_rank", "cross_size", "get_client", "info", "init",
           "is_initialized", "local_rank", "local_size", "rank", "running", "shutdown", "size",
           "start_timeline", "stats", "stop_timeline", "this_rank"]

log = logging.getLogger(__name__)

_state_lock = threading.Lock()
_engine: Engine | None = None
_info: Any = None
_client: Any = None
_generation = itertools.count()
_world: Any = None  # an elastic worker's ringflow.world.World, from its first init() on


class _Local(threading.local):
    """The Binding this thread acts for, if any (a class default: a missing attribute would make
    every lookup raise and catch an AttributeError, 0.7 us of each operation's cost)."""

    binding: Binding | None = None


_local = _Local()


class Binding:
    """One rank of a job whose ranks are threads of this process: its engine (None once shut
    down), :class:`~ringflow.topology.RankInfo` and key-value client."""

    def __init__(self, engine: Any, info: RankInfo, client: Client) -> None:
        self.engine = engine
        self.info = info
        self.client = client


@contextlib.contextmanager
def bound(binding: Binding) -> Iterator[None]:
    """Make the public API, called on this thread, act for ``binding``'s rank (nestable)."""
    previous = _local.binding
    _local.binding = binding
    try:
        yield
    finally:
        _local.binding = previous


def this_rank() -> Binding | None:
    """What owns this rank's per-rank objects in the process: the :class:`Binding` of a rank
    that is a thread (:func:`ringflow.testing.run_engines`), else None (the process is the
    rank). Unlike the engine, it outlives an elastic reset's ``shutdown(); init()``."""
    return _local.binding


def _state() -> tuple[Any, Any, Any]:
    """(engine, info, client) of the rank this thread acts for: a binding's, else the process's."""
    binding = _local.binding
    if binding is None:
        return _engine, _info, _client
    return binding.engine, binding.info, binding.client


def init(comm: Any = None, *, rank: int | None = None, size: int | None = None,
         init_method: str | None = None, local_rank: int | None = None,
         local_size: int | None = None, store: Any = None) -> None:
    """Join the job that started this process: ringflow-run, mpirun, srun, torchrun, torch's
    env:// contract, a process where torch.distributed is initialised, ... (the detectors and
    where each finds its peers: ringflow.topology and ringflow.bootstrap).

    Calling it again while initialized does nothing (the public :func:`ringflow.init` also adds
    process sets, collectively, right after). ``comm``, an mpi4py intracommunicator, makes the
    job of just its ranks (Horovod's ``hvd.init(comm=...)``): every rank of ``comm`` must call
    ``init(comm=comm)``; ranks, local and cross values come from the communicator, and the
    transport is ``mpi`` over a private duplicate of it unless RINGFLOW_TRANSPORT names another
    one.

    For processes a script starts itself (torch.distributed's and MegEngine's style): ``rank``
    and ``size`` (both, or neither) with ``init_method`` ``"env://"`` (MASTER_ADDR and
    MASTER_PORT; the default), ``"tcp://HOST:PORT"`` (rank 0's host and a free port there) or
    ``"file:///PATH"`` (a fresh directory every rank sees). ``local_rank``/``local_size``
    default to what the ranks' host names say.

    ``store`` (with ``rank`` and ``size``, instead of ``init_method``) is a rendezvous store
    that every rank of the job reaches and that holds no other job's keys: a
    :class:`ringflow.rendezvous.Store`, e.g. :class:`ringflow.rendezvous.torch_store.TorchStore`
    over the store torch.distributed hands a backend (:mod:`ringflow.torch.process_group`).

    Raises:
        ConfigError: a RINGFLOW_* variable, the launcher environment or an argument is invalid,
            or a variable says the job has several processes and none is joined.
        PeerError / RingflowTimeoutError: the other ranks could not be reached within timeout_s.
    """
    global _engine, _info, _client
    from . import threads, topology
    from .backends import connect
    from .engine import Engine

    binding = _local.binding
    if binding is not None:
        if binding.engine is not None:
            return
        raise ConfigError("this thread is a rank of ringflow.testing.run_engines, whose engine "
                          "was shut down; it cannot be started again (run a new run_engines)")
    with _state_lock:
        if _engine is not None:
            return
        config = Config.from_env()
        logging.getLogger("ringflow").setLevel(config.log_level.upper())
        prefix = None
        if (comm is None and rank is None and size is None and store is None
                and init_method is None and os.environ.get("RINGFLOW_ELASTIC_ID")):
            store, info, prefix = _next_generation(config)
        elif comm is not None:
            from .bootstrap import comm_info

            info = comm_info(comm)
        elif rank is not None or size is not None:
            info = topology.explicit(rank, size, local_rank, local_size)
            if store is not None and init_method:
                raise ConfigError("init(store=..., init_method=...): give one of them")
            init_method = init_method or "env://"
        else:
            if (init_method or store is not None or local_rank is not None
                    or local_size is not None):
                raise ConfigError("init(init_method=..., store=..., local_rank=..., "
                                  "local_size=...) needs rank= and size= too")
            info = topology.detect()
        generation = next(_generation)
        # A given store is this job's alone: its keys need no per-init() prefix (which would
        # differ between ranks that called init() a different number of times before).
        if prefix is None:
            prefix = "" if store is not None else f"init{generation}/"
        if info.size == 1 and not info.placed:
            info = topology.place(info, [info.hostname])
        elif info.size > 1:
            if store is None:
                from .bootstrap import connect_store

                store = connect_store(info, config.timeout_s, comm=comm,
                                      init_method=init_method)
            if not info.placed:
                store.set(f"{prefix}host/{info.rank}", info.hostname.encode())
                info = topology.place(info, [store.get(f"{prefix}host/{r}").decode()
                                             for r in range(info.size)])
        injection.arm(config.fault, info.rank)
        pool = threads.affinity()
        why_not = topology.auto_binding(info) if config.bind_to == "auto" else ""
        bound = config.bind_to == "core" or (config.bind_to == "auto" and not why_not)
        if bound:
            cpus = topology.bind_to_cores(info)
            log.info("rank %d bound to CPUs %s", info.rank, cpus)
        elif why_not:
            log.info("rank %d not bound to CPUs: %s", info.rank, why_not)
        threads.at_init(info, store, prefix, pool, bound)
        backends = connect(info, store, config, prefix, comm=comm)
        if store is not None:
            from .bootstrap import settle

            try:
                settle(store, config.timeout_s)
            except BaseException:
                backends.close()
                raise
        if injection.ARMED:
            injection.hit("init")
        _info = info
        _client = Client(store) if store is not None else local_client(config.timeout_s)
        _engine = Engine(info.rank, info.size, backends, config)
        log.info("joined the job: rank %d of %d on %s (%s), local rank %d of %d, transport %s",
                 info.rank, info.size, info.hostname, info.detector, info.local_rank,
                 info.local_size, type(backends.transport).__name__)
        log.debug("configuration: %s", config)
        if info.detector == "ringflow":
            _exit_on_sigterm()
        failure.install(lambda: _state()[:2])
        devices.forget()  # a fresh job claims its devices again


def _next_generation(config: Config) -> tuple[Any, RankInfo, str]:
    """An elastic worker's store, place and key prefix in the next generation of its job
    (:mod:`ringflow.world`); the process ends with code 0 when the driver removed it."""
    global _world
    from .world import World

    if _world is None:
        from .rendezvous import connect

        text = os.environ.get("RINGFLOW_ELASTIC_ID", "")
        timeout = os.environ.get("RINGFLOW_ELASTIC_TIMEOUT_S", "600")
        try:
            worker_id, timeout_s = int(text), float(timeout)
        except ValueError:
            raise ConfigError(f"RINGFLOW_ELASTIC_ID={text!r} and RINGFLOW_ELASTIC_TIMEOUT_S="
                              f"{timeout!r} must be a number each; they come from ringflow-run "
                              "--min-np/--max-np: unset them outside such a job") from None
        _world = World(connect(timeout=config.timeout_s), worker_id, timeout_s,
                       config.timeout_s)
    answer = _world.join()
    if answer is None:
        log.info("this worker was removed from the elastic job (its host left the discovery "
                 "script's list); exiting with code 0")
        raise SystemExit(0)
    generation, info = answer
    return _world.store_of(generation), info, f"elastic{generation}/"


def world() -> Any:
    """This elastic worker's :class:`~ringflow.world.World` (None outside an elastic job, or
    before its first ``init()``)."""
    return _world


def get_client() -> Client:
    """The job's key-value client (MegEngine's ``dist.get_client()``): ``user_set(key, value)``
    and ``user_get(key, timeout=None)`` on the store every rank reached at ``init()``."""
    running()
    return _state()[2]  # type: ignore[no-any-return]


def shutdown() -> None:
    """Stop the engine; pending operations fail with ShutdownError. Safe to call twice."""
    global _engine
    binding = _local.binding
    with _state_lock:
        if binding is not None:
            engine, binding.engine = binding.engine, None
        else:
            engine, _engine = _engine, None
    if engine is not None:
        log.debug("shutting down")
        if binding is None:
            failure.at_shutdown(engine.fatal)
        engine.shutdown()


def _forget_after_fork() -> None:
    """In a child forked from a rank (``os.fork()``, a fork-started DataLoader worker): the
    engine, its sockets, its shared memory and the store connection are the parent's, and no
    thread of the engine survives the fork. The child is no rank: it forgets them without closing
    or writing anything, so that its exit says no goodbye on the parent's connections (which
    would end the parent's job) and ringflow calls in the child raise NotInitializedError."""
    global _engine, _info, _client, _state_lock, _local, _world
    _state_lock = threading.Lock()  # another thread may have held it at the fork
    _local = _Local()
    _engine = _info = _client = _world = None
    failure.forget()


def _shutdown_at_exit() -> None:
    """The process is ending: if an uncaught exception ends it, say so first (the job fails
    naming this rank's error, :mod:`ringflow.failure`), then shut down (the goodbye)."""
    failure.at_exit()
    shutdown()


atexit.register(_shutdown_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def is_initialized() -> bool:
    return _state()[0] is not None


def running() -> Engine:
    """The running :class:`~ringflow.engine.Engine`.

    Raises:
        NotInitializedError: :func:`init` has not been called (or :func:`shutdown` was).
    """
    engine = _state()[0]
    if engine is None:
        raise NotInitializedError("ringflow has not been initialized; call ringflow.init() first")
    return engine


def _rank_info(placed: bool = False) -> RankInfo:
    """The running job's RankInfo; before :func:`init`, the launcher's (``topology.detect()``).

    Raises:
        NotInitializedError: this thread is a rank of ``run_engines`` whose engine was shut
            down; or ``placed`` and the launcher does not give local values before init().
        ConfigError: not initialized, and the launcher's environment is invalid or says the
            job has several processes without a rank variable (what init() would raise).
    """
    engine, info, _ = _state()
    if engine is not None:
        return info  # type: ignore[no-any-return]
    if _local.binding is not None:
        running()  # raises: a thread-rank does not fall back to the process's environment
    from . import topology

    info = topology.detect()
    if placed and not info.placed:
        raise NotInitializedError(
            f"the {info.detector} launcher gives no local rank or size before init() (they "
            "come from the ranks' host names, which init() exchanges); call ringflow.init() "
            "first, or set LOCAL_RANK and LOCAL_WORLD_SIZE")
    return info


# Before init() these answer from the launcher's environment, as Jittor's jt.rank and
# jt.world_size do (DESIGN.md section 10); after shutdown() too.
def rank() -> int:
    return int(_rank_info().rank)


def size() -> int:
    return int(_rank_info().size)


def local_rank() -> int:
    return int(_rank_info(placed=True).local_rank)


def local_size() -> int:
    return int(_rank_info(placed=True).local_size)


def cross_rank() -> int:
    return int(_rank_info(placed=True).cross_rank)


def cross_size() -> int:
    return int(_rank_info(placed=True).cross_size)


def stats() -> dict[str, int]:
    """Engine counters (collectives run, tensors, cache hits, negotiations, ...), for tests."""
    eng = running()
    out = dict(eng.stats)
    if eng.coordinator is not None:
        out.update(eng.coordinator.stats)
    out["cached_names"] = len(eng.cache.key_of)
    return out


def _exit_on_sigterm() -> None:
    """In a worker of ringflow-run or ringflow.run: make the launcher's SIGTERM (sent when
    another rank failed, or on Ctrl-C) raise SystemExit in the main thread, so ``finally``
    blocks and atexit handlers run and buffered output is flushed before the process ends.
    Python's default would end the process at once; a handler the program set stays."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def info() -> RankInfo:
    """This process's :class:`~ringflow.topology.RankInfo` (``detector`` names the launcher);
    before :func:`init`, the launcher's (local values 0 where it gives none: ``placed`` False)."""
    return _rank_info()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording the job's timeline: rank 0 writes one Chrome-trace file at ``file_path``
    with a track per rank on rank 0's clock (:mod:`ringflow.timeline`). Call it on every rank,
    as Horovod's: a rank that does not record has no track (``file_path`` counts on rank 0).
    ``mark_cycles`` is accepted for Horovod compatibility; ringflow has no cycles to mark
    (negotiation is event-driven)."""
    running().timeline(str(file_path))


def stop_timeline() -> None:
    """Stop recording the timeline started by :func:`start_timeline` or RINGFLOW_TIMELINE_PATH;
    on rank 0, finish the file (waiting up to 2 s for the other ranks' last records)."""
    running().timeline(None)
