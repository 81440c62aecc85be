"""Start ranks from Python: :func:`run` (``horovod.run``) and :func:`launcher` (MegEngine).

``run(fn, args, kwargs, np=2, hosts=None)`` runs ``fn(*args, **kwargs)`` in ``np`` new processes,
started by :func:`ringflow.runner.launch.run_job` exactly as ``ringflow-run -np N -H HOSTS`` starts
them (so ``fn`` may call ``ringflow.init()``), and returns the ``np`` return values in rank order.
:func:`ringflow.testing.spawn_ranks` is this function with a test deadline.

How the function travels. The launcher starts the job's store itself (:func:`~.launch.start_store`)
and puts into it, before any worker starts, ``sys.path`` and the pickled ``(fn, args, kwargs)``
(``cloudpickle`` where installed, so lambdas and functions of ``__main__`` work; else ``pickle``,
which needs a module-level function of an importable module). Each worker runs
``python -c <bootstrap>``, connects to the store with the job secret, applies ``sys.path``, calls
the function, and stores its pickled outcome -- ``("ok", value)`` or ``("error", "Type: message",
traceback)`` -- then exits 0 or 1. The launcher reads the outcomes before it closes the store.
Everything travels through the HMAC-authenticated store, never through files, so workers on other
hosts need no shared filesystem; a value is limited to the store's 64 MiB.

Errors: the rank whose failure came first -- the root cause, not a rank whose collectives then
failed because of it (:mod:`ringflow.runner.report`) -- is re-raised as
:class:`~ringflow.errors.RankFailure` naming the rank, with its own traceback; the other ranks are
stopped first. A function that raises fails the job on every rank at once, naming the rank and
its error (:mod:`ringflow.failure`), as an uncaught exception in a script does.

``torch.multiprocessing.spawn(fn, args, nprocs=n)`` users write ``ringflow.run(fn, args, np=n)``
and read the rank from ``ringflow.rank()`` (after ``ringflow.init()``) instead of a first argument.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, RankFailure, RingflowError
from .hosts import Host, WorkerSpec, assign_ranks, parse_hosts
from .launch import run_job, start_store
from .machines import Machine as _Machine
from .ssh import SshOptions

__all__ = ["launcher", "run"]

log = logging.getLogger(__name__)

_KEY = "ringflow.run/"
#: Set in a worker process of :func:`run`, so that a :func:`launcher`-decorated function that
#: arrives there (pickled by reference to its module attribute: the wrapper) runs its body.
_IN_WORKER = False

_BOOTSTRAP = "from ringflow.runner.pyrun import _worker_main; _worker_main()\n"


def _pickler() -> Any:
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        return pickle


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int = 2,
    hosts: str | Sequence[Host] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ssh: SshOptions | None = None,
    network_interface: str | None = None,
    start_timeout: float = 30.0,
    timeout: float | None = None,
    output_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; return their results in rank order.

    ``hosts`` is ``-H``'s text (``"node1:2,node2:2"``) or a list of :class:`Host`; ``None`` runs
    every rank on this host. ``env`` replaces ``os.environ`` as the workers' base environment.
    ``timeout`` bounds the whole run in seconds (``None``: no bound).

    Raises:
        RankFailure: a rank raised or died (the one whose failure came first, not one that
            failed because of it, is named, with its traceback), or ranks were still running
            at ``timeout`` (the lowest is named).
        ConfigError: ``np < 1``, or ``fn`` and its arguments cannot be pickled.
        LaunchError: more ranks than slots, or a worker or the store could not start.
    """
    if np < 1:
        raise ConfigError(f"ringflow.run(np={np}) needs at least one rank; pass np >= 1")
    host_list = parse_hosts(hosts) if isinstance(hosts, str) else list(hosts or [])
    workers = assign_ranks(host_list or [Host("localhost", np)], np)
    payload = _pickle_call(fn, args, kwargs)
    from ..rendezvous import TCPStore

    secret, server = start_store(workers, network_interface, start_timeout)
    try:
        with TCPStore(server.host, server.port, secret, start_timeout) as store:
            _put_function(store, workers, payload)
            result = run_job(
                [sys.executable, "-c", _BOOTSTRAP], workers, base_env=env, ssh=ssh,
                start_timeout_s=start_timeout, timeout_s=timeout, output_dir=output_dir,
                store=(secret, server),
            )
            outcomes = {rank: _outcome(store, rank) for rank in range(np)}
    finally:
        server.close()
    return _results(result, outcomes, timeout)


def _put_function(store: Any, workers: Sequence[WorkerSpec], payload: bytes) -> None:
    """``sys.path`` and the function, under the first rank of each host: the key a worker
    derives from its own variables (``rank - local_rank``). The machines of a multi-machine
    launch share one store, each with its own function (the same program, its own objects)."""
    path = pickle.dumps(list(sys.path))
    for first in sorted({w.rank - w.local_rank for w in workers}):
        store.set(f"{_KEY}{first}/path", path)
        store.set(f"{_KEY}{first}/fn", payload)


