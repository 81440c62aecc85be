"""ringflow.polling.polls: the pauses, the spin, the deadline, on a fake clock (no real sleeps),
and the error of a wait built on it (ringflow.devices.poll)."""

from __future__ import annotations

import itertools
import math

import pytest

from ringflow.devices import poll
from ringflow.errors import RingflowTimeoutError
from ringflow.polling import SLEEP_0, polls


class Clock:
    """A fake monotonic clock; sleep() and spin() advance it and log what they did."""

    def __init__(self, spin_s: float = 0.0) -> None:
        self.now = 100.0
        self.spin_s = spin_s
        self.log: list[tuple[str, float]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.log.append(("sleep", s))
        self.now += s

    def spin(self) -> None:
        self.log.append(("spin", self.spin_s))
        self.now += self.spin_s

    def pauses(self) -> list[tuple[str, float]]:
        return [(kind, round(s, 9)) for kind, s in self.log]


def run(clock: Clock, limit: int = 1000, **kwargs: object) -> list[float]:
    """Drive polls() with a poll that is never done; what it yielded (at most ``limit``)."""
    defaults: dict = {"clock": clock, "sleep": clock.sleep, "spin_with": clock.spin}
    return list(itertools.islice(polls(**(defaults | kwargs)), limit))  # type: ignore[arg-type]


def test_the_first_poll_is_at_once_even_with_no_time() -> None:
    clock = Clock()
    assert run(clock, timeout=0.0, pause=1e-3, cap=5e-3) == [100.0]
    assert clock.log == []


def test_pauses_double_up_to_the_cap() -> None:
    clock = Clock()
    run(clock, limit=7, timeout=math.inf, pause=1e-3, cap=5e-3)
    assert clock.pauses() == [("sleep", 1e-3), ("sleep", 2e-3), ("sleep", 4e-3),
                              ("sleep", 5e-3), ("sleep", 5e-3), ("sleep", 5e-3)]


def test_the_last_sleep_ends_at_the_deadline_and_one_poll_follows() -> None:
    clock = Clock()
    yielded = run(clock, timeout=0.01, pause=1e-3, cap=5e-3)
    # 1 + 2 + 4 ms, then 3 of the 8 ms: the deadline; a poll there, then the end.
    assert clock.pauses() == [("sleep", 1e-3), ("sleep", 2e-3), ("sleep", 4e-3), ("sleep", 3e-3)]
    assert len(yielded) == 5
    assert clock.now == pytest.approx(100.01)


def test_the_deadline_is_checked_after_each_poll() -> None:
    """A poll that itself outlasts the deadline ends the wait without another pause."""
    clock = Clock()
    seen = 0
    for _ in polls(1.0, 1e-3, 5e-3, clock=clock, sleep=clock.sleep):
        seen += 1
        clock.now += 2.0  # a slow poll (a connect that timed out)
    assert seen == 1 and clock.log == []


def test_never_ends_without_a_deadline() -> None:
    clock = Clock()
    assert len(run(clock, limit=500, timeout=math.inf, pause=1e-5, cap=5e-4)) == 500
    assert max(s for _, s in clock.log) == 5e-4


def test_spin_by_time_then_sleep() -> None:
    """devices.poll's schedule: spin for 50 us, then 20 us doubling to 0.5 ms."""
    clock = Clock(spin_s=2e-5)
    run(clock, limit=10, timeout=60.0, pause=2e-5, cap=5e-4, spin=5e-5)
    assert clock.pauses() == [("spin", 2e-5), ("spin", 2e-5), ("spin", 2e-5),  # 0, 20, 40 us
                              ("sleep", 2e-5), ("sleep", 4e-5), ("sleep", 8e-5),
                              ("sleep", 1.6e-4), ("sleep", 3.2e-4), ("sleep", 5e-4)]


def test_spin_by_count_then_sleep() -> None:
    """The mpi transport's schedule: 200 spins (here 3), then 10 us doubling to 0.1 ms."""
    clock = Clock(spin_s=0.0)
    run(clock, limit=9, timeout=60.0, pause=1e-5, cap=1e-4, spins=3)
    assert clock.pauses() == [("spin", 0.0)] * 3 + [
        ("sleep", 1e-5), ("sleep", 2e-5), ("sleep", 4e-5), ("sleep", 8e-5), ("sleep", 1e-4)]


def test_the_deadline_holds_while_spinning() -> None:
    clock = Clock(spin_s=1e-3)
    assert len(run(clock, timeout=2.5e-3, pause=1e-3, cap=1e-3, spin=1.0)) == 4  # 0, 1, 2, 3 ms


def test_yields_the_latest_clock_reading() -> None:
    clock = Clock()
    assert run(clock, limit=4, timeout=60.0, pause=1e-3, cap=5e-3) == pytest.approx(
        [100.0, 100.0, 100.001, 100.003])  # each the reading before the pause that preceded it


def test_sleep_0_is_a_sleep_of_zero() -> None:
    assert SLEEP_0.args == (0,)  # type: ignore[attr-defined]


def test_a_device_wait_done_at_once_polls_once() -> None:
    calls = []
    poll(lambda: calls.append(1) or True, 0.0, "an allreduce")
    assert calls == [1]


def test_a_device_wait_polls_until_done() -> None:
    answers = iter([False, False, False, True])
    poll(lambda: next(answers), 60.0, "an allreduce")
    assert next(answers, None) is None


def test_a_device_wait_past_its_deadline_raises_its_error() -> None:
    calls = []
    with pytest.raises(RingflowTimeoutError, match=r"an allreduce did not finish on the device "
                       r"within 0.0 s \(RINGFLOW_TIMEOUT_S sets the limit\)"):
        poll(lambda: calls.append(1) or False, 0.0, "an allreduce")
    assert calls == [1]  # the deadline had passed at the first check: no pause, no second poll
