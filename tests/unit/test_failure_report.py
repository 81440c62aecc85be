"""Which failure is the root cause (ringflow.runner.report.root_cause) and which exceptions mean
"another rank failed" (ringflow.failure.caused_by_peer)."""

from __future__ import annotations

import pytest

from ringflow.errors import (
    AuthenticationError,
    MismatchError,
    PeerError,
    RingflowTimeoutError,
    ShutdownError,
    StallError,
)
from ringflow.failure import Status, caused_by_peer
from ringflow.runner.report import JobResult, WorkerExit, root_cause

CRASHED = Status("crashed", "ValueError: bad",
                 "Traceback (most recent call last):\nValueError: bad\n")
PEER = Status("peer", "PeerError: rank 1 crashed: ValueError: bad", "...")


def exits(*ranks: int) -> list[WorkerExit]:
    return [WorkerExit(r, "localhost", 1) for r in ranks]


@pytest.mark.parametrize(("failed", "statuses", "first", "secondary"), [
    ([0, 2, 1], {0: PEER, 2: PEER, 1: CRASHED}, 1, (0, 2)),  # the crash exited last
    ([0, 1], {0: PEER}, 1, (0,)),  # no status: killed by a signal, not Python, before init
    ([0, 1], {}, 0, ()),  # nobody said anything: the order the launcher saw
    ([1, 0], {1: CRASHED, 0: CRASHED}, 1, ()),  # two crashes: the first seen
    ([0, 1], {0: PEER, 1: PEER}, 0, (1,)),  # the job's own error (a stall, a frozen rank)
])
def test_root_cause_is_the_first_failure_that_is_a_ranks_own(failed, statuses, first, secondary):
    got, also = root_cause(exits(*failed), [], statuses.get)
    assert got is not None and (got.rank, also) == (first, secondary)
    assert got.status == statuses.get(first)


def test_a_stopped_rank_that_crashed_beats_ranks_that_failed_because_of_it():
    stopped = [WorkerExit(2, "h", -15), WorkerExit(3, "h", -15)]
    got, also = root_cause(exits(0, 1), stopped, {0: PEER, 1: PEER, 3: CRASHED}.get)
    assert got is not None and (got.rank, got.returncode, also) == (3, -15, (0, 1))


def test_a_stopped_rank_that_said_nothing_beats_ranks_that_all_failed_because_of_another():
    # A frozen rank: the others fail naming it and exit; it is stopped and never wrote a status.
    stopped = [WorkerExit(1, "h", -9)]
    got, also = root_cause(exits(0, 2), stopped, {0: PEER, 2: PEER}.get)
    assert got is not None and (got.rank, got.returncode, also) == (1, -9, (0, 2))


@pytest.mark.parametrize(("remote", "text"), [
    # ssh's 255 once the launcher stopped its client says nothing of the rank: not the hint
    # to check ssh's configuration, but what a silent stopped rank means.
    (True, "ringflow-run: rank 1 on host h2 stopped responding: it did not exit when the job "
           "failed and left no status in the job's store; it froze, or host h2 became "
           "unreachable (ringflow-run stopped it)"),
    (False, "ringflow-run: rank 1 on host h2 stopped responding: it did not exit when the job "
            "failed and left no status in the job's store; it froze (ringflow-run stopped it)"),
])
def test_a_silent_stopped_rank_is_reported_as_frozen_or_unreachable(remote, text):
    stopped = [WorkerExit(1, "h2", 255, remote=remote)]
    got, also = root_cause(exits(0), stopped, {0: PEER}.get)
    assert got is not None and also == (0,)
    assert JobResult(255, (None, None), got, secondary=also).report().splitlines()[0] == text


def test_a_stopped_rank_that_crashed_says_so_whatever_its_exit_code():
    got, _ = root_cause(exits(0), [WorkerExit(1, "h2", 255, remote=True)],
                        {0: PEER, 1: CRASHED}.get)
    assert got is not None
    assert got.describe() == "rank 1 on host h2 failed, then did not exit; ringflow-run stopped it"


def test_no_failure_no_root_cause():
    assert root_cause([], exits(0), {0: CRASHED}.get) == (None, ())


def test_report_shows_the_traceback_from_the_status_and_who_failed_of_it():
    first = WorkerExit(1, "localhost", 1, ("stderr line",), status=CRASHED)
    text = JobResult(1, (None, first), first, secondary=(0, 2)).report()
    assert text.splitlines() == [
        "ringflow-run: rank 1 on host localhost exited with code 1",
        "ringflow-run: rank 1 raised ValueError: bad; its traceback:",
        "  Traceback (most recent call last):",
        "  ValueError: bad",
        "ringflow-run: ranks 0, 2 then failed because of it",
    ]


@pytest.mark.parametrize(("exc", "peer"), [
    (PeerError("lost rank 1"), True),
    (ShutdownError("rank 1 has shut down"), True),
    (RingflowTimeoutError("rank 1's part did not arrive"), True),
    (StallError("stall: ..."), True),
    (AuthenticationError("wrong secret"), False),
    (MismatchError("shapes differ"), False),
    (ValueError("a bug"), False),
    (KeyboardInterrupt(), False),
])
def test_caused_by_peer(exc, peer):
    assert caused_by_peer(exc) is peer


def test_caused_by_peer_follows_the_chain():
    try:
        try:
            raise PeerError("lost rank 3")
        except PeerError as inner:
            raise RuntimeError("training step failed") from inner
    except RuntimeError as outer:
        assert caused_by_peer(outer)
    try:
        try:
            raise ValueError("a bug")
        except ValueError:
            raise KeyError("while handling it") from None
    except KeyError as outer:
        assert not caused_by_peer(outer)