def _pickle_call(fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: Mapping[str, Any] | None) -> bytes:
    try:
        return _pickler().dumps((fn, tuple(args), dict(kwargs or {})))  # type: ignore[no-any-return]
    except Exception as exc:  # pickling raises anything a __reduce__ raises
        raise ConfigError(
            f"ringflow.run could not pickle {fn!r} and its arguments ({exc}); pass a "
            "module-level function of an importable module and picklable arguments"
        ) from exc


def _outcome(store: Any, rank: int) -> tuple[Any, ...] | None:
    try:
        # Sent by our own workers over the authenticated store.
        return tuple(pickle.loads(store.get(f"{_KEY}result/{rank}", timeout=0.01)))
    except (RingflowError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def _results(result: Any, outcomes: dict[int, tuple[Any, ...] | None],
             timeout: float | None, first_rank: int = 0) -> list:
    """The values of ``outcomes`` (by rank, in rank order), or the job's first failure raised.
    ``first_rank`` is the rank of the job's first worker (``result`` counts workers from 0)."""
    if result.first_failure is not None:  # the root cause, not a rank that failed of it
        first = result.first_failure
        outcome = outcomes.get(first.rank)
        if outcome is not None and outcome[0] == "error":
            raise RankFailure(first.rank, f"{outcome[1]}\n{outcome[2]}")
        if first.status is not None and first.status.traceback:
            raise RankFailure(first.rank, f"{first.status.error}\n{first.status.traceback}")
        tail = "\n".join(first.stderr_tail)
        raise RankFailure(first.rank, f"{first.describe()}\n{tail}".rstrip())
    if result.timed_out or result.stopped_by is not None:
        unfinished = [first_rank + i for i in result.unfinished]
        rank = unfinished[0] if unfinished else first_rank
        why = (f"did not finish within the deadline of {timeout} s" if result.timed_out
               else f"was stopped by signal {result.stopped_by}")
        raise RankFailure(
            rank, f"{why}; ranks {unfinished} were still running and were killed (a hang, or "
            "raise the deadline)",
        )
    values = []
    for rank, outcome in sorted(outcomes.items()):
        if outcome is None or outcome[0] != "ok":
            raise RankFailure(rank, "exited with code 0 without reporting a result")
        values.append(outcome[1])
    return values


def launcher(
    fn: Callable[..., Any] | None = None,
    *,
    n_gpus: int | None = None,
    world_size: int | None = None,
    rank_start: int = 0,
    master_ip: str = "localhost",
    port: int = 0,
    np: int | None = None,
    secret: bytes | str | None = None,
    **run_kwargs: Any,
) -> Any:
    """MegEngine's ``dist.launcher``: calling the decorated function runs it on this machine's
    ranks, each of which has called :func:`ringflow.init` first; returns their results.

    ``@ringflow.launcher`` (bare), ``@ringflow.launcher(n_gpus=4)`` and, on each of several
    machines, ``@ringflow.launcher(world_size=W, n_gpus=n, rank_start=s, master_ip=ADDR,
    port=P)`` -- the same program on every machine (:mod:`.machines`). Arguments as in
    MegEngine:

    * ``n_gpus``: processes on this machine (``np`` is a synonym). Default: the number of CUDA
      devices when torch is imported and sees any, else 2 (MegEngine: the device count).
    * ``world_size``: processes of the whole job; default ``n_gpus``.
    * ``rank_start``: the global rank of this machine's first process (0 makes this machine the
      master, which serves the job's store).
    * ``master_ip``, ``port``: where the master serves the store (MegEngine's distributed
      server). ``port=0`` picks a free one, which only a job of one machine can use.
    * ``secret`` (ringflow's): the job secret every machine must share (bytes or hex text);
      default ``RINGFLOW_SECRET_FILE``'s, else a fresh one for a job of one machine.

    Returns the results of this machine's ranks in rank order (MegEngine returns them by local
    device, the same order). In a process that another launcher started as a rank of a job of
    several (``ringflow-run -np 2 python script.py``, mpirun, srun, torchrun), it starts nothing:
    it runs the function in this process, between ``init()`` and ``shutdown()``, and returns
    ``[its result]``. ``run_kwargs`` are :func:`run`'s (``timeout``, ``env``,
    ``start_timeout``, ``output_dir``; ``hosts`` and ``ssh`` only for a job of one launcher, which
    then starts remote ranks over ssh). Inside the ranks the decorated name calls the plain
    function; :func:`ringflow.shutdown` follows it.

    Raises:
        RankFailure: a rank of this machine raised or died (the root cause where it is here).
        ConfigError: inconsistent arguments (ranks beyond ``world_size``, several machines
            without a port or a secret, machines that disagree), detected before any process
            starts (machines: at the rendezvous).
        LaunchError: not every machine joined within ``start_timeout`` (default 30 s, 300 s
            for several machines), or a process could not start.
    """
    if np is not None and n_gpus is not None and np != n_gpus:
        raise ConfigError(f"launcher(np={np}, n_gpus={n_gpus}): they are synonyms; pass one")
    count = n_gpus if n_gpus is not None else np
    machine = _Machine(
        world_size if world_size is not None else (count or 0), count or 0, rank_start,
        master_ip, port)
    if run_kwargs.get("hosts") is not None and world_size not in (None, count):
        raise ConfigError("launcher(hosts=..., world_size=...): start remote ranks either from "
                          "one launcher over ssh (hosts=) or by running the program on each "
                          "machine (world_size, rank_start), not both")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _IN_WORKER:
                return func(*args, **kwargs)
            if _under_a_launcher():
                return [_in_place(func, args, kwargs, machine if count is not None else None)]
            here = machine if count is not None else dataclasses.replace(
                machine, n=_default_count(),
                world_size=world_size if world_size is not None else _default_count())
            return _launch(wrapper, args, kwargs, here.check(), secret, run_kwargs)

        # How a worker finds the body when the wrapper itself arrives (it is what the decorated
        # module attribute names, so pickle sends it), and that it must init() for it.
        wrapper._ringflow_body = func  # type: ignore[attr-defined]
        wrapper._ringflow_init = True  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


def _under_a_launcher() -> bool:
    """Whether this process is already a rank of a job of several (ringflow-run, mpirun, srun,
    torchrun started it): then the launcher starts nothing."""
    from ..topology import detect

    return detect().size > 1


def _in_place(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
              machine: Any) -> Any:
    """The function in this process, a rank of the job another launcher started; its counts
    are that launcher's (``ringflow-run -np 2 python megengine_script.py`` works)."""
    import ringflow

    ringflow.init()
    try:
        if machine is not None and machine.world_size != ringflow.size():
            log.warning("launcher(world_size=%d) runs inside a job of %d processes started by "
                        "another launcher; the job's size wins", machine.world_size,
                        ringflow.size())
        return func(*args, **kwargs)
    finally:
        ringflow.shutdown()


def _default_count() -> int:
    """MegEngine's default: a process per device. Without torch, or on CPUs: 2 (ringflow.run's)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                return int(torch.cuda.device_count())
        except Exception:  # a broken CUDA setup counts as none
            pass
    return 2


def _launch(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
            machine: Any, secret: bytes | str | None, run_kwargs: dict[str, Any]) -> list[Any]:
    if machine.alone and not machine.port and secret is None:
        return run(fn, args, kwargs, np=machine.n, **run_kwargs)
    from . import machines

    options = dict(run_kwargs)
    start_timeout = options.pop("start_timeout", 30.0 if machine.alone else 300.0)
    timeout = options.pop("timeout", None)
    env, output_dir = options.pop("env", None), options.pop("output_dir", None)
    if options:
        raise ConfigError(f"launcher({', '.join(sorted(options))}=...) cannot be used with "
                          "world_size / rank_start / port / secret")
    key = machines.resolve_secret(secret, machine)
    payload = _pickle_call(fn, args, kwargs)

    def start(store: Any, joined: Any, where: tuple[bytes, Any]) -> list[Any]:
        _put_function(store, joined.workers, payload)
        result = run_job(
            [sys.executable, "-c", _BOOTSTRAP], joined.workers, base_env=env,
            start_timeout_s=start_timeout, timeout_s=timeout, output_dir=output_dir,
            store=where, master_addr=machine.master_ip, master_port=joined.master_port,
        )
        ranks = range(machine.rank_start, machine.rank_start + machine.n)
        outcomes = {rank: _outcome(store, rank) for rank in ranks}
        return _results(result, outcomes, timeout, machine.rank_start)

    return machines.join(machine, key, start_timeout, start)  # type: ignore[no-any-return]


def _worker_main() -> None:
    """The body of a :func:`run` worker process."""
    global _IN_WORKER
    import traceback

    from .. import failure
    from ..rendezvous import connect

    _IN_WORKER = True
    rank = int(os.environ["RINGFLOW_RANK"])
    store = connect()
    code = 0
    try:
        first = rank - int(os.environ["RINGFLOW_LOCAL_RANK"])
        sys.path[:] = pickle.loads(store.get(f"{_KEY}{first}/path"))
        fn, args, kwargs = pickle.loads(store.get(f"{_KEY}{first}/fn"))
        if getattr(fn, "_ringflow_init", False):  # @launcher: MegEngine's workers are in a job
            import ringflow

            ringflow.init()
            try:
                value = fn._ringflow_body(*args, **kwargs)
            finally:
                ringflow.shutdown()
        else:
            value = getattr(fn, "_ringflow_body", fn)(*args, **kwargs)
        data = pickle.dumps(("ok", value))
    except BaseException as exc:  # every failure goes back to the launcher, with its traceback
        # First, as an uncaught exception would: record whether the failure is this rank's own
        # or another rank's doing, and fail the job on every rank naming it (ringflow.failure).
        failure.report(exc)
        data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    store.set(f"{_KEY}result/{rank}", data)
    store.close()
    sys.exit(code)
