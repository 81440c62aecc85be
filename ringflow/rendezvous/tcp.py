"""TCP store: a :class:`StoreServer` holding the data and its :class:`TCPStore` clients.

Wire format of :class:`TCPStore` (after :func:`ringflow.wire.server_handshake`; each message is one
:func:`ringflow.wire.send_frame` frame; integers big-endian; no pickle)::

    request  : op u8 | timeout_s f64 | amount i64 | nkeys u32 | nkeys x (len u32 | key) | value
    response : status u8 | payload

Keys are UTF-8. Ops: 1 SET (1 key, value), 2 GET (1 key; payload = value), 3 WAIT (any keys),
4 ADD (1 key, ``amount``; payload = new value as i64), 5 DELETE (1 key; payload = 1 byte, 1 if it
existed).
Status 0 is success; 1 timeout, 2 bad value, 3 protocol error, 4 shutdown carry a UTF-8 message
that the client raises as RingflowTimeoutError, ConfigError, ProtocolError, ShutdownError. A
request frame over 64 MiB + 1 MiB, a malformed request or an unknown op is logged, answered with
status 3 and the connection closed; a failed handshake closes it at once. Either way the server
goes on serving its other clients. A server thread waits for a key no longer than the client's
timeout, and stops early when the client disconnects or the server closes.

Cost: one round trip per call; a TCPStore serialises its calls (one lock, one connection). The
server runs handshakes without a thread each (:class:`ringflow.wire.Acceptor`: one selector
thread, at most ``handshake_limit`` at once, the oldest dropped for a newer one), then one thread
per authenticated client, at most ``max_clients`` (a client past that is closed), so a slow or
silent client delays nobody else and strangers cost no thread. The handshake and each request
must arrive within the server's ``timeout``. Out of file descriptors, the acceptor backs off
rather than spin; rejected connections are logged at most ``wire.LOG_BURST`` lines a minute.
(1,000 idle connections used to start 1,011 threads, and 10,000 rejected ones wrote 10,000
lines.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence

from ..errors import (
    AuthenticationError,
    ConfigError,
    PeerError,
    ProtocolError,
    RingflowError,
    RingflowTimeoutError,
    ShutdownError,
)
from ..polling import polls
from ..wire import Acceptor, Throttle, client_handshake, recv_frame, send_frame
from .secret import read_secret
from .stores import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MemoryStore,
    _Base,
    _check_amount,
    _check_key,
    _check_keys,
    _check_value,
)

log = logging.getLogger(__name__)

_MAX_FRAME = MAX_VALUE_BYTES + 1024 * 1024

_SET, _GET, _WAIT, _ADD, _DELETE = 1, 2, 3, 4, 5
_OP_NAMES = {_SET: "set", _GET: "get", _WAIT: "wait", _ADD: "add", _DELETE: "delete"}
_OK, _ERR_TIMEOUT, _ERR_VALUE, _ERR_PROTOCOL, _ERR_SHUTDOWN = 0, 1, 2, 3, 4
_ERRORS: dict[int, type[RingflowError]] = {
    _ERR_TIMEOUT: RingflowTimeoutError,
    _ERR_VALUE: ConfigError,
    _ERR_PROTOCOL: ProtocolError,
    _ERR_SHUTDOWN: ShutdownError,
}
_HEAD = struct.Struct("!BdqI")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")

class StoreServer(_Base):
    """Holds a job's key-value data and serves it to authenticated :class:`TCPStore` clients.

    ``port=0`` picks a free port; read it from ``.port``. ``timeout`` bounds the handshake and the
    arrival of each request (not the idle time between requests of an authenticated client).
    ``max_clients`` authenticated connections are served at once (each rank holds one or two);
    ``handshake_limit`` connections may be in their handshake at once.
    """

    def __init__(
        self, secret: bytes, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
        *, max_clients: int = 4096, handshake_limit: int = 128,
    ) -> None:
        super().__init__(timeout)
        self._secret = _check_secret(secret)
        self._store = MemoryStore(self._timeout)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise ConfigError(
                f"the rendezvous store cannot listen on {host}:{port}: {exc}; "
                "choose another address or port (0 picks a free one)"
            ) from exc
        self.host: str = self._listener.getsockname()[0]
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._max_clients = max_clients
        self._closed = False
        self._throttle = Throttle(log)
        self._acceptor = Acceptor(
            self._listener, self._secret, self._timeout, self._start,
            lambda addr, why: self._reject(_format_addr(addr), "failed the handshake", why),
            name=f"ringflow-store-{self.port}", limit=handshake_limit,
        )

    def close(self) -> None:
        """Stop accepting, wake waiting clients, close every connection; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = dict(self._conns)
        self._acceptor.close()
        self._store.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 2.0
        for thread in conns.values():
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _start(self, conn: socket.socket, addr: object) -> None:
        """An authenticated client (on the acceptor's thread): a thread of its own."""
        peer = _format_addr(addr)
        thread = threading.Thread(
            target=self._serve_and_close, args=(conn, peer),
            name=f"ringflow-store-{self.port}-{peer}", daemon=True,
        )
        with self._lock:
            full = len(self._conns) >= self._max_clients
            if self._closed or full:
                if full:
                    self._reject(peer, "was refused", f"{self._max_clients} clients are "
                                 "connected already (StoreServer(max_clients=...))")
                conn.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _serve_and_close(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve(conn, peer)
        except (RingflowError, OSError) as exc:
            log.debug("rendezvous store %s: connection from %s ended: %s", self.port, peer, exc)
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(conn, None)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            conn.settimeout(None)  # an authenticated client may be idle between requests ...
            if not conn.recv(1, socket.MSG_PEEK):
                return  # closed cleanly between requests
            conn.settimeout(self._timeout)  # ... but not stall in the middle of one
            try:
                request = _decode_request(recv_frame(conn, _MAX_FRAME))
            except ProtocolError as exc:
                self._reject(peer, "sent a malformed request", exc)
                with contextlib.suppress(RingflowError, OSError):
                    send_frame(conn, [bytes([_ERR_PROTOCOL]), str(exc).encode()])
                return
            except (RingflowError, OSError) as exc:
                self._reject(peer, "broke off in the middle of a request", exc)
                return
            status, payload = self._execute(conn, *request)
            send_frame(conn, [bytes([status]), payload])

    def _execute(
        self, conn: socket.socket, op: int, timeout: float, amount: int, keys: list[str],
        value: bytes,
    ) -> tuple[int, bytes]:
        store = self._store
        gone = functools.partial(_peer_gone, conn)
        try:
            if op == _SET:
                store.set(keys[0], value)
                return _OK, b""
            if op == _GET:
                return _OK, store._get(keys[0], timeout, gone)
            if op == _WAIT:
                store._wait(keys, timeout, gone)
                return _OK, b""
            if op == _ADD:
                return _OK, _I64.pack(store.add(keys[0], amount))
            return _OK, b"\x01" if store.delete(keys[0]) else b"\x00"
        except RingflowTimeoutError as exc:
            return _ERR_TIMEOUT, str(exc).encode()
        except ConfigError as exc:
            return _ERR_VALUE, str(exc).encode()
        except ShutdownError:
            return _ERR_SHUTDOWN, b"the rendezvous store server is shutting down"

    def _reject(self, peer: str, what: str, exc: object) -> None:
        if self._closed:
            log.debug("rendezvous store %s: %s %s during shutdown: %s", self.port, peer, what, exc)
        else:
            self._throttle.log(
                logging.ERROR, "rendezvous store %s:%s: the connection from %s %s and was "
                "closed: %s", self.host, self.port, peer, what, exc,
            )



class TCPStore(_Base):
    """A :class:`Store` served by a :class:`StoreServer`; thread-safe (one request at a time).

    Connecting retries a refused connection until ``timeout`` (the server may start a moment
    after its clients). Raises PeerError if the server cannot be reached, AuthenticationError if
    it does not accept ``secret``.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0) -> None:
        super().__init__(timeout)
        self.host, self.port = host, port
        secret = _check_secret(secret)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._connect(secret)

    def set(self, key: str, value: bytes) -> None:
        key = _check_key(key)
        self._call(_SET, [key], 0.0, 0, _check_value(key, value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._call(_GET, [_check_key(key)], self._resolve(timeout))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._call(_WAIT, _check_keys(keys), self._resolve(timeout))

    def add(self, key: str, amount: int) -> int:
        key = _check_key(key)
        (total,) = _I64.unpack(self._call(_ADD, [key], 0.0, _check_amount(key, amount)))
        return total

    def delete(self, key: str) -> bool:
        return self._call(_DELETE, [_check_key(key)]) == b"\x01"

    def local_address(self) -> str:
        """This end's address on the connection to the server: the interface that routes there."""
        sock = self._sock
        if sock is None:
            raise PeerError("the store client is closed")
        return str(sock.getsockname()[0])

    def close(self) -> None:
        # Without the lock, so that close() from another thread interrupts a waiting get().
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _connect(self, secret: bytes) -> socket.socket:
        where = f"the rendezvous store at {self.host}:{self.port}"
        deadline = time.monotonic() + self._timeout
        sock: socket.socket | None = None
        error: OSError | None = None
        for _ in polls(self._timeout, 0.01, 0.5):  # the server may not be listening yet
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(deadline - time.monotonic(), 0.01)
                )
                break
            except OSError as exc:
                error = exc
                if isinstance(exc, socket.gaierror):  # no such host: waiting will not help
                    break
        if sock is None:
            raise PeerError(
                f"cannot connect to {where} within {self._timeout:g} s: {error}; check "
                "RINGFLOW_RENDEZVOUS_ADDR / RINGFLOW_RENDEZVOUS_PORT and that the "
                "launcher is still running"
            ) from error
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, secret, self._timeout)
        except (AuthenticationError, ProtocolError, RingflowTimeoutError):
            sock.close()
            raise
        except (PeerError, OSError) as exc:
            # The server closes the connection, without a word, on a client MAC it rejects.
            sock.close()
            raise AuthenticationError(
                f"{where} closed the connection during the handshake, which it does when the "
                "client's secret differs from the job's; use the secret of the job that started "
                f"this store (RINGFLOW_SECRET_FD / RINGFLOW_SECRET_FILE) ({exc})"
            ) from exc
        return sock

    def _call(
        self, op: int, keys: list[str], timeout: float = 0.0, amount: int = 0, value: bytes = b""
    ) -> bytes:
        parts = [_HEAD.pack(op, timeout, amount, len(keys))]
        for key in keys:
            raw = key.encode()
            parts += [_U32.pack(len(raw)), raw]
        parts.append(value)
        what = f"{_OP_NAMES[op]} {keys[0]!r}" if len(keys) == 1 else f"wait for {len(keys)} keys"
        with self._lock:
            sock = self._sock
            if sock is None:
                raise PeerError(
                    f"{what}: the connection to the rendezvous store at {self.host}:{self.port} "
                    "is closed; create a new TCPStore"
                )
            try:
                # The server answers a wait no later than its timeout; allow as much again.
                sock.settimeout(timeout + self._timeout)
                send_frame(sock, parts)
                frame = recv_frame(sock, _MAX_FRAME)
            except (RingflowError, OSError) as exc:
                self.close()
                kind = RingflowTimeoutError if isinstance(exc, RingflowTimeoutError) else PeerError
                raise kind(
                    f"{what}: the rendezvous store at {self.host}:{self.port} did not answer: "
                    f"{exc}; the launcher (which runs the store) may have exited"
                ) from exc
            if not frame:
                self.close()
                raise ProtocolError(f"{what}: the rendezvous store sent an empty response")
            if frame[0] == _OK:
                return bytes(frame[1:])
            if frame[0] == _ERR_PROTOCOL:
                self.close()  # the server closes the connection after a protocol error
            message = bytes(frame[1:]).decode("utf-8", "replace")
            raise _ERRORS.get(frame[0], ProtocolError)(message)



