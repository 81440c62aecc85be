"""The coordinator's stream across handovers, at the thread tier (ringflow.testing.run_engines).

Plans and handovers of successive coordinators reach a rank over different connections, so one
coordinator's last plan and the next one's handover can arrive in either order; so can a
rank's goodbye and the handover. These tests hold back what one rank sends another (its
messages and its goodbye) to force the order that a loaded host gives now and then (seen once
in 8 runs of a 3-rank script that ends with ``barrier()``), and check that every rank still
takes everything in as it was issued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ringflow.errors import ShutdownError
from ringflow.messages import Handover, Plan, decode
from ringflow.testing import run_engines
from ringflow.transport import loopback

pytestmark = pytest.mark.timeout(120)

DEADLINE = 30.0


class Hold:
    """Once armed, what rank ``src`` sends rank ``dst`` (messages and its goodbye) is held back:
    until a message of type ``release_on`` from a third rank reaches ``dst`` (which gets that
    message first), or for good with None (as if ``dst`` left before reading it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, src: int, dst: int,
                 release_on: type | None) -> None:
        self.src, self.dst, self.release_on = src, dst, release_on
        self.armed = threading.Event()
        self.released = threading.Event()
        self.held: list[tuple[int, Any]] = []
        self.world: loopback.LoopbackWorld | None = None
        init, put = loopback.LoopbackWorld.__init__, loopback._Mailbox.put
        hold = self

        def world_init(world: loopback.LoopbackWorld, *args: Any, **kwargs: Any) -> None:
            init(world, *args, **kwargs)
            hold.world = world

        def mailbox_put(box: loopback._Mailbox, src: int, item: Any) -> None:
            world = hold.world
            if (world is None or box is not world._mail[hold.dst] or not hold.armed.is_set()
                    or hold.released.is_set()):
                put(box, src, item)
            elif src == hold.src:
                hold.held.append((src, item))
            elif (hold.release_on is not None and isinstance(item, bytes)
                  and isinstance(decode(item), hold.release_on)):
                put(box, src, item)
                hold.released.set()
                for s, i in hold.held:
                    put(box, s, i)
            else:
                put(box, src, item)

        monkeypatch.setattr(loopback.LoopbackWorld, "__init__", world_init)
        monkeypatch.setattr(loopback._Mailbox, "put", mailbox_put)


def wait_for(what: str, ready: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE / 2
    while not ready():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def tri(n: int) -> float:
    return n * (n + 1) / 2


@pytest.mark.parametrize("n", [3, 4])
def test_a_handover_that_overtakes_the_last_plan_waits_for_it(
        monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    # Every rank ends with barrier() and shuts down. Rank 0 plans the barrier, hands over to
    # rank 1 and leaves; rank 1 takes over, sees the ranks between it and the last one leave,
    # and hands over to the last one. That rank gets the handover before rank 0's plan of the
    # barrier: it used to take over with the barrier still pending and fail it ("rank 0 left
    # the job ... before submitting 'barrier.noname.0'") although every rank had submitted it.
    last = n - 1
    hold = Hold(monkeypatch, 0, last, release_on=Handover)
    rank_1_coordinates = threading.Event()

    def body(r, rf):
        got = rf.allreduce(np.full(3, r + 1.0), name="warm", op=rf.Sum)
        assert np.array_equal(got, np.full(3, tri(n))), got
        if r == last:
            hold.armed.set()
        rf.barrier()
        if r == 1:  # leaves once it coordinates and knows the ranks before the last one left
            wait_for("rank 1 took over", lambda: rf.engine.coordinator is not None)
            rank_1_coordinates.set()
            wait_for("the middle ranks left", lambda: set(range(2, last))
                     <= set(rf.engine.coordinator.gone))
        elif 1 < r < last:
            wait_for("rank 1 took over", rank_1_coordinates.is_set)
        return r

    assert run_engines(n, body, deadline=DEADLINE) == list(range(n))
    assert hold.released.is_set() and hold.held, "the interleaving was not forced"


def test_a_plan_of_the_next_coordinator_waits_for_the_last_plan_of_the_previous_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 plans an allreduce of the set {1} and leaves; rank 1 takes over and plans another.
    # Rank 2 gets rank 1's plan first. Every rank gives cache bits to names in plan order, so
    # that a bit means the same name everywhere (it does for names of sets a rank is not in);
    # taken in out of order, rank 2 gave the two names each other's bits.
    hold = Hold(monkeypatch, 0, 2, release_on=Plan)
    first_planned = threading.Event()

    def body(r, rf):
        pair = rf.add_process_set([1, 2])
        solo = rf.add_process_set([1])
        if r > 0:
            got = rf.allreduce(np.full(2, r + 1.0), name="p", op=rf.Sum, process_set=pair)
            assert np.array_equal(got, [5.0, 5.0]), got
        if r == 2:
            hold.armed.set()
        rf.barrier()
        if r == 0:
            wait_for("rank 0 planned rank 1's first allreduce", first_planned.is_set)
            return []
        if r == 1:
            for name in ("s0", "s1"):
                got = rf.allreduce(np.full(2, 7.0), name=name, op=rf.Sum, process_set=solo)
                assert np.array_equal(got, [7.0, 7.0]), got
                first_planned.set()
                wait_for("rank 1 took over", lambda: rf.engine.coordinator is not None)
        got = rf.allreduce(np.full(2, r + 1.0), name="p", op=rf.Sum, process_set=pair)
        assert np.array_equal(got, [5.0, 5.0]), got
        return [name for _, name in rf.engine.cache.key_of]

    results = run_engines(3, body, deadline=DEADLINE)
    assert results[1] == results[2] == ["p", "s0", "s1"], results
    assert hold.released.is_set() and hold.held, "the interleaving was not forced"


def test_the_successor_knows_who_left_before_it_took_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 2 leaves; rank 1 reads its goodbye, rank 0 leaves before reading it. Rank 1, taking
    # over, used to know only what rank 0's handover said, and an allreduce of the set {1, 2}
    # waited for rank 2 for good; it fails at once, naming rank 2, as rank 0 would have.
    hold = Hold(monkeypatch, 2, 0, release_on=None)
    rank_2_left = threading.Event()

    def body(r, rf):
        got = rf.allreduce(np.full(3, r + 1.0), name="warm", op=rf.Sum)
        assert np.array_equal(got, np.full(3, tri(3))), got
        pair = rf.add_process_set([1, 2])
        rf.barrier()
        if r == 0:
            hold.armed.set()
            wait_for("rank 1 heard rank 2 leave", rank_2_left.is_set)
            return ""
        if r == 2:
            wait_for("rank 0 holds back what rank 2 sends it", hold.armed.is_set)
            return ""
        wait_for("rank 2's goodbye reached rank 1", lambda: 2 in rf.engine.seat.departed)
        rank_2_left.set()
        wait_for("rank 1 took over", lambda: rf.engine.coordinator is not None)
        with pytest.raises(ShutdownError) as info:
            rf.allreduce(np.ones(2), name="after", op=rf.Sum, process_set=pair)
        return str(info.value)

    results = run_engines(3, body, deadline=DEADLINE)
    assert "rank 2 left the job (it called shutdown()) before submitting 'after'" in results[1]
