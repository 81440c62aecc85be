"""How a job ended, and which rank's failure to report: :class:`WorkerExit`, :class:`JobResult`.

The *first failure* of a job is its root cause, not the first process to exit. When one rank
raises, the others fail because of it (PeerError, ShutdownError), and one of them may well exit
first: the rank that raised is still printing its traceback or saying goodbye. Each rank that
fails after ``init()`` records a :class:`~ringflow.failure.Status` in the job's store saying
whether the failure was its own (``"crashed"``) or caused by another rank (``"peer"``), before
any peer can learn of it (:mod:`ringflow.failure`). :func:`root_cause` picks, in the order the
launcher saw them fail:

1. the first rank whose failure is its own: a status ``"crashed"``, or no status at all (killed by
   a signal, failed before ``init()``, not a Python program, did not start);
2. else a rank that the launcher had to stop whose status does not say ``"peer"``: one that
   crashed, then hung on its way out (a non-daemon thread); else one that said nothing because
   it could not (it froze, and the others failed because it stopped responding);
3. else the first rank that failed (every failure says "because of another rank": the job's own
   error, such as a stall).

The report shows that rank's own traceback (from its status, else the tail of its stderr) and
lists the ranks that failed because of it.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Sequence

from ..failure import Status

__all__ = ["JobResult", "WorkerExit", "root_cause"]

_SSH_FAILED = 255


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one worker ended. ``returncode`` is Popen's: negative for a signal."""

    rank: int
    host: str
    returncode: int
    stderr_tail: tuple[str, ...] = ()
    #: Whether the worker ran on another host, through ssh.
    remote: bool = False
    #: What the rank said about its failure, if it said anything (:mod:`ringflow.failure`).
    status: Status | None = None
    #: Why the launcher gave up on the worker, when it did not end on its own (it did not start).
    reason: str = ""

    @property
    def exit_status(self) -> int:
        """The shell's view: the exit code, or ``128 + signal``."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        where = f"rank {self.rank} on host {self.host}"
        if self.reason:
            return f"{where} {self.reason}"
        if self.returncode < 0:
            return f"{where} was killed by signal {_signame(-self.returncode)}"
        text = f"{where} exited with code {self.returncode}"
        if self.remote and self.returncode == _SSH_FAILED:
            text += (
                f" (ssh's own failure code: check that `ssh -o BatchMode=yes {self.host} true` "
                "works without a prompt and that the host key is known)"
            )
        return text


@dataclasses.dataclass(frozen=True)
class JobResult:
    """The outcome of :func:`~ringflow.runner.launch.run_job`."""

    returncode: int
    exits: tuple[WorkerExit | None, ...]
    first_failure: WorkerExit | None = None
    #: The signal that stopped the launcher (SIGINT / SIGTERM), if one did.
    stopped_by: int | None = None
    #: Whether the deadline passed before every worker had exited.
    timed_out: bool = False
    #: Ranks that failed because of the first failure (their status said "peer").
    secondary: tuple[int, ...] = ()

    @property
    def unfinished(self) -> list[int]:
        """Ranks that had not exited on their own when the job was stopped."""
        return [r for r, e in enumerate(self.exits) if e is None]

    def report(self, prog: str = "ringflow-run") -> str:
        """The failure report for stderr; empty when the job succeeded."""
        lines: list[str] = []
        if self.first_failure is not None:
            fail = self.first_failure
            lines.append(f"{prog}: {fail.describe()}")
            status = fail.status
            if status is not None and status.traceback:
                lines.append(f"{prog}: rank {fail.rank} raised {status.error}; its traceback:")
                lines += [f"  {line}" for line in status.traceback.rstrip("\n").splitlines()]
            elif fail.stderr_tail:
                count = len(fail.stderr_tail)
                noun = "line" if count == 1 else f"{count} lines"
                lines.append(f"{prog}: last {noun} of rank {fail.rank}'s stderr:")
                lines += [f"  {line}" for line in fail.stderr_tail]
            if self.secondary:
                ranks = ", ".join(map(str, self.secondary))
                noun = "rank" if len(self.secondary) == 1 else "ranks"
                lines.append(f"{prog}: {noun} {ranks} then failed because of it")
        if self.stopped_by is not None:
            lines.append(
                f"{prog}: received {_signame(self.stopped_by)}; stopped ranks {self.unfinished}"
            )
        if self.timed_out:
            lines.append(f"{prog}: the deadline passed; stopped ranks {self.unfinished}")
        return "\n".join(lines)


def root_cause(
    failed: Sequence[WorkerExit], stopped: Sequence[WorkerExit],
    status: Callable[[int], Status | None] | None,
) -> tuple[WorkerExit | None, tuple[int, ...]]:
    """The first failure of a job (see the module doc) and the ranks that failed because of it.

    ``failed``: the workers that ended with a failure on their own, in the order the launcher saw
    them; ``stopped``: those it stopped afterwards; ``status`` reads a rank's status.
    """
    if not failed:
        return None, ()
    read = status if status is not None else (lambda _rank: None)
    failed = [dataclasses.replace(e, status=e.status or read(e.rank)) for e in failed]
    own = [e for e in failed if e.status is None or not e.status.secondary]
    first = own[0] if own else None
    if first is None:
        hung = [dataclasses.replace(e, status=s, reason=_hung(e, s)) for e in stopped
                if (s := read(e.rank)) is None or not s.secondary]
        hung.sort(key=lambda e: e.status is None)  # one that says it crashed, before a silent one
        first = hung[0] if hung else failed[0]
    secondary = tuple(sorted(e.rank for e in failed
                             if e.rank != first.rank and e.status is not None
                             and e.status.secondary))
    return first, secondary


def _hung(worker: WorkerExit, status: Status | None) -> str:
    """Why a rank the launcher had to stop is the root cause (its exit code is the stop's: a
    signal, or ssh's 255 once its client is stopped, which says nothing about the rank)."""
    if status is not None:
        return "failed, then did not exit; ringflow-run stopped it"
    unreachable = f", or host {worker.host} became unreachable" if worker.remote else ""
    return ("stopped responding: it did not exit when the job failed and left no status in the "
            f"job's store; it froze{unreachable} (ringflow-run stopped it)")


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
