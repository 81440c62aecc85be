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
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence

from .errors import AuthenticationError, PeerError, ProtocolError, RingflowTimeoutError

__all__ = [
    "SECRET_BYTES",
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
