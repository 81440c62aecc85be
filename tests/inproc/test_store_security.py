"""A StoreServer faced with hostile or broken clients: it rejects them, logs why, and keeps serving.

Each test speaks to the server over a raw socket, checks that the server closed that connection,
that the rejection was logged, and that a proper TCPStore client still works afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ringflow
from ringflow import wire
from ringflow.errors import AuthenticationError
from ringflow.rendezvous import StoreServer, TCPStore
from ringflow.wire import client_handshake, new_secret, recv_frame, send_frame

pytestmark = pytest.mark.timeout(60)

LOGGER = "ringflow.rendezvous.tcp"
HELLO = 4 + 32  # b"RFW1" + the server's nonce
HEAD = struct.Struct("!BdqI")
ROOT = str(Path(ringflow.__file__).resolve().parent.parent)


@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def server(secret: bytes, caplog: pytest.LogCaptureFixture) -> Iterator[StoreServer]:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    srv = StoreServer(secret, timeout=5.0)
    yield srv
    srv.close()


def raw(server: StoreServer) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=5)
    sock.settimeout(5)
    return sock


def authenticated(server: StoreServer, secret: bytes) -> socket.socket:
    sock = raw(server)
    client_handshake(sock, secret, 5)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails the test if it does not within 5 s."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail("the server did not close the bad connection")
    finally:
        sock.close()
    return data


def errors_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR
    )


def assert_server_serves(server: StoreServer, secret: bytes) -> None:
    with TCPStore(server.host, server.port, secret, timeout=5) as store:
        store.set("alive", b"yes")
        assert store.get("alive") == b"yes"
        assert store.add("visits", 1) >= 1


def test_garbage_before_handshake(server: StoreServer, secret: bytes, caplog) -> None:
    sock = raw(server)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
    data = read_until_closed(sock)
    assert len(data) == HELLO  # the server's hello, and nothing after it
    assert "failed the handshake" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_wrong_mac(server: StoreServer, secret: bytes, caplog) -> None:
    sock = raw(server)
    hello = sock.recv(HELLO, socket.MSG_WAITALL)
    nonce_c = b"\x01" * 32
    mac = hmac.new(b"wrong secret", b"client" + hello[4:] + nonce_c, hashlib.sha256).digest()
    sock.sendall(nonce_c + mac)
    assert read_until_closed(sock) == b""  # the server never proves itself to a stranger
    assert "secret" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_truncated_handshake(server: StoreServer, secret: bytes, caplog) -> None:
    sock = raw(server)
    sock.recv(HELLO, socket.MSG_WAITALL)
    sock.sendall(b"\x02" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert read_until_closed(sock) == b""
    assert "closed the connection after 10 of 64 bytes" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_silent_client_blocks_nobody_and_times_out(secret: bytes, caplog) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    with StoreServer(secret, timeout=0.5) as server:
        silent = raw(server)
        start = time.monotonic()
        assert_server_serves(server, secret)  # while the silent client holds its connection
        assert time.monotonic() - start < 0.5
        read_until_closed(silent)
        assert "failed the handshake" in errors_logged(caplog)


def test_oversized_length_field(server: StoreServer, secret: bytes, caplog) -> None:
    sock = authenticated(server, secret)
    start = time.monotonic()
    sock.sendall(struct.pack("!Q", 2**62))
    response = read_until_closed(sock)
    # Answered at once, without trying to allocate 4 EiB (which would raise or take forever).
    assert time.monotonic() - start < 2.0
    assert b"exceeds the limit" in response
    assert "exceeds the limit" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_truncated_frame(server: StoreServer, secret: bytes, caplog) -> None:
    sock = authenticated(server, secret)
    sock.sendall(struct.pack("!Q", 100) + b"\x01" * 10)
    sock.shutdown(socket.SHUT_WR)
    assert read_until_closed(sock) == b""
    assert "middle of a request" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_unknown_opcode(server: StoreServer, secret: bytes, caplog) -> None:
    sock = authenticated(server, secret)
    send_frame(sock, [HEAD.pack(99, 0.0, 0, 0)])
    response = recv_frame(sock, 4096)
    assert response[0] == 3 and b"unknown request opcode 99" in response
    assert read_until_closed(sock) == b""
    assert "unknown request opcode 99" in errors_logged(caplog)
    assert_server_serves(server, secret)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"\x01", "shorter than"),
        (HEAD.pack(2, 0.0, 0, 1), "claims 1 keys"),
        (HEAD.pack(3, 0.0, 0, 2) + struct.pack("!I", 1) + b"k\0\0\0", "ends inside its key list"),
        (HEAD.pack(2, 0.0, 0, 1) + struct.pack("!I", 50) + b"k", "bad length (50)"),
        (HEAD.pack(2, 0.0, 0, 1) + struct.pack("!I", 0), "bad length (0)"),
        (HEAD.pack(2, 0.0, 0, 2) + struct.pack("!I", 1) + b"k" * 5, "claims 2 keys"),
        (HEAD.pack(3, 0.0, 0, 2**32 - 1) + b"\x00" * 8, "claims 4294967295 keys"),
        (HEAD.pack(2, float("nan"), 0, 1) + struct.pack("!I", 1) + b"k", "timeout nan"),
        (HEAD.pack(2, 0.0, 0, 1) + struct.pack("!I", 1) + b"\xff", "not UTF-8"),
        (HEAD.pack(2, 0.0, 0, 1) + struct.pack("!I", 1) + b"kxyz", "3 stray bytes"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_malformed_request(server: StoreServer, secret: bytes, caplog, body, fragment) -> None:
    sock = authenticated(server, secret)
    send_frame(sock, [body])
    response = recv_frame(sock, 4096)
    assert response[0] == 3 and fragment in response.decode()
    assert read_until_closed(sock) == b""
    assert fragment in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_wrong_secret_client(server: StoreServer, secret: bytes, caplog) -> None:
    with pytest.raises(AuthenticationError, match="secret"):
        TCPStore(server.host, server.port, new_secret(), timeout=5)
    assert "failed the handshake" in errors_logged(caplog)
    assert_server_serves(server, secret)


def test_client_rejects_impostor_server(secret: bytes) -> None:
    with StoreServer(new_secret()) as impostor, pytest.raises(AuthenticationError):
        TCPStore(impostor.host, impostor.port, secret, timeout=5)


def test_disconnected_waiter_frees_its_thread(server: StoreServer, secret: bytes) -> None:
    sock = authenticated(server, secret)
    send_frame(sock, [HEAD.pack(2, 30.0, 0, 1), struct.pack("!I", 5), b"never"])
    time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 5
    while server._conns and time.monotonic() < deadline:  # checked every 0.5 s server-side
        time.sleep(0.05)
    assert not server._conns
    assert_server_serves(server, secret)


def test_close_closes_all_connections(secret: bytes) -> None:
    server = StoreServer(secret)
    idle = authenticated(server, secret)
    half = raw(server)
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 3
    read_until_closed(idle)
    read_until_closed(half)
    with pytest.raises(OSError):
        socket.create_connection((server.host, server.port), timeout=1).close()


def _store_threads() -> int:
    return sum(t.name.startswith("ringflow-store") for t in threading.enumerate())


def test_idle_connections_cost_no_thread_and_are_bounded(secret: bytes) -> None:
    """1,000 connections that never speak: no thread each (they used to start 1,011), at most
    ``handshake_limit`` held open, and real clients served meanwhile."""
    with StoreServer(secret, timeout=30.0, handshake_limit=64) as server:
        idle = []
        for _ in range(1000):
            idle.append(socket.create_connection((server.host, server.port), timeout=5))
        deadline = time.monotonic() + 5
        while server._acceptor.pending < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads, pending = _store_threads(), server._acceptor.pending
        start = time.monotonic()
        assert_server_serves(server, secret)
        took = time.monotonic() - start
        print(f"1000 idle connections: {threads} store threads, {pending} held in their "
              f"handshake, a client served in {took * 1e3:.1f} ms")
        assert threads <= 2 and pending <= 64
        for sock in idle:
            sock.close()


def test_authenticated_clients_are_capped(secret: bytes, caplog) -> None:
    with StoreServer(secret, max_clients=3) as server:
        clients = [authenticated(server, secret) for _ in range(3)]
        extra = authenticated(server, secret)
        assert read_until_closed(extra) == b""
        assert "clients are connected already" in errors_logged(caplog)
        for sock in clients:
            sock.close()
        deadline = time.monotonic() + 5
        while server._conns and time.monotonic() < deadline:
            time.sleep(0.02)
        assert_server_serves(server, secret)


def test_rejected_connections_are_logged_at_a_bounded_rate(secret: bytes, caplog) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    count = 2000
    with StoreServer(secret, timeout=5.0) as server:
        for _ in range(count):
            sock = raw(server)
            sock.sendall(b"\x00" * 64)  # a wrong MAC: rejected at once
            sock.close()
        deadline = time.monotonic() + 10
        while server._acceptor.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert_server_serves(server, secret)
    lines = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]
    print(f"{count} rejected connections: {len(lines)} log lines")
    assert len(lines) <= wire.LOG_BURST + 1


SERVER_SCRIPT = """
import resource, sys, time
from ringflow.rendezvous import StoreServer
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
server = StoreServer(bytes.fromhex(sys.argv[1]), timeout=30.0)
print(server.port, flush=True)
time.sleep(600)
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
@pytest.mark.processes
def test_out_of_file_descriptors_backs_off_instead_of_spinning(secret: bytes) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, secret.hex()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        socks = []
        for _ in range(120):  # far more than the 48 descriptors the server may hold
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        before = _cpu_seconds(proc.pid)
        time.sleep(2.0)
        used = _cpu_seconds(proc.pid) - before
        print(f"out of descriptors with {len(socks)} connections: the server used "
              f"{used:.2f} s of CPU in 2 s")
        assert used < 0.15, f"the server spun: {used:.2f} s of CPU in 2 s"
        for sock in socks:
            sock.close()
        time.sleep(1.5)  # the back-off is at most 1 s
        with TCPStore("127.0.0.1", port, secret, timeout=10) as store:
            store.set("after", b"1")
            assert store.get("after") == b"1"
    finally:
        proc.kill()
        proc.wait()
        err = proc.stderr.read()
    assert err.count("\n") <= 2 * wire.LOG_BURST + 5, err[-2000:]
