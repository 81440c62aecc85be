"""The TCP transport rejects garbage, unauthenticated and oversized input with a clear error.

Intruders connect to a rank's listener during setup (the only time it listens); the job still
comes up. An authenticated peer that breaks the frame protocol is reported as a failed peer
without the transport allocating what it claims.
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
from ringflow.errors import PeerError
from ringflow.rendezvous import MemoryStore
from ringflow.transport import sendrecv, tcp

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
CONFIG = Config(timeout_s=5.0)


def _start_rank0(store: MemoryStore) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(tcp.create(0, 2, store, CONFIG, secret=SECRET)), daemon=True
    )
    thread.start()
    return thread, out


def _rank0_addr(store: MemoryStore) -> tuple[str, int]:
    host, port = store.get("tcp/0", 5.0).decode().split()[0].rsplit(":", 1)
    return host, int(port)


def _raw(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=5.0)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    return True


def test_intruders_during_setup_are_rejected_and_the_job_comes_up(caplog):
    store = MemoryStore(10.0)
    thread, out = _start_rank0(store)
    addr = _rank0_addr(store)

    garbage = _raw(addr)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 100)
    assert _closed_by_server(garbage)

    wrong = _raw(addr)
    with pytest.raises(PeerError):  # AuthenticationError or a reset: the server hangs up
        wire.client_handshake(wrong, b"w" * 32, 5.0)

    truncated = _raw(addr)
    truncated.recv(36)
    truncated.sendall(b"\x01" * 10)
    truncated.close()

    impostor = _raw(addr)  # knows the secret but claims a rank that is not expected
    wire.client_handshake(impostor, SECRET, 5.0)
    impostor.sendall(struct.pack("!Q", 7))
    assert _closed_by_server(impostor)

    rank1 = tcp.create(1, 2, store, CONFIG, secret=SECRET)
    thread.join(10)
    rank0 = out[0]
    a, b = np.arange(5, dtype=np.int64), np.zeros(5, dtype=np.int64)
    got0 = np.zeros(5, dtype=np.int64)
    t = threading.Thread(target=lambda: sendrecv(rank0, memoryview(a), 1, memoryview(got0), 1))
    t.start()
    sendrecv(rank1, memoryview(a * 2), 0, memoryview(b), 0)
    t.join(10)
    assert b.tolist() == a.tolist() and got0.tolist() == (a * 2).tolist()
    rejected = [r.getMessage() for r in caplog.records if "rejected a data connection" in
                r.getMessage()]
    assert len(rejected) >= 3, rejected
    rank0.close()
    rank1.close()


@pytest.mark.parametrize("idle", [2, 50])
def test_idle_connections_during_setup_do_not_delay_the_job(idle):
    """Connections that never speak hold no handshake up (they used to be served one at a
    time, each with the full timeout: two of them kept a job from starting)."""
    store = MemoryStore(10.0)
    start = time.monotonic()
    thread, out = _start_rank0(store)
    addr = _rank0_addr(store)
    silent = [_raw(addr) for _ in range(idle)]
    half = _raw(addr)
    half.recv(36)
    half.sendall(b"\x01" * 20)  # part of a handshake, then nothing
    rank1 = tcp.create(1, 2, store, CONFIG, secret=SECRET)
    thread.join(10)
    took = time.monotonic() - start
    print(f"{idle} idle connections to rank 0's listener: the job connected in {took:.2f} s "
          f"(timeout_s {CONFIG.timeout_s})")
    assert out and took < 2.0
    out[0].close()
    rank1.close()
    for sock in [*silent, half]:
        sock.close()


def _fake_peer(store: MemoryStore) -> tuple[tcp.TcpTransport, socket.socket, list]:
    """Rank 0 for real; rank 1 played by the test over a raw authenticated socket."""
    thread, out = _start_rank0(store)
    sock = _raw(_rank0_addr(store))
    wire.client_handshake(sock, SECRET, 5.0)
    sock.sendall(struct.pack("!Q", 1) + b"\x04fake")  # its rank, then its host's name
    thread.join(10)
    failures: list = []
    out[0].set_ctrl_handler(lambda src, payload: None, lambda rank, err: failures.append(err))
    return out[0], sock, failures


def _wait_for(failures: list) -> BaseException:
    for _ in range(500):
        if failures:
            return failures[0]
        threading.Event().wait(0.01)
    raise AssertionError("the transport did not report the broken peer")


def test_oversized_control_frame_is_rejected_without_allocating():
    t, sock, failures = _fake_peer(MemoryStore(10.0))
    sock.sendall(struct.pack("!BQ", 2, 2**62))
    err = _wait_for(failures)
    assert isinstance(err, PeerError)
    assert "control frame of 4611686018427387904 bytes" in str(err) and "rank 1" in str(err)
    with pytest.raises(PeerError, match="rank 1"):
        t.irecv(memoryview(bytearray(4)), 1).wait()
    t.close(linger=0)


def test_data_frame_of_the_wrong_size_is_a_protocol_error():
    t, sock, failures = _fake_peer(MemoryStore(10.0))
    work = t.irecv(memoryview(bytearray(8)), 1)
    sock.sendall(struct.pack("!BQ", 1, 5) + b"12345")
    with pytest.raises(PeerError, match="sent 5 bytes where this rank expected 8"):
        work.wait()
    assert "sent 5 bytes" in str(_wait_for(failures))
    t.close(linger=0)


def test_unknown_frame_tag_is_a_protocol_error():
    t, sock, failures = _fake_peer(MemoryStore(10.0))
    sock.sendall(struct.pack("!BQ", 99, 0))
    assert "unknown tag 99" in str(_wait_for(failures))
    t.close(linger=0)


def test_peer_that_dies_fails_pending_receives_at_once():
    t, sock, _ = _fake_peer(MemoryStore(10.0))
    work = t.irecv(memoryview(bytearray(8)), 1)
    sock.close()
    with pytest.raises(PeerError, match="lost rank 1 on host fake: the connection was closed"):
        work.wait()
    t.close(linger=0)
