"""Harnesses that run the ranks of a test: :func:`run_ranks` (threads of this process).

``run_ranks(n, fn)`` starts ``n`` daemon threads; thread ``r`` builds the transport of rank ``r``
and calls ``fn(t, *args)``. Contract:

- Returns the ``n`` results in rank order once every rank has returned.
- The first exception on any rank aborts every rank -- loopback: ``world.abort``; tcp: every
  rank's transport is closed -- so ranks blocked on the failed one are released instead of
  hanging, and is re-raised as :class:`~ringflow.errors.RankFailure` naming that rank, with the
  exception type, message and traceback, chained from the original. Failures that the abort
  itself causes on the other ranks are not reported.
- Past ``deadline`` seconds, the lowest unfinished rank is reported as a RankFailure ("did not
  finish within ...", with the stack it is stuck in) and every rank is aborted.
- Every transport is closed before ``run_ranks`` returns or raises.

Transports: ``"loopback"`` (one :class:`~ringflow.transport.loopback.LoopbackWorld`) or ``"tcp"``
(real sockets on this host, through ``ringflow.transport.create("tcp", rank, n, store, config)``
with a shared :class:`ringflow.rendezvous.MemoryStore`). Their per-operation timeouts are twice
the deadline, so a hang is always reported by the deadline.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .config import Config
from .errors import ConfigError, PeerError, RankFailure
from .transport import Transport, create
from .transport.loopback import LoopbackWorld

__all__ = ["run_ranks", "spawn_ranks"]

# After an abort, how long (at most, and never longer than the deadline) run_ranks waits for the
# released threads to return before it raises anyway (they are daemon threads; a rank stuck
# outside ringflow cannot be interrupted).
_JOIN_GRACE_S = 5.0
# Transport and store timeouts are a multiple of the deadline, so that a stuck test is reported
# by the deadline (with the stack of the stuck rank), not by whichever rank's timeout fires first.
_OP_TIMEOUT_FACTOR = 2.0


class _Run:
    """Shared state of one run_ranks call; every field is guarded by ``cond``."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.results: list[Any] = [None] * n
        self.finished = [False] * n
        self.transports: list[Transport | None] = [None] * n
        self.failure: tuple[int, BaseException, str] | None = None
        self.aborted = False


