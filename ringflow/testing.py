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
- Each rank closes its own transport when ``fn`` returns (all ranks concurrently, as processes
  would at exit); after a failure the harness closes them all. Closing is bounded in time, so a
  transport whose ``close`` hangs cannot hang the test run.

Transports: ``"loopback"`` (one :class:`~ringflow.transport.loopback.LoopbackWorld`) or ``"tcp"``
(real sockets on this host, through ``ringflow.transport.create("tcp", rank, n, store, config)``
with a shared :class:`ringflow.rendezvous.MemoryStore`). Their per-operation timeouts are twice
the deadline, so a hang is always reported by the deadline.
"""

from __future__ import annotations

import contextlib
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
# How long closing the transports may take in all (tcp lingers up to 2 s for goodbyes).
_CLOSE_WAIT_S = 10.0


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
            # Each rank closes its own transport when done, as a process would at exit; the
            # ranks close concurrently, so a transport that lingers for its peers' goodbyes
            # waits once, not once per rank.
            t.close()
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
        _close_all(transports)
        grace_end = time.monotonic() + min(_JOIN_GRACE_S, deadline)
        for thread in threads:
            thread.join(max(0.0, grace_end - time.monotonic()))
    with run.cond:
        transports = list(run.transports)
    _close_all(transports)  # idempotent for those the ranks closed themselves
    if store is not None:
        store.close()
    if error is not None:
        raise error from cause
    return run.results


def _close_all(transports: Sequence[Transport | None]) -> None:
    """Close the transports concurrently, waiting at most ``_CLOSE_WAIT_S`` for all of them.

    Concurrently because a transport may linger in ``close`` for its peers' goodbyes; bounded
    because a transport whose ``close`` hangs must not hang the test run (the close threads are
    daemons and their errors are ignored: the ranks' outcome is already known).
    """

    def close(t: Transport) -> None:
        with contextlib.suppress(Exception):
            t.close()

    closers = [
        threading.Thread(target=close, args=(t,), name="ringflow-close", daemon=True)
        for t in transports
        if t is not None
    ]
    for thread in closers:
        thread.start()
    end = time.monotonic() + _CLOSE_WAIT_S
    for thread in closers:
        thread.join(max(0.0, end - time.monotonic()))


# --- spawn_ranks (processes) -------------------------------------------------------------------
# spawn_ranks is ringflow.run (ringflow.runner.pyrun) with a test deadline: one implementation.


def spawn_ranks(
    n: int, fn: Callable[..., Any], *, args: tuple[Any, ...] = (), deadline: float = 120.0
) -> list[Any]:
    """Run ``fn(*args)`` in ``n`` processes, one per rank; return the results in rank order.

    The processes are started by :func:`ringflow.run` (through
    :func:`ringflow.runner.launch.run_job`), as ``ringflow-run -np n`` would start them: each has
    the full ``RINGFLOW_*`` environment contract (rank, size, rendezvous store, secret), so ``fn``
    can call ``ringflow.init()``. ``fn``, ``args`` and the return values travel pickled through the
    job's store; the workers get this process's ``sys.path`` and working directory. Output is
    relayed prefixed ``[rank]:``.

    Raises:
        RankFailure: the first rank whose ``fn`` raised (message: ``"<type>: <msg>"`` and the
            remote traceback) or whose process died; every other rank is killed first. When
            ``deadline`` seconds pass, every rank is killed and the lowest unfinished rank is named.
        ConfigError: ``n < 1``, or ``fn`` / ``args`` cannot be pickled.
    """
    from .runner.pyrun import run

    if n < 1:
        raise ConfigError(f"spawn_ranks(n={n}) needs at least one rank; pass n >= 1")
    return run(fn, args, np=n, timeout=deadline)
