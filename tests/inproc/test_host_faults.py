"""Peers on other hosts that fail (issue 32: faults between hosts): errors name the peer's host,
closing is bounded however many peers stopped reading, and a coordinator that was only out of
reach learns why its workers gave up on it.

Ranks are threads over real TCP on 127.0.0.1, or engines over loopback
(:func:`ringflow.testing.run_engines`); a peer that "vanished" (its host lost power or its link,
so it neither reads nor closes) is played by the test over a raw authenticated socket that it
never reads from. The same faults between namespace hosts: tests/multihost/test_link_faults.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from ringflow import wire
from ringflow.config import Config
from ringflow.engine import Engine
from ringflow.errors import PeerError, RingflowError
from ringflow.liveness import Liveness
from ringflow.messages import Heartbeat
from ringflow.rendezvous import MemoryStore
from ringflow.testing import run_engines
from ringflow.transport import tcp

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
CONFIG = Config(timeout_s=5.0)


def _connect(hosts: list[str]) -> list[tcp.TcpTransport]:
    """One transport per rank, rank ``r`` on the host named ``hosts[r]``."""
    store = MemoryStore(10.0)
    out: dict[int, tcp.TcpTransport] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            out[r] = tcp.create(r, len(hosts), store, CONFIG, secret=SECRET, hostname=hosts[r])
        except BaseException as exc:  # re-raised below, with the others stopped
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors or len(out) != len(hosts):
        for t in out.values():
            t.close(linger=0)
        raise AssertionError(f"the ranks did not connect: {errors}")
    return [out[r] for r in range(len(hosts))]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_rank_knows_every_peers_host(size):
    hosts = [f"host-{r % 2}" for r in range(size)]
    ts = _connect(hosts)
    try:
        for t in ts:
            assert [t.peer_host(r) for r in range(size) if r != t.rank] == [
                hosts[r] for r in range(size) if r != t.rank]
            assert t.peer_host(t.rank) == ""
    finally:
        for t in ts:
            t.close(linger=0)


def test_tcp_retransmits_at_least_every_second_and_gives_up_only_after_15_minutes():
    """Where the kernel takes TCP_RTO_MAX_MS (Linux 6.15+): a link back after an outage is
    noticed within a second, and the kernel's give-up budget, which it computes with that
    ceiling (15 retransmissions: 15 s), is set back to the default's 15 minutes: ringflow's
    heartbeats decide, at RINGFLOW_TIMEOUT_S (test_link_faults.py rides through 20 s down)."""
    ts = _connect(["h1", "h2"])
    try:
        sock = ts[0]._peers[1].sock
        try:
            rto_max = sock.getsockopt(socket.IPPROTO_TCP, tcp._TCP_RTO_MAX_MS)
        except OSError:
            pytest.skip("the kernel lacks TCP_RTO_MAX_MS")
        assert rto_max == 1000
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) >= 924_000
    finally:
        for t in ts:
            t.close(linger=0)


def test_a_lost_peer_is_named_with_its_host_on_every_rank():
    ts = _connect(["h1", "h1", "h2"])
    failures: dict[int, list[BaseException]] = {0: [], 1: []}
    for r in (0, 1):
        ts[r].set_ctrl_handler(lambda src, payload: None,
                               lambda peer, err, r=r: failures[r].append(err))
    try:
        for peer in ts[2]._peers.values():  # the process ends without a goodbye
            peer.sock.shutdown(socket.SHUT_RDWR)
        end = time.monotonic() + 10
        while not all(failures.values()) and time.monotonic() < end:
            time.sleep(0.01)
        for r in (0, 1):
            assert [str(e) for e in failures[r]] == [
                "lost rank 2 on host h2: the connection was closed (the process exited or was "
                "killed)"], r
    finally:
        for t in ts:
            t.close(linger=0)


def test_a_silent_peer_is_named_with_its_host():
    live = Liveness(0, 3, 0.2, host={1: "h1", 2: "h2"}.get)
    live.follow(0)
    time.sleep(0.5)
    live.heard(1)
    peer, error = live.silent()
    assert peer == 2
    assert str(error) == ("rank 2 has not responded for more than 0.2 s: it is frozen or "
                          "overloaded, or host h2 cannot be reached (RINGFLOW_TIMEOUT_S sets "
                          "this limit)")
    nameless = Liveness(0, 2, 0.2)
    time.sleep(0.5)
    assert "cannot be reached" not in str(nameless.silent()[1])


def _with_deaf_peers(k: int) -> tuple[tcp.TcpTransport, list[socket.socket]]:
    """Rank 0 for real; ranks 1..k played over raw sockets that are never read from."""
    store = MemoryStore(10.0)
    out: list[tcp.TcpTransport] = []
    thread = threading.Thread(
        target=lambda: out.append(tcp.create(0, k + 1, store, CONFIG, secret=SECRET)),
        daemon=True)
    thread.start()
    host, port = store.get("tcp/0", 5.0).decode().split()[0].rsplit(":", 1)
    socks = []
    for r in range(1, k + 1):
        sock = socket.create_connection((host, int(port)), timeout=5.0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        wire.client_handshake(sock, SECRET, 5.0)
        sock.sendall(struct.pack("!Q", r) + b"\x04deaf")
        socks.append(sock)
    thread.join(10)
    return out[0], socks


def test_close_is_bounded_however_many_peers_stopped_reading():
    """Goodbyes to peers that stopped reading, each behind a write that can never end: close()
    took 2.5 s per such peer (one after the other) before; now 2.5 s plus the linger for all."""
    k = 4
    t, socks = _with_deaf_peers(k)
    try:
        big = memoryview(bytearray(32 << 20))
        for r in range(1, k + 1):
            t.isend(big, r)  # fills the socket's buffers, then blocks its sender thread
        time.sleep(0.5)
        start = time.monotonic()
        t.close(linger=0.5)
        took = time.monotonic() - start
        assert took < tcp._GOODBYE_WRITE_S + 0.5 + 1.5, took  # 10 s + before, for k = 4
        with pytest.raises(PeerError):
            t.isend(memoryview(b"x"), 1)
    finally:
        for sock in socks:
            sock.close()


def test_a_coordinator_out_of_reach_fails_with_its_workers_reason(monkeypatch):
    """Rank 1 stops hearing rank 0 (its heartbeats are lost: a one-way partition, or a link
    that comes back just after the timeout) while rank 0 still hears rank 1. Rank 1 gives up on
    rank 0; rank 0 must fail with rank 1's reason, not with "rank 1 has shut down" (its
    goodbye) or a stall: rank 1 tells it (Abort) before it leaves."""
    beat = Engine._beat

    def deaf_coordinator(self: Engine) -> None:
        if self.rank != 0:
            return beat(self)
        seat = self.seat  # the coordinator's heartbeats go out through its seat's broadcast
        send = seat.broadcast
        seat.broadcast = lambda msg: None if isinstance(msg, Heartbeat) else send(msg)
        try:
            return beat(self)
        finally:
            del seat.broadcast

    monkeypatch.setattr(Engine, "_beat", deaf_coordinator)

    def body(r, rf):
        if r == 0:
            time.sleep(3.0)  # rank 1 gives up on rank 0 meanwhile (1 s + 2 heartbeats)
        try:
            rf.allreduce(np.ones(3), name="x", op=rf.Sum)
        except RingflowError as exc:
            return type(exc).__name__, str(exc)
        return None

    results = run_engines(2, body, Config(timeout_s=1.0), deadline=20.0)
    assert results[0] == results[1], results
    kind, text = results[0]
    assert kind == "PeerError" and text.startswith("rank 0 has not responded for more than 1 s")
