"""How a rank's failure reaches the other ranks and the launcher: the root cause, not its echo.

When one rank raises, the others fail because of it a moment later (their collectives end with
PeerError or ShutdownError), and the first process to *exit* is often one of those: the rank that
raised is still printing its traceback or saying goodbye. So a rank that fails says, before
anything else, whether the failure is its own.

When an exception reaches the top of a rank's main thread (or of a :func:`ringflow.run`
function), :func:`report` does, in this order, before the process's atexit shutdown:

1. **Classify.** The failure is *secondary* (``"peer"``: another rank failed, or the job already
   had) when the exception, or one in its ``__cause__`` / ``__context__`` chain, is a
   :class:`~ringflow.errors.PeerError` (not an AuthenticationError), a ShutdownError or a
   RingflowTimeoutError: what ringflow raises on a rank because of something another rank did or
   failed to do. Anything else is the rank's own failure: ``"crashed"``. A rank that catches a
   PeerError and raises its own exception from it is secondary too. (A ShutdownError the rank
   brought on itself, a collective after its own ``shutdown()``, also reads as secondary; that
   only matters when another rank failed as well.)
2. **Record.** Under ringflow-run and ringflow.run, whose launcher reads it, the rank writes its
   *status* into the job's store under ``status/<rank>`` (:data:`STATUS_KEY`), one JSON object:
   ``{"kind": "crashed" | "peer", "error": "Type: message", "traceback": "..."}`` (the
   traceback's last :data:`MAX_TRACEBACK` characters). It is written before step 3, so it is in
   the store before any peer can learn of the failure, let alone exit because of it.
3. **Abort.** A crash fails the job on every rank at once, as a fatal condition the engine finds
   itself does (Abort to the coordinator, Fatal to all): every pending and later collective of
   the others fails with ``PeerError("rank r crashed: Type: message ...")`` -- not with the
   goodbye that the atexit shutdown then sends, which reads "it called shutdown()".

:func:`ringflow.runner.launch.run_job` then reports, of the ranks that failed, the first in the
order it saw them exit whose status is not ``"peer"`` (a rank with no status -- killed by a
signal, failed before ``init()``, not a Python program -- counts as its own failure), with the
traceback from its status; the others are listed as having failed because of it. A rank that
crashed but did not exit (a non-daemon thread keeps it alive) is still named, from its status,
once the launcher has stopped it.

:func:`install` (called by ``init()``) sets a ``sys.excepthook`` that does this and then calls the
hook it replaced, which prints the traceback as before. A program that sets its own hook after
``init()`` replaces it; the atexit shutdown then finds the uncaught exception in
``sys.last_value`` and reports it there, later (after non-daemon threads were joined). A
``SystemExit`` (``sys.exit(3)``, the launcher's SIGTERM) is an exit, not a crash: no status.

A rank that ends without an uncaught exception (it caught the job's PeerError and called
``sys.exit(3)``, or its script ended) after its job failed because of another rank writes the
status ``"peer"`` with the job's error when it shuts ringflow down (``shutdown()`` or the atexit
shutdown), before the process ends. Without it such a rank counted as its own failure, and when
it exited before the launcher saw the killed rank go (they can be milliseconds apart), the
launcher named it instead of the rank that was killed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .errors import (
    AuthenticationError,
    PeerError,
    RingflowError,
    RingflowTimeoutError,
    ShutdownError,
)

__all__ = ["MAX_TRACEBACK", "STATUS_KEY", "Status", "caused_by_peer", "install", "read_status",
           "report"]

log = logging.getLogger(__name__)

#: The store key of rank ``r``'s status: ``STATUS_KEY.format(rank=r)``.
STATUS_KEY = "status/{rank}"
#: Characters of the traceback kept in a status (its end: the frames nearest the error).
MAX_TRACEBACK = 16 * 1024
#: How long writing the status may take: it runs while the process is going down.
_STORE_TIMEOUT_S = 5.0

_lock = threading.Lock()
_reported: BaseException | None = None
_previous_hook: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Status:
    """What a failed rank said about its failure (see the module doc)."""

    kind: str  # "crashed" or "peer"
    error: str  # "Type: message"
    traceback: str = ""

    @property
    def secondary(self) -> bool:
        """Whether the rank failed because another rank (or the job) had."""
        return self.kind == "peer"


def caused_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from or during) means another rank failed."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (PeerError, ShutdownError, RingflowTimeoutError)) and not (
                isinstance(current, AuthenticationError)):
            return True
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__)
    return False


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report(exc: BaseException, tb: TracebackType | None = None) -> None:
    """Record and announce that this rank is going down with ``exc`` (see the module doc). Once
    per job; a ``SystemExit`` is ignored. Never raises."""
    global _reported
    if isinstance(exc, SystemExit):
        return
    with _lock:
        if _reported is not None:
            return
        _reported = exc
    try:
        _report(exc, tb if tb is not None else exc.__traceback__)
    except Exception:  # the process is going down with the user's error; never hide it
        log.debug("ringflow: reporting the failure failed", exc_info=True)


def _report(exc: BaseException, tb: TracebackType | None) -> None:
    engine, info = _job()
    if info is None:
        return
    kind = "peer" if caused_by_peer(exc) else "crashed"
    error = describe(exc)
    if info.detector == "ringflow" and os.environ.get("RINGFLOW_RENDEZVOUS_ADDR"):
        text = "".join(traceback.format_exception(type(exc), exc, tb))[-MAX_TRACEBACK:]
        _write_status(info.rank, Status(kind, error, text))
    if kind == "crashed" and engine is not None and info.size > 1:
        engine.abort(PeerError(
            f"rank {info.rank} crashed: {error} (its traceback is in rank {info.rank}'s output)"
        ))


def _write_status(rank: int, status: Status) -> None:
    from .rendezvous import connect

    # A connection of its own: the job's client may be in use by another thread right now.
    with connect(timeout=_STORE_TIMEOUT_S) as store:
        store.set(STATUS_KEY.format(rank=rank), json.dumps(dataclasses.asdict(status)).encode())


def read_status(store: Any, rank: int) -> Status | None:
    """Rank ``rank``'s status in ``store``, or None if it wrote none (or an unreadable one)."""
    try:
        raw = store.get(STATUS_KEY.format(rank=rank), timeout=0)
        data = json.loads(raw)
        return Status(str(data["kind"]), str(data["error"]), str(data.get("traceback", "")))
    except (RingflowError, OSError, ValueError, KeyError, TypeError):
        return None


