"""Authenticated, framed byte streams: the one place that speaks to a raw socket's first bytes.

Handshake (mutual, before anything else is read from the peer)::

    server -> client : b"RFW1" + nonce_s (32 random bytes)
    client -> server : nonce_c (32) + HMAC-SHA256(secret, b"client" + nonce_s + nonce_c)
    server -> client : HMAC-SHA256(secret, b"server" + nonce_c + nonce_s)

Every message has a fixed size, so nothing of variable length is parsed before the peer has proved
that it knows the job secret; a wrong MAC closes the connection. The secret itself never travels.

Frames after the handshake: an 8-byte big-endian length, then that many bytes. The receiver checks
the length against its own limit *before* allocating anything, so an oversized length field costs
nothing but the error.

Listening sockets (the rendezvous store, each rank's data listener) run the server side through an
:class:`Acceptor`: one thread and a selector for every connection still in its handshake, none
per connection, so idle or slow connections delay nobody. Each must finish within ``timeout``; at
most ``limit`` are pending at once (the oldest is dropped for a newer one: a peer that knows the
secret answers in microseconds, so what stays pending is what never answers). Running out of file
descriptors (EMFILE) backs off instead of spinning on a listener that stays readable, and
rejected connections are logged at most :data:`LOG_BURST` lines a minute, then counted.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from .errors import AuthenticationError, PeerError, ProtocolError, RingflowTimeoutError

__all__ = [
    "LOG_BURST",
    "SECRET_BYTES",
    "Acceptor",
    "Throttle",
    "client_handshake",
    "new_secret",
    "recv_exact",
    "recv_frame",
    "recv_into_exact",
    "send_frame",
    "server_handshake",
]

SECRET_BYTES = 32
_MAGIC = b"RFW1"
_NONCE = 32
_MAC = 32
_LEN = struct.Struct("!Q")
#: Rejected connections logged per minute, per listener; the rest are counted.
LOG_BURST = 10

log = logging.getLogger(__name__)


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return os.urandom(SECRET_BYTES)


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Prove the peer knows ``secret`` (and prove we do). Raises AuthenticationError."""
    sock.settimeout(timeout)
    nonce_s = os.urandom(_NONCE)
    _sendall(sock, _MAGIC + nonce_s)
    reply = recv_exact(sock, _NONCE + _MAC)
    nonce_c, mac = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", nonce_s, nonce_c)):
        raise AuthenticationError(
            "a connection did not prove knowledge of the job secret and was closed; "
            "only processes started by the same ringflow job may connect"
        )
    _sendall(sock, _mac(secret, b"server", nonce_c, nonce_s))


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """The client side of :func:`server_handshake`. Raises AuthenticationError."""
    sock.settimeout(timeout)
    hello = recv_exact(sock, len(_MAGIC) + _NONCE)
    if hello[: len(_MAGIC)] != _MAGIC:
        raise ProtocolError(f"the server is not a ringflow endpoint (it sent {hello[:4]!r})")
    nonce_s = hello[len(_MAGIC):]
    nonce_c = os.urandom(_NONCE)
    _sendall(sock, nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
    if not hmac.compare_digest(recv_exact(sock, _MAC), _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthenticationError(
            "the server did not prove knowledge of the job secret; is another job's store "
            "listening on this address?"
        )


def send_frame(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Send the concatenation of ``parts`` as one frame, without joining them in memory."""
    size = sum(memoryview(p).nbytes for p in parts)
    bufs = [memoryview(_LEN.pack(size)), *(memoryview(p).cast("B") for p in parts)]
    try:
        while bufs:
            sent = sock.sendmsg(bufs)
            while bufs and sent >= bufs[0].nbytes:
                sent -= bufs[0].nbytes
                bufs.pop(0)
            if bufs and sent:
                bufs[0] = bufs[0][sent:]
    except TimeoutError as exc:
        raise RingflowTimeoutError(f"sending {size} bytes timed out") from exc
    except OSError as exc:
        raise PeerError(f"sending to the peer failed: {exc}") from exc


def recv_frame(sock: socket.socket, max_bytes: int) -> bytearray:
    """Receive one frame; a length over ``max_bytes`` raises ProtocolError before allocating."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")
    return recv_exact(sock, size)


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; EOF raises PeerError, a timeout TimeoutError."""
    view = view.cast("B")
    got = 0
    try:
        while got < view.nbytes:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PeerError(
                    f"the peer closed the connection after {got} of {view.nbytes} bytes"
                )
            got += n
    except TimeoutError as exc:
        raise RingflowTimeoutError(
            f"no data from the peer for {sock.gettimeout()} s ({got} of {view.nbytes} bytes came)"
        ) from exc
    except PeerError:
        raise
    except OSError as exc:
        raise PeerError(f"receiving from the peer failed: {exc}") from exc


def _sendall(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise RingflowTimeoutError("the handshake timed out") from exc
    except OSError as exc:
        raise PeerError(f"the handshake failed: {exc}") from exc


class Throttle:
    """At most ``burst`` log lines per ``period`` seconds; the lines held back are counted and
    reported with the next line let through."""

    def __init__(self, logger: logging.Logger, burst: int = LOG_BURST,
                 period: float = 60.0) -> None:
        self._log, self._burst, self._period = logger, burst, period
        self._start = float("-inf")
        self._count = 0
        self._held = 0
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log ``msg`` unless over the limit; whether it was logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self._period:
                self._start, self._count = now, 0
            if self._count >= self._burst:
                self._held += 1
                return False
            self._count += 1
            held, self._held = self._held, 0
        if held:
            msg += f" ({held} similar lines were held back)"
        self._log.log(level, msg, *args)
        return True


class _Pending:
    __slots__ = ("addr", "conn", "deadline", "got", "nonce")

    def __init__(self, conn: socket.socket, addr: object, deadline: float) -> None:
        self.conn, self.addr, self.deadline = conn, addr, deadline
        self.nonce = os.urandom(_NONCE)
        self.got = bytearray()


class Acceptor:
    """Accept on ``listener`` and run :func:`server_handshake`'s protocol for every connection
    at once on one thread (see the module doc); ``on_ready(conn, addr)`` gets each connection
    that proved the secret, blocking, on that thread (it must not block for long);
    ``on_reject(addr, why)`` each one dropped. ``close()`` stops it and closes the listener."""

    def __init__(
        self, listener: socket.socket, secret: bytes, timeout: float,
        on_ready: Callable[[socket.socket, object], None],
        on_reject: Callable[[object, str], None], *, name: str, limit: int = 64,
    ) -> None:
        self._listener = listener
        self._secret, self._timeout, self._limit = secret, timeout, limit
        self._on_ready, self._on_reject = on_ready, on_reject
        self._pending: collections.OrderedDict[socket.socket, _Pending] = (
            collections.OrderedDict())
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        listener.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self, join: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(join)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        backoff = 0.0  # while out of file descriptors: the listener is not watched until resume
        resume = 0.0
        try:
            while not self._closed:
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    self._drop(sel, p, f"did not finish the handshake within {self._timeout} s")
                until = min((p.deadline for p in self._pending.values()), default=now + 1.0)
                if resume:
                    until = min(until, resume)
                for key, _ in sel.select(max(until - now, 0.0)):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._listener:
                        failed = self._accept(sel)
                        if failed is None:
                            backoff = 0.0
                        else:
                            # The listener stays readable: without a pause this loop would
                            # spin a core until a descriptor is free.
                            backoff = min(max(backoff * 2, 0.01), 1.0)
                            resume = time.monotonic() + backoff
                            sel.unregister(self._listener)
                            self._on_reject(None, f"cannot accept connections: {failed}; "
                                                  f"retrying in {backoff:.2f} s")
                    else:
                        self._advance(sel, key.data)
                if resume and time.monotonic() >= resume:
                    resume = 0.0
                    sel.register(self._listener, selectors.EVENT_READ)
        finally:
            for p in list(self._pending.values()):
                self._drop(sel, p, "the listener closed", quiet=True)
            sel.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _accept(self, sel: selectors.BaseSelector) -> OSError | None:
        """Accept what is waiting; the error if this process is out of descriptors."""
        for _ in range(64):  # a burst of connections: a few at a time, then the rest of the loop
            try:
                conn, addr = self._listener.accept()
            except BlockingIOError:
                return None
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._pending:  # free a descriptor: the oldest pending connection
                        oldest = next(iter(self._pending.values()))
                        self._drop(sel, oldest, "dropped: out of file descriptors")
                    return exc
                continue  # the client gave up before it was accepted
            if len(self._pending) >= self._limit:
                oldest = next(iter(self._pending.values()))
                self._drop(sel, oldest, f"dropped: {self._limit} connections were in their "
                                        "handshake and this was the oldest")
            pending = _Pending(conn, addr, time.monotonic() + self._timeout)
            try:
                conn.setblocking(False)
                conn.send(_MAGIC + pending.nonce)  # 36 bytes: a fresh socket's buffer takes it
            except OSError as exc:
                self._on_reject(addr, f"failed the handshake: {exc}")
                conn.close()
                continue
            self._pending[conn] = pending
            sel.register(conn, selectors.EVENT_READ, pending)
        return None

    def _advance(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            chunk = p.conn.recv(_NONCE + _MAC - len(p.got))
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(sel, p, f"failed the handshake: {exc}")
            return
        if not chunk:
            self._drop(sel, p, f"closed the connection after {len(p.got)} of "
                               f"{_NONCE + _MAC} bytes of the handshake")
            return
        p.got += chunk
        if len(p.got) < _NONCE + _MAC:
            return
        nonce_c, mac = bytes(p.got[:_NONCE]), bytes(p.got[_NONCE:])
        if not hmac.compare_digest(mac, _mac(self._secret, b"client", p.nonce, nonce_c)):
            self._drop(sel, p, "did not prove knowledge of the job secret")
            return
        sel.unregister(p.conn)
        del self._pending[p.conn]
        try:
            p.conn.send(_mac(self._secret, b"server", nonce_c, p.nonce))
            p.conn.setblocking(True)
        except OSError as exc:
            self._on_reject(p.addr, f"failed the handshake: {exc}")
            p.conn.close()
            return
        self._on_ready(p.conn, p.addr)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, why: str,
              quiet: bool = False) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(p.conn)
        self._pending.pop(p.conn, None)
        if not quiet:
            self._on_reject(p.addr, why)  # before the close: a peer that sees it may look
        p.conn.close()