def run_ranks(
    n: int,
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    deadline: float = 60.0,
    transport: str = "loopback",
) -> list[Any]:
    """Run ``fn(t, *args)`` on ``n`` ranks as threads; return the results in rank order.

    Raises RankFailure for the first rank that raised or, past ``deadline``, for the lowest rank
    that did not finish; every rank is aborted first.
    """
    if n < 1:
        raise ConfigError(f"run_ranks needs at least 1 rank, got n={n}")
    store = None
    if transport == "loopback":
        world = LoopbackWorld(n, timeout=_OP_TIMEOUT_FACTOR * deadline)

        def make(rank: int) -> Transport:
            return world.transport(rank)

        def abort(exc: BaseException) -> None:
            world.abort(exc)

    elif transport == "tcp":
        from .rendezvous import MemoryStore  # written alongside the tcp transport

        store = MemoryStore(_OP_TIMEOUT_FACTOR * deadline)
        config = Config(timeout_s=_OP_TIMEOUT_FACTOR * deadline)

        def make(rank: int) -> Transport:
            return create("tcp", rank, n, store, config)

        def abort(exc: BaseException) -> None:
            store.close()  # releases ranks still in the rendezvous; transports are closed below
    else:
        raise ConfigError(
            f"run_ranks supports transport='loopback' or 'tcp', got {transport!r}"
        )

    run = _Run(n)

    def body(rank: int) -> None:
        try:
            t = make(rank)
            with run.cond:
                run.transports[rank] = t
                late = run.aborted
            if late:  # the abort closed the others before this one existed
                t.close()
                raise PeerError(f"rank {rank}: the test was aborted while it was connecting")
            result = fn(t, *args)
        except BaseException as exc:
            text = traceback.format_exc()
            with run.cond:
                if run.failure is None and not run.aborted:
                    run.failure = (rank, exc, text)
                run.finished[rank] = True
                run.cond.notify_all()
            return
        with run.cond:
            run.results[rank] = result
            run.finished[rank] = True
            run.cond.notify_all()

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"ringflow-rank-{rank}", daemon=True)
        for rank in range(n)
    ]
    for thread in threads:
        thread.start()

    end = time.monotonic() + deadline
    with run.cond:
        while run.failure is None and not all(run.finished):
            left = end - time.monotonic()
            if left <= 0:
                break
            run.cond.wait(left)
        failure = run.failure
        stuck = None if failure or all(run.finished) else run.finished.index(False)
        run.aborted = failure is not None or stuck is not None
        transports = list(run.transports)

    error: RankFailure | None = None
    cause: BaseException | None = None
    if failure is not None:
        rank, cause, text = failure
        error = RankFailure(rank, f"{type(cause).__name__}: {cause}\n{text}")
        reason = f"rank {rank} failed ({type(cause).__name__}: {cause})"
    elif stuck is not None:
        frame = sys._current_frames().get(threads[stuck].ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(exited)\n"
        error = RankFailure(
            stuck,
            f"did not finish within {deadline:g}s; raise deadline= if the test is slow, else "
            f"look for a collective that this rank and its peers do not both call. "
            f"It was at:\n{where}",
        )
        reason = f"rank {stuck} did not finish within {deadline:g}s"

    if error is not None:
        abort(PeerError(f"{reason}; the test harness aborted every rank"))
        for t in transports:
            if t is not None:
                t.close()
        grace_end = time.monotonic() + min(_JOIN_GRACE_S, deadline)
        for thread in threads:
            thread.join(max(0.0, grace_end - time.monotonic()))
    with run.cond:
        transports = list(run.transports)
    for t in transports:
        if t is not None:
            t.close()
    if store is not None:
        store.close()
    if error is not None:
        raise error from cause
    return run.results


# --- spawn_ranks (processes) -------------------------------------------------------------------
# spawn_ranks starts real processes through ringflow.runner.launch.run_job (the ringflow-run
# machinery), so each worker has the full RINGFLOW_* contract. Its stdlib imports are local to keep
# this section self-contained.

_SPAWN_BOOTSTRAP = (
    "import pickle, sys\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    sys.path[:] = pickle.load(f)\n"
    "from ringflow.testing import _spawned_main\n"
    "_spawned_main(sys.argv[1], sys.argv[2])\n"
)


def spawn_ranks(
    n: int, fn: Callable[..., Any], *, args: tuple[Any, ...] = (), deadline: float = 120.0
) -> list[Any]:
    """Run ``fn(*args)`` in ``n`` processes, one per rank; return the results in rank order.

    The processes are started by :func:`ringflow.runner.launch.run_job`, as ``ringflow-run -np n``
    would start them: each has the full ``RINGFLOW_*`` environment contract (rank, size, rendezvous
    store, secret), so ``fn`` can call ``ringflow.init()``. ``fn``, ``args`` and the return values
    travel by pickle, so ``fn`` must be a module-level function of an importable module; the
    workers get this process's ``sys.path`` and working directory. Output is relayed prefixed
    ``[rank]:``.

    Raises:
        RankFailure: the first rank whose ``fn`` raised (message: ``"<type>: <msg>"`` and the
            remote traceback) or whose process died; every other rank is killed first. When
            ``deadline`` seconds pass, every rank is killed and the lowest unfinished rank is named.
        ConfigError: ``n < 1``, or ``fn`` / ``args`` cannot be pickled.
    """
    import os
    import pickle
    import tempfile

    from .runner.hosts import Host, assign_ranks
    from .runner.launch import run_job

    if n < 1:
        raise ConfigError(f"spawn_ranks(n={n}) needs at least one rank; pass n >= 1")
    with tempfile.TemporaryDirectory(prefix="ringflow-spawn-") as workdir:
        payload = os.path.join(workdir, "payload.pkl")
        try:
            with open(payload, "wb") as f:
                pickle.dump(list(sys.path), f)
                pickle.dump((fn, args), f)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"spawn_ranks could not pickle {fn!r} and its args ({exc}); pass a module-level "
                "function of an importable module and picklable arguments"
            ) from exc
        workers = assign_ranks([Host("localhost", n)], n)
        command = [sys.executable, "-c", _SPAWN_BOOTSTRAP, payload, workdir]
        result = run_job(command, workers, timeout_s=deadline)
        outcomes = [_read_outcome(workdir, rank) for rank in range(n)]
    if result.first_failure is not None:
        rank = result.first_failure.rank
        outcome = outcomes[rank]
        if outcome is not None and outcome[0] == "error":
            raise RankFailure(rank, f"{outcome[1]}\n{outcome[2]}")
        tail = "\n".join(result.first_failure.stderr_tail)
        raise RankFailure(rank, f"{result.first_failure.describe()}\n{tail}".rstrip())
    if result.timed_out or result.stopped_by is not None:
        unfinished = result.unfinished
        rank = unfinished[0] if unfinished else 0
        raise RankFailure(
            rank,
            f"did not finish within the deadline of {deadline} s; ranks {unfinished} were still "
            "running and were killed (a hang, or raise spawn_ranks' deadline)",
        )
    values = []
    for rank, outcome in enumerate(outcomes):
        if outcome is None or outcome[0] != "ok":
            raise RankFailure(rank, "exited with code 0 without reporting a result")
        values.append(outcome[1])
    return values


def _result_path(workdir: str, rank: int) -> str:
    import os

    return os.path.join(workdir, f"result-{rank}.pkl")


def _read_outcome(workdir: str, rank: int) -> tuple[Any, ...] | None:
    import pickle

    # Written by our own child processes into a private (0700) temporary directory.
    try:
        with open(_result_path(workdir, rank), "rb") as f:
            return tuple(pickle.load(f))
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _spawned_main(payload: str, workdir: str) -> None:
    """The body of a :func:`spawn_ranks` worker process."""
    import os
    import pickle

    rank = int(os.environ["RINGFLOW_RANK"])
    code = 0
    try:
        with open(payload, "rb") as f:
            pickle.load(f)  # sys.path, already applied by the bootstrap
            fn, args = pickle.load(f)
        outcome: tuple[Any, ...] = ("ok", fn(*args))
        data = pickle.dumps(outcome)
    except BaseException as exc:  # every failure goes back to the parent, with its traceback
        outcome = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        data = pickle.dumps(outcome)
        code = 1
    tmp = _result_path(workdir, rank) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, _result_path(workdir, rank))
    sys.exit(code)