def _no_job() -> tuple[Any, Any]:
    return None, None


#: The running job as (engine, RankInfo), (None, None) without one: given by init().
_job: Callable[[], tuple[Any, Any]] = _no_job


def install(job: Callable[[], tuple[Any, Any]]) -> None:
    """Make an uncaught exception in the main thread call :func:`report` (``init()`` calls this
    with how to find the job's engine and RankInfo; a new job may report again)."""
    global _previous_hook, _reported, _job
    with _lock:
        _job = job
        _reported = None
        if sys.excepthook is not _excepthook:
            _previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def at_exit() -> None:
    """The atexit shutdown's part: report an uncaught exception the hook did not see."""
    exc = getattr(sys, "last_value", None)
    if exc is not None:
        report(exc, getattr(sys, "last_traceback", None))


def at_shutdown(fatal: BaseException | None) -> None:
    """The process's engine shuts down after its job failed with ``fatal`` (None: it did not):
    if another rank's failure caused it, say so, unless this rank reported already."""
    if fatal is not None and caused_by_peer(fatal):
        report(fatal)


def forget() -> None:
    """A forked child: nothing of the parent's job is its to report."""
    global _reported, _lock
    _lock = threading.Lock()
    _reported = ShutdownError("this process was forked from a rank; it is no rank itself")


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    report(exc, tb)
    (_previous_hook or sys.__excepthook__)(kind, exc, tb)
