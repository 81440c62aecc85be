"""TCP transport behaviour that the collective suite does not pin down on its own."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ringflow import testing
from ringflow.transport import tcp

pytestmark = pytest.mark.timeout(60)


def test_a_send_written_in_full_survives_the_peers_goodbye(monkeypatch):
    """The sender thread has written every byte but not yet marked the send done; the peer, having
    received everything, says goodbye and closes. The send must still succeed."""
    push = tcp._Peer._push

    def slow_push(self, bufs, flags):
        left = push(self, bufs, flags)
        if flags == 0:  # the sender thread: written, not yet marked done; widen that window
            time.sleep(0.5)
        return left

    monkeypatch.setattr(tcp._Peer, "_push", slow_push)

    def body(t):
        buf = np.zeros(16 << 20, np.uint8)  # larger than a socket buffer: the sender thread sends
        if t.rank == 0:
            t.isend(memoryview(buf), 1).wait()
        else:
            t.irecv(memoryview(buf), 0).wait()
        return "ok"

    assert testing.run_ranks(2, body, transport="tcp", deadline=20) == ["ok", "ok"]


def test_a_write_after_an_unread_goodbye_is_a_departure_not_a_loss(monkeypatch):
    """Rank 1 says goodbye and closes while rank 0's reader has not yet read the goodbye (a
    reader thread starved of CPU, as on a loaded host). A write of rank 0 to it then fails: that
    is rank 1's departure (ShutdownError), not a lost peer (PeerError, which ends the job)."""
    recv_exact = tcp.wire.recv_exact
    starved = threading.Event()

    def slow_reader(sock, n):
        data = recv_exact(sock, n)
        if starved.is_set() and threading.current_thread().name == "ringflow-tcp-0<->1-r":
            time.sleep(1.5)  # the goodbye has arrived; the reader runs late
        return data

    monkeypatch.setattr(tcp.wire, "recv_exact", slow_reader)
    failures: list[BaseException] = []
    left = threading.Event()

    def body(t):
        if t.rank == 0:
            t.set_ctrl_handler(lambda src, payload: None, lambda r, e: failures.append(e))
            starved.set()
            left.wait(10)
            errors = []
            for _ in range(3):  # the first write may still be taken by the kernel
                try:
                    t.send_ctrl(b"plan", 1)
                except Exception as exc:
                    errors.append(exc)
                time.sleep(0.05)
            return [type(e).__name__ for e in errors[:1]]
        t.close(linger=0.1)
        left.set()
        return []

    results = testing.run_ranks(2, body, transport="tcp", deadline=30)
    assert results[0] == ["ShutdownError"], (results, failures)
    assert [type(e).__name__ for e in failures] == ["ShutdownError"], failures
