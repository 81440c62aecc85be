"""The verdict on a failed job: who decides, and how every rank comes to report one text.

Every fatal condition (a peer that died or went silent for ``timeout_s``, a stall past its
limit, a deadlock, an internal error) is seen first on some thread and noted here
(:meth:`Verdicts.note`, the first one wins); the engine thread then acts on it, outside the
control lock (:meth:`Verdicts.fail_job`). A reader or heartbeat thread that sees a peer fail
also aborts this rank's data plane at once, since the engine thread may be blocked in a ring or
a shared-memory barrier that only that ends.

One text on every rank: the coordinator broadcasts its error (``Fatal``); another rank reports
its own to the coordinator (``Abort``) and waits up to a second for the verdict it then
broadcasts. When the coordinator itself died or froze no verdict can come, and every survivor
uses the coordinator's failure, whose text is the same wherever it is found (DESIGN section 8).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from .. import errors
from ..errors import RingflowError, ShutdownError
from ..messages import Abort, Fatal
from .common import Wake

if TYPE_CHECKING:
    from . import Engine

__all__ = ["Verdicts"]

log = logging.getLogger(__package__)


class Verdicts:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        #: the job's fatal error as this rank knows it (written by the engine thread only)
        self.fatal: BaseException | None = None
        self.failure: tuple[BaseException, bool] | None = None  # to act on: (error, report)
        # Written by reader and heartbeat threads: the job's error as the coordinator announced
        # it, and how each peer failed (dead, or silent past timeout_s).
        self.verdict: BaseException | None = None
        self.peer_errors: dict[int, BaseException] = {}

    # seen on reader and heartbeat threads ------------------------------------------------------
    def on_message(self, src: int, msg: Abort | Fatal) -> None:
        e = self.e
        error = msg.exception()
        if isinstance(msg, Fatal):
            self.verdict = error
        if isinstance(msg, Fatal) or e.seat.coordinator is not None:
            # The job has failed: end this rank's data-plane wait now (the engine thread may
            # be blocked in one), then let the engine thread act on it.
            e.transport.abort(error)
        e._inbox.put((Wake.MESSAGE, src, msg))

    def on_peer_failure(self, peer: int, error: BaseException) -> None:
        e = self.e
        e.p2p.peer_failed(peer, error)
        if isinstance(error, ShutdownError):
            e._liveness.forget(peer)  # it said goodbye: not a frozen peer after timeout_s
        else:
            self.peer_errors.setdefault(peer, error)
            if not e._closed:
                e.transport.abort(error)  # a fatal condition: end the data plane's waits
        e._inbox.put((Wake.PEER, peer, error))

    def check_silent(self) -> None:
        """The heartbeat thread's verdict on a silent peer."""
        silent = self.e._liveness.silent()
        if silent is not None and silent[0] not in self.peer_errors and not self.e._closed:
            self.on_peer_failure(*silent)

    # the engine thread, under the lock ---------------------------------------------------------
    def on_verdict(self, msg: Abort | Fatal) -> None:
        if isinstance(msg, Fatal):
            self.note(msg.exception(), report=False)
        elif self.e.seat.coordinator is not None:
            self.note(msg.exception())

    def on_peer(self, peer: int, error: BaseException) -> None:
        if not isinstance(error, ShutdownError):
            self.note(error)
        elif not self.e._closed:
            # Closed, the job has failed (or this rank shut down): a goodbye now is that
            # failure's echo -- a rank that crashed says goodbye after its Abort -- and a plan
            # made of it ("left the job (it called shutdown())") would reach the others on
            # their reader threads, ahead of the Fatal their engine threads act on.
            self.e.seat.on_goodbye(peer)

    def check_liveness(self) -> None:
        e = self.e
        silent = e._liveness.silent()
        if silent is not None:
            self.note(self.peer_errors.setdefault(*silent))
            return
        c = e.seat.coordinator
        if c is not None:
            warnings, fatal = c.stalled(e.config.stall_warning_s, e.config.stall_shutdown_s,
                                        e.config.deadlock_shutdown_s)
            for text in warnings:
                log.warning("ringflow stall: %s", text)
            if fatal:
                self.note(errors.StallError(fatal))

    def note(self, error: BaseException, report: bool = True) -> None:
        """Remember the first fatal error; the engine thread acts on it outside the lock."""
        if self.failure is None:
            self.failure = (error, report)

    # the engine thread, outside the lock -------------------------------------------------------
    def act(self) -> None:
        """Fail the job with the noted error, if there is one and the job has not failed."""
        if self.failure is not None and self.fatal is None:
            self.fail_job(*self.failure)

    def fail_job(self, error: BaseException, report: bool = True) -> None:
        """Make ``error`` the job's fatal error on this rank (the coordinator: on every rank)."""
        e = self.e
        if report and e.size > 1:
            if e.seat.coordinator is not None:
                e.seat.broadcast(Fatal.of(error))
            elif self.verdict is not None:
                error = self.verdict  # announced already
            elif self.coordinator_failure() is not None:
                # No verdict can come: every survivor names the coordinator alike.
                error = self.coordinator_failure()
            else:
                e._send(e.seat.coord, Abort.of(error))
                error = self._await_verdict(error)
        e.transport.abort(error)
        self.fatal = error
        log.error("ringflow: %s", error)
        e._close(error)
        e.p2p.close(error)  # ... or the job, not when rank 0 leaves: it takes no part in it

    def internal(self, exc: BaseException) -> None:
        """A bug must not leave handles hanging: the job fails with it."""
        log.exception("ringflow engine failed", exc_info=exc)
        if self.fatal is None:
            self.fail_job(ShutdownError(f"internal error in the engine: {exc!r}"))

    def coordinator_failure(self) -> BaseException | None:
        """How the coordinator failed (it died, or froze past ``timeout_s``), if it did."""
        return self.peer_errors.get(self.e.seat.coord)

    def _await_verdict(self, error: BaseException) -> BaseException:
        """Give the coordinator a moment to announce the job's error, so every rank reports one
        text; if it is found dead or frozen meanwhile, its failure is the text."""
        inbox = self.e._inbox
        deadline = time.monotonic() + 1.0
        verdict = error
        keep = []  # entries and a stop: _close() fails the entries and keeps the stop
        while (left := deadline - time.monotonic()) > 0:
            if self.verdict is not None or self.coordinator_failure() is not None:
                verdict = self.verdict or self.coordinator_failure() or error
                break
            try:
                item = inbox.get(timeout=min(left, 0.01))
            except queue.Empty:
                continue
            if item[0] is Wake.MESSAGE and isinstance(item[2], Fatal):
                verdict = item[2].exception()
                break
            if item[0] in (Wake.ENQUEUE, Wake.STOP):
                keep.append(item)
                if item[0] is Wake.STOP:
                    break
        for item in keep:
            inbox.put(item)
        return verdict


def as_failure(exc: BaseException) -> RingflowError:
    """What another thread's exception means for the job."""
    if isinstance(exc, RingflowError):
        return exc
    return ShutdownError(f"internal error in the engine: {exc!r}")
