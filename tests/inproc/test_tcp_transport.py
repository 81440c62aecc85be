"""TCP transport behaviour that the collective suite does not pin down on its own."""

from __future__ import annotations

import socket
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


def test_control_after_an_abort_follows_a_half_written_data_frame(monkeypatch):
    """The caller wrote the first part of a large data frame and queued the rest; the job fails
    (abort) before the sender thread, starved of CPU as on a loaded host, has taken the rest up.
    The verdict sent next must reach the peer: the rest of the frame goes first. (Dropped with the
    frame's work, the verdict was read as frame payload and the peer, seeing the connection end
    mid-frame at this rank's exit, reported this rank lost: two texts for one failure.)"""
    loop = tcp._Peer._send_loop
    starve = threading.Event()
    go = threading.Event()

    def late_sender(self):
        if starve.is_set():
            go.wait(10)
        return loop(self)

    monkeypatch.setattr(tcp._Peer, "_send_loop", late_sender)
    got: list[bytes] = []
    arrived = threading.Event()
    aborted = threading.Event()
    starve.set()

    def body(t):
        buf = np.ones(16 << 20, np.uint8)  # larger than the socket buffers: part waits queued
        if t.rank == 0:
            work = t.isend(memoryview(buf), 1)
            t.abort(RuntimeError("the job failed"))
            t.send_ctrl(b"verdict", 1)
            go.set()
            with pytest.raises(RuntimeError, match="the job failed"):
                work.wait()
            aborted.wait(10)
            return arrived.wait(10)
        t.set_ctrl_handler(lambda src, payload: (got.append(bytes(payload)), arrived.set()),
                           lambda r, e: got.append(repr(e).encode()))
        go.wait(10)
        t.abort(RuntimeError("the job failed"))  # the reader then discards the frame
        aborted.set()
        return arrived.wait(10)

    assert testing.run_ranks(2, body, transport="tcp", deadline=30) == [True, True]
    # Rank 0's goodbye when the ranks close may reach rank 1's handler after the verdict: that is
    # the job's orderly end (ShutdownError), not the loss this test is about.
    assert [g for g in got if not g.startswith(b"ShutdownError(")] == [b"verdict"], got


def test_a_write_after_an_unread_goodbye_is_a_departure_not_a_loss(monkeypatch):
    """Rank 1 says goodbye and closes while rank 0's reader has not yet read the goodbye (a
    reader thread starved of CPU, as on a loaded host). Rank 0's writes to it then fail: that
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
            errors = set()
            for _ in range(200):  # until the reader reads the goodbye (and after, once)
                try:
                    t.send_ctrl(b"plan", 1)
                except Exception as exc:
                    errors.add(type(exc).__name__)
                    break
                time.sleep(0.05)
            return sorted(errors)
        t.close(linger=0.1)
        left.set()
        return []

    results = testing.run_ranks(2, body, transport="tcp", deadline=30)
    assert results[0] == ["ShutdownError"], (results, failures)
    assert [type(e).__name__ for e in failures] == ["ShutdownError"], failures


def test_a_failed_write_never_waits_in_a_caller_that_blocks_the_reader():
    """Rank 1 dies (its connection closes without a goodbye) after a control message that rank
    0's reader is now delivering to a handler blocked on a lock, and the thread holding that lock
    (as the engine's control lock is held by whoever submits) writes to rank 1. The write must
    not wait for the reader, which waits for the writer: that was a 5 s stall, then a verdict,
    for every survivor of a killed coordinator on a loaded host. Once the lock is free, the
    reader reaches the end of the stream and rank 1 is lost, once, with the usual text."""
    held = threading.Lock()
    delivering = threading.Event()
    failures: list[BaseException] = []
    closed = threading.Event()

    def on_ctrl(src, payload):
        delivering.set()
        with held:
            pass

    def body(t):
        if t.rank == 1:
            t.send_ctrl(b"plan", 0)
            delivering.wait(10)
            t._peers[0].sock.shutdown(socket.SHUT_RDWR)  # as the kernel ends a killed process's
            closed.wait(10)
            return []
        t.set_ctrl_handler(on_ctrl, lambda r, e: failures.append(e))
        with held:
            assert delivering.wait(10)
            errors: list[str] = []

            def write():
                for _ in range(10):  # connection; our first writes may still be taken by the kernel
                    try:
                        t.send_ctrl(b"submit", 1)
                    except Exception as exc:
                        errors.append(type(exc).__name__)
                    time.sleep(0.02)

            writer = threading.Thread(target=write)
            writer.start()
            writer.join(3.0)
            stalled = writer.is_alive()
        writer.join()
        for _ in range(200):
            if failures:
                break
            time.sleep(0.01)
        closed.set()
        return [stalled, errors, [str(e) for e in failures]]

    stalled, errors, failures_seen = testing.run_ranks(2, body, transport="tcp", deadline=30)[0]
    assert not stalled
    assert set(errors) <= {"PeerError"}, errors
    assert failures_seen == [str(tcp.lost(1, socket.gethostname()))], failures_seen
