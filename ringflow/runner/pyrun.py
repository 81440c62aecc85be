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

import functools
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, RankFailure, RingflowError
from .hosts import Host, assign_ranks, parse_hosts
from .launch import run_job, start_store
from .ssh import SshOptions

__all__ = ["launcher", "run"]

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
    try:
        payload = _pickler().dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:  # pickling raises anything a __reduce__ raises
        raise ConfigError(
            f"ringflow.run could not pickle {fn!r} and its arguments ({exc}); pass a "
            "module-level function of an importable module and picklable arguments"
        ) from exc
    from ..rendezvous import TCPStore

    secret, server = start_store(workers, network_interface, start_timeout)
    try:
        with TCPStore(server.host, server.port, secret, start_timeout) as store:
            store.set(_KEY + "path", pickle.dumps(list(sys.path)))
            store.set(_KEY + "fn", payload)
            result = run_job(
                [sys.executable, "-c", _BOOTSTRAP], workers, base_env=env, ssh=ssh,
                start_timeout_s=start_timeout, timeout_s=timeout, output_dir=output_dir,
                store=(secret, server),
            )
            outcomes = [_outcome(store, rank) for rank in range(np)]
    finally:
        server.close()
    return _results(result, outcomes, timeout)


def _outcome(store: Any, rank: int) -> tuple[Any, ...] | None:
    try:
        # Sent by our own workers over the authenticated store.
        return tuple(pickle.loads(store.get(f"{_KEY}result/{rank}", timeout=0.01)))
    except (RingflowError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def _results(result: Any, outcomes: list[tuple[Any, ...] | None], timeout: float | None) -> list:
    if result.first_failure is not None:  # the root cause, not a rank that failed of it
        first = result.first_failure
        outcome = outcomes[first.rank]
        if outcome is not None and outcome[0] == "error":
            raise RankFailure(first.rank, f"{outcome[1]}\n{outcome[2]}")
        if first.status is not None and first.status.traceback:
            raise RankFailure(first.rank, f"{first.status.error}\n{first.status.traceback}")
        tail = "\n".join(first.stderr_tail)
        raise RankFailure(first.rank, f"{first.describe()}\n{tail}".rstrip())
    if result.timed_out or result.stopped_by is not None:
        unfinished = result.unfinished
        rank = unfinished[0] if unfinished else 0
        why = (f"did not finish within the deadline of {timeout} s" if result.timed_out
               else f"was stopped by signal {result.stopped_by}")
        raise RankFailure(
            rank, f"{why}; ranks {unfinished} were still running and were killed (a hang, or "
            "raise the deadline)",
        )
    values = []
    for rank, outcome in enumerate(outcomes):
        if outcome is None or outcome[0] != "ok":
            raise RankFailure(rank, "exited with code 0 without reporting a result")
        values.append(outcome[1])
    return values


def launcher(
    fn: Callable[..., Any] | None = None, *, np: int = 2, **run_kwargs: Any
) -> Any:
    """Decorator: calling the function runs it on ``np`` ranks and returns the list of results.

    ``@ringflow.launcher(np=4)`` (or bare ``@ringflow.launcher``, 2 ranks) is MegEngine's
    ``dist.launcher``; ``run_kwargs`` are :func:`run`'s keyword arguments (``hosts``, ``timeout``,
    ...). Inside the ranks the decorated name calls the plain function.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _IN_WORKER:
                return func(*args, **kwargs)
            return run(wrapper, args, kwargs, np=np, **run_kwargs)

        # How a worker finds the body when the wrapper itself arrives (it is what the decorated
        # module attribute names, so pickle sends it).
        wrapper._ringflow_body = func  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


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
        sys.path[:] = pickle.loads(store.get(_KEY + "path"))
        fn, args, kwargs = pickle.loads(store.get(_KEY + "fn"))
        fn = getattr(fn, "_ringflow_body", fn)
        data = pickle.dumps(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # every failure goes back to the launcher, with its traceback
        # First, as an uncaught exception would: record whether the failure is this rank's own
        # or another rank's doing, and fail the job on every rank naming it (ringflow.failure).
        failure.report(exc)
        data = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    store.set(f"{_KEY}result/{rank}", data)
    store.close()
    sys.exit(code)
