"""The loopback transport as a ControlChannel: what the engine needs from a transport, on threads.

Each test drives :class:`~ringflow.transport.loopback.LoopbackTransport` directly (no engine): the
handlers record what they get and on which thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ringflow.errors import ConfigError, PeerError, ProtocolError, ShutdownError
from ringflow.transport.base import MAX_CTRL_BYTES, ControlChannel, Link, Transport
from ringflow.transport.loopback import LoopbackWorld

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """The two callbacks of set_ctrl_handler, recording (kind, src, value, thread name)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, int, Any, str]] = []

    def on_ctrl(self, src: int, payload: bytes) -> None:
        self._add("ctrl", src, payload)

    def on_failure(self, rank: int, error: BaseException) -> None:
        self._add("fail", rank, error)

    def _add(self, kind: str, src: int, value: Any) -> None:
        with self.cond:
            self.events.append((kind, src, value, threading.current_thread().name))
            self.cond.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[str, int, Any, str]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= count, timeout), self.events
            return list(self.events)


def channels(n: int, **kw: Any) -> tuple[LoopbackWorld, list, list[Recorder]]:
    world = LoopbackWorld(n, **kw)
    ts = [world.transport(r) for r in range(n)]
    recs = [Recorder() for _ in range(n)]
    return world, ts, recs


def close_all(ts: list) -> None:
    threads = [threading.Thread(target=t.close) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)


def test_a_loopback_transport_is_a_transport() -> None:
    t = LoopbackWorld(2).transport(0)
    assert isinstance(t, Transport)
    assert isinstance(t, Link) and isinstance(t, ControlChannel)


def test_early_messages_are_delivered_in_order_on_the_delivery_thread() -> None:
    _, ts, recs = channels(3)
    for i in range(5):
        ts[0].send_ctrl(b"a%d" % i, 2)
        ts[1].send_ctrl(b"b%d" % i, 2)
    ts[2].set_ctrl_handler(recs[2].on_ctrl, recs[2].on_failure)
    events = recs[2].wait_for(10)
    for src, prefix in ((0, b"a"), (1, b"b")):
        assert [e[2] for e in events if e[1] == src] == [prefix + b"%d" % i for i in range(5)]
    # Never the sender's thread (here the main thread): the engine's handlers take its lock.
    assert {e[3] for e in events} == {"ringflow-loopback-2-ctrl"}
    close_all(ts)


def test_messages_of_one_sender_keep_their_order_under_concurrent_senders() -> None:
    n, count = 4, 300
    _, ts, recs = channels(n)
    ts[0].set_ctrl_handler(recs[0].on_ctrl, recs[0].on_failure)

    def send(src: int) -> None:
        for i in range(count):
            ts[src].send_ctrl(f"{src}:{i}".encode(), 0)

    senders = [threading.Thread(target=send, args=(src,)) for src in range(1, n)]
    for th in senders:
        th.start()
    for th in senders:
        th.join(10)
    events = recs[0].wait_for((n - 1) * count)
    for src in range(1, n):
        assert [e[2] for e in events if e[1] == src] == [
            f"{src}:{i}".encode() for i in range(count)]
    close_all(ts)


def test_a_handler_may_send_from_the_delivery_thread() -> None:
    """Ping-pong through the handlers: a plan sent from inside the handler, as rank 0 does."""
    _, ts, _ = channels(2)
    done = threading.Event()
    got: list[int] = []

    def handler(rank: int):
        def on_ctrl(src: int, payload: bytes) -> None:
            value = int(payload)
            got.append(value)
            if value >= 20:
                done.set()
            else:
                ts[rank].send_ctrl(b"%d" % (value + 1), src)
        return on_ctrl

    for r in (0, 1):
        ts[r].set_ctrl_handler(handler(r), lambda rank, err: None)
    ts[0].send_ctrl(b"0", 1)
    assert done.wait(10)
    assert got == list(range(21))
    close_all(ts)


def test_goodbye_comes_after_the_last_message_and_is_a_shutdown_error() -> None:
    _, ts, recs = channels(3)
    for r in (0, 2):
        ts[r].set_ctrl_handler(recs[r].on_ctrl, recs[r].on_failure)
    ts[1].send_ctrl(b"last words", 0)
    ts[1].close(linger=0)
    events = recs[0].wait_for(2)
    assert [(e[0], e[1]) for e in events] == [("ctrl", 1), ("fail", 1)]
    error = events[1][2]
    assert isinstance(error, ShutdownError) and str(error) == "rank 1 has shut down"
    assert "rank 1 has shut down" in str(recs[2].wait_for(1)[0][2])
    with pytest.raises(ShutdownError, match="rank 1 has shut down"):
        ts[0].send_ctrl(b"anyone there?", 1)
    with pytest.raises(ShutdownError, match="rank 1 has shut down"):
        ts[0].check_peers([1])
    with pytest.raises(ShutdownError, match="rank 1 has shut down"):
        ts[0].check_peers()
    ts[0].check_peers([0, 2])  # a wait that does not involve rank 1 is not failed by it
    with pytest.raises(PeerError, match="closed"):
        ts[1].send_ctrl(b"after close", 0)
    close_all([ts[0], ts[2]])


