"""ringflow.testing.run_ranks: results in rank order, the first failure named, deadlines kept."""

from __future__ import annotations

import threading
import time

import pytest

from ringflow.errors import ConfigError, PeerError, RankFailure, RingflowError
from ringflow.testing import run_ranks
from ringflow.transport import recv, send

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["loopback", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_returns_results_in_rank_order(transport: str, n: int) -> None:
    def body(t, base):
        assert t.size == n
        return base + t.rank

    results = run_ranks(n, body, args=(100,), deadline=20, transport=transport)
    assert results == [100 + r for r in range(n)]


def test_ranks_can_talk(transport: str) -> None:
    def body(t):
        if t.rank == 0:
            send(t, memoryview(b"hello"), 1)
            return None
        buf = bytearray(5)
        recv(t, memoryview(buf), 0)
        return bytes(buf)

    assert run_ranks(2, body, deadline=20, transport=transport) == [None, b"hello"]


def test_failing_rank_is_named_and_blocked_ranks_are_released(transport: str) -> None:
    released: dict[int, BaseException] = {}

    def body(t):
        if t.rank == 1:
            time.sleep(0.05)  # let the others block in recv first
            raise ValueError("rank one is broken")
        try:
            recv(t, memoryview(bytearray(4)), 1)  # never sent: only the abort ends this
        except BaseException as exc:
            released[t.rank] = exc
            raise

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1: ValueError: rank one is broken") as info:
        run_ranks(3, body, deadline=30, transport=transport)
    assert time.monotonic() - start < 10  # released by the abort, not by a timeout
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "Traceback" in str(info.value) and "raise ValueError" in str(info.value)
    assert sorted(released) == [0, 2]
    assert all(isinstance(e, (PeerError, RingflowError)) for e in released.values()), released


def test_deadline_overrun_raises_for_the_lowest_unfinished_rank() -> None:
    stop = threading.Event()

    def body(t):
        if t.rank in (1, 2):
            stop.wait(20)  # stuck outside ringflow: nothing but the deadline notices
        return t.rank

    start = time.monotonic()
    try:
        with pytest.raises(RankFailure, match=r"rank 1: did not finish within 0.3s") as info:
            run_ranks(3, body, deadline=0.3)
    finally:
        stop.set()
    assert info.value.rank == 1
    assert "stop.wait" in str(info.value)  # the stack it was stuck in
    assert time.monotonic() - start < 15


def test_deadline_releases_ranks_blocked_in_a_receive() -> None:
    def body(t):
        recv(t, memoryview(bytearray(1)), 1 - t.rank)  # both wait, neither sends: a deadlock

    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0: did not finish within 0.2s"):
        run_ranks(2, body, deadline=0.2)
    assert time.monotonic() - start < 5


def test_receive_from_a_rank_that_finished_fails_at_once() -> None:
    def body(t):
        if t.rank == 0:
            recv(t, memoryview(bytearray(1)), 1)  # rank 1 returns (and closes) without sending

    with pytest.raises(RankFailure, match=r"rank 0: PeerError: .* rank 1 closed its transport"):
        run_ranks(2, body, deadline=30)


def test_unknown_transport_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'loopback' or 'tcp'"):
        run_ranks(2, lambda t: None, transport="carrier-pigeon")