def connect(environ: Mapping[str, str] | None = None, timeout: float = 30.0) -> TCPStore:
    """A :class:`TCPStore` to the store named by the launcher's environment variables."""
    env = os.environ if environ is None else environ
    host = env.get("RINGFLOW_RENDEZVOUS_ADDR", "")
    port_text = env.get("RINGFLOW_RENDEZVOUS_PORT", "")
    if not host or not port_text:
        raise ConfigError(
            "RINGFLOW_RENDEZVOUS_ADDR and RINGFLOW_RENDEZVOUS_PORT must both be set (got "
            f"{host!r} and {port_text!r}); start this process with ringflow-run or ringflow.run"
        )
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(
            f"RINGFLOW_RENDEZVOUS_PORT={port_text!r} is not a port number (1 to 65535)"
        )
    return TCPStore(host, port, read_secret(env), timeout)



def _decode_request(frame: bytearray) -> tuple[int, float, int, list[str], bytes]:
    if len(frame) < _HEAD.size:
        raise ProtocolError(
            f"a request of {len(frame)} bytes is shorter than the {_HEAD.size}-byte header"
        )
    op, timeout, amount, nkeys = _HEAD.unpack_from(frame)
    if op not in _OP_NAMES:
        raise ProtocolError(
            f"unknown request opcode {op} (known: {sorted(_OP_NAMES)}); are the client and the "
            "server from the same ringflow version?"
        )
    if not (timeout >= 0.0 and math.isfinite(timeout)):
        raise ProtocolError(f"a {_OP_NAMES[op]} request carries the timeout {timeout!r}")
    if (op != _WAIT and nkeys != 1) or nkeys > (len(frame) - _HEAD.size) // _U32.size:
        raise ProtocolError(f"a {_OP_NAMES[op]} request claims {nkeys} keys")
    pos, keys = _HEAD.size, []
    for _ in range(nkeys):
        if pos + _U32.size > len(frame):
            raise ProtocolError(f"a {_OP_NAMES[op]} request ends inside its key list")
        (size,) = _U32.unpack_from(frame, pos)
        pos += _U32.size
        if not 0 < size <= MAX_KEY_BYTES or pos + size > len(frame):
            raise ProtocolError(f"a key of a {_OP_NAMES[op]} request has a bad length ({size})")
        try:
            keys.append(frame[pos : pos + size].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"a key of a {_OP_NAMES[op]} request is not UTF-8") from exc
        pos += size
    value = bytes(frame[pos:])
    if op != _SET and value:
        raise ProtocolError(f"a {_OP_NAMES[op]} request has {len(value)} stray bytes")
    if len(value) > MAX_VALUE_BYTES:
        raise ProtocolError(f"a value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    return op, timeout, amount, keys, value


def _peer_gone(conn: socket.socket) -> bool:
    """Whether the client of ``conn`` has closed its side (checked without blocking)."""
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        return not conn.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.settimeout(timeout)



def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ConfigError(
            "the job secret must be non-empty bytes (see ringflow.wire.new_secret and read_secret)"
        )
    return bytes(secret)


def _format_addr(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)