def test_a_goodbye_before_the_handler_is_set_is_delivered_with_it() -> None:
    _, ts, recs = channels(2)
    ts[1].send_ctrl(b"hello", 0)
    ts[1].close(linger=0)
    ts[0].set_ctrl_handler(recs[0].on_ctrl, recs[0].on_failure)
    events = recs[0].wait_for(2)
    assert [(e[0], e[1]) for e in events] == [("ctrl", 1), ("fail", 1)]
    ts[0].close()


def test_close_lingers_for_the_peers_goodbyes_and_no_longer() -> None:
    _, ts, recs = channels(3)
    for r in range(3):
        ts[r].set_ctrl_handler(recs[r].on_ctrl, recs[r].on_failure)
    start = time.monotonic()
    ts[0].close(linger=0.3)  # nobody else closes: it waits the whole linger
    assert 0.25 < time.monotonic() - start < 5
    start = time.monotonic()
    close_all(ts[1:])  # each waits only for the other's goodbye (rank 0's came before)
    assert time.monotonic() - start < 1.5
    # The ranks that were not closing saw the goodbyes; failures after one's own close are not
    # reported (rank 0 saw none, rank 1 saw rank 0's only or rank 0's and rank 2's).
    assert [e[1] for e in recs[0].events] == []
    assert [e[1] for e in recs[1].events][:1] == [0]
    assert not [t for t in threading.enumerate() if t.name.startswith("ringflow-loopback")]


def test_abort_reaches_every_rank_as_a_failure_of_each_peer() -> None:
    n = 3
    world, ts, recs = channels(n)
    for r in range(n):
        ts[r].set_ctrl_handler(recs[r].on_ctrl, recs[r].on_failure)
    error = PeerError("the harness aborted the test")
    world.abort(error)
    for r in range(n):
        events = recs[r].wait_for(n - 1)
        assert sorted(e[1] for e in events) == [q for q in range(n) if q != r]
        assert all(e[0] == "fail" and e[2] is error for e in events)
    with pytest.raises(PeerError, match="aborted"):
        ts[0].send_ctrl(b"x", 1)
    with pytest.raises(PeerError, match="aborted"):
        ts[0].check_peers([1])
    start = time.monotonic()
    close_all(ts)  # every peer has failed: nothing to linger for
    assert time.monotonic() - start < 1.5


def test_bad_payloads_and_destinations_are_refused() -> None:
    _, ts, _ = channels(2)
    with pytest.raises(ProtocolError, match=r"1 to .* bytes, not 0"):
        ts[0].send_ctrl(b"", 1)
    with pytest.raises(ProtocolError, match=f"not {MAX_CTRL_BYTES + 1}"):
        ts[0].send_ctrl(bytes(MAX_CTRL_BYTES + 1), 1)
    with pytest.raises(ConfigError, match="rank 0 is not a peer of rank 0"):
        ts[0].send_ctrl(b"me", 0)
    with pytest.raises(ConfigError, match="destination rank 2 is outside"):
        ts[0].send_ctrl(b"x", 2)


def test_a_failing_handler_does_not_stop_later_deliveries() -> None:
    _, ts, recs = channels(2)

    def on_ctrl(src: int, payload: bytes) -> None:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        recs[0].on_ctrl(src, payload)

    ts[0].set_ctrl_handler(on_ctrl, recs[0].on_failure)
    ts[1].send_ctrl(b"boom", 0)
    ts[1].send_ctrl(b"after", 0)
    assert recs[0].wait_for(1)[0][2] == b"after"
    close_all(ts)


def test_control_messages_are_counted_per_pair() -> None:
    world, ts, recs = channels(3)
    ts[2].set_ctrl_handler(recs[2].on_ctrl, recs[2].on_failure)
    ts[0].send_ctrl(b"abc", 2)
    ts[0].send_ctrl(b"de", 2)
    ts[1].send_ctrl(b"f", 2)
    assert world.ctrl_sent[(0, 2)] == (2, 5) and world.ctrl_sent[(1, 2)] == (1, 1)
    assert world.sent[(0, 2)] == (0, 0)  # data counts are apart
    world.reset_counts()
    assert world.ctrl_sent[(0, 2)] == (0, 0)
    close_all(ts)
