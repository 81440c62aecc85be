"""TCP transport: one authenticated connection per pair of ranks, data and control multiplexed.

Over 600 lines on purpose: the setup, the frames, the reader and sender threads and what each
does when a peer or its host fails are one protocol, read together (the failure rules of issues
18 and 32 live between the threads' lines).

Setup: every rank binds a listener, publishes ``host:port name`` (its address and its host's
name) under ``{prefix}tcp/{rank}`` in the rendezvous store, dials every lower rank and accepts
every higher one. Each connection runs the HMAC handshake of :mod:`ringflow.wire` before anything
is parsed; the dialer then sends its rank (8 bytes), checked against the ranks still expected,
and its host's name (1 byte of length, then UTF-8). Every rank thus knows each peer's host, which
its errors name (a lost or silent peer on another host is as often its host or the network as
the process). Handshakes run all at once
(:class:`ringflow.wire.Acceptor`), each bounded by ``min(timeout_s, 10 s)``, so connections
that never speak delay no peer (two idle ones used to keep a job from starting: handshakes were
served one at a time, each with the full timeout).

Frames: a 9-byte header ``(tag: u8, length: u64)`` then the payload. ``DATA`` frames carry the
bytes of an ``isend``; the receiving reader thread puts them straight into the buffer of the next
posted ``irecv`` for that peer (no intermediate copy) and checks that the length equals the posted
size. ``CTRL`` frames carry small control messages (at most ``MAX_CTRL_BYTES``) for the engine and
are handed to the callback set with :meth:`TcpTransport.set_ctrl_handler`. An empty ``CTRL``
frame is a goodbye: the peer is closing on purpose, so its end-of-file is reported as
ShutdownError ("rank r has shut down"), not as a lost peer.

Threads: one reader per peer, always reading, so a peer that dies is noticed at once even when no
operation is pending: every pending and later operation with it raises PeerError and the failure
handler is called. Sends are tried non-blocking from the calling thread first (a small message
costs no thread hand-off); whatever does not fit in the socket buffer goes to the peer's sender
thread.

Cost per message: one ``sendmsg`` (header + payload, no join) and two ``recv_into`` calls.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

from .. import wire
from ..errors import (
    PeerError,
    ProtocolError,
    RingflowError,
    RingflowTimeoutError,
    ShutdownError,
)
from .base import MAX_CTRL_BYTES, Transport, data_wait_s

__all__ = ["TcpTransport", "create"]

log = logging.getLogger(__name__)

_HDR = struct.Struct("!BQ")
#: How long a failed write waits for this peer's reader to reach the end of the stream, where a
#: goodbye it has not read yet would be (see _Peer._send_failed). Only failed writes wait.
_GOODBYE_GRACE_S = 5.0
#: How long :meth:`TcpTransport.close` waits for its goodbyes to be written, all peers together:
#: to a peer that reads, one is written at once; one still queued after this is behind a write
#: the peer does not take (the 2.5 s each had before, ``data_wait_s(1.0)``).
_GOODBYE_WRITE_S = 2.5
_DATA, _CTRL = 1, 2
_RANK = struct.Struct("!Q")
_TCP_RTO_MAX_MS = 44  # linux/tcp.h (Linux 6.15): the ceiling of the retransmission timeout
#: What Linux's default (tcp_retries2 = 15, backoff to 120 s) gives an unacknowledged write
#: before it resets the connection: about 15 minutes (924.6 s).
_TCP_GIVE_UP_S = 924.6
# The longest a connection to a data listener may take over its handshake and rank: peers answer
# in milliseconds; this only bounds what a connection that never speaks holds.
_HANDSHAKE_S = 10.0


class _Work:
    __slots__ = ("_done", "_error", "_peer", "_timeout", "buf")

    def __init__(self, buf: memoryview | None, peer: _Peer, timeout: float) -> None:
        self.buf = buf
        self._peer = peer
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        if self._done.is_set():  # aborted already (TcpTransport.abort)
            return
        self._error = error
        self._done.set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def done_by(self, deadline: float) -> bool:
        """Wait until done or ``deadline`` (``time.monotonic()``); whether it is done."""
        return self._done.wait(max(0.0, deadline - time.monotonic()))

    def wait(self) -> None:
        if not self._done.wait(data_wait_s(self._timeout)):
            raise RingflowTimeoutError(
                f"rank {self._peer.rank}'s part of the collective did not arrive within "
                f"{self._timeout} s; it may be frozen (RINGFLOW_TIMEOUT_S sets the limit)"
            )
        if self._error is not None:
            raise self._error


class _Peer:
    """One connection: a reader thread, a sender thread, and FIFOs of posted receives/sends."""

    def __init__(self, owner: TcpTransport, rank: int, sock: socket.socket, host: str) -> None:
        self.owner = owner
        self.rank = rank
        self.host = host
        self.sock = sock
        self.error: BaseException | None = None
        self.departed = False
        self._lock = threading.Lock()
        self._recvs: collections.deque[_Work] = collections.deque()
        self._recv_posted = threading.Condition(self._lock)
        # Queued frames: (header + payload still to write, work, is control, begun).
        self._sends: collections.deque[tuple[list[memoryview], _Work, bool, bool]] = (
            collections.deque())
        self._send_ready = threading.Condition(threading.Lock())
        self._send_lock = threading.Lock()  # one writer of the socket at a time
        self._pushing: _Work | None = None  # the send the sender thread is writing, if any
        name = f"ringflow-tcp-{owner.rank}<->{rank}"
        self._reader = threading.Thread(target=self._read_loop, name=name + "-r", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=name + "-s", daemon=True)
        self._reader.start()
        self._sender.start()

    # sending -----------------------------------------------------------------------------------
    def send(self, tag: int, payload: memoryview, work: _Work) -> None:
        bufs = [memoryview(_HDR.pack(tag, payload.nbytes)), payload]
        whole = bufs[0].nbytes + payload.nbytes
        with self._send_ready:
            if self.error is not None:
                raise self.error
            # Non-blocking first: at 1 MiB this beat handing every send to the sender thread
            # (blocking sendmsg, or sendall) by 16-39% (medians of 5 runs, 2 / 4 ranks: 1.1 / 4.1
            # ms vs 1.6 / 4.9 and 1.8 / 5.7 ms), and tied at 16-256 MiB (benchmarks/RESULTS.md).
            if not self._sends and self._send_lock.acquire(blocking=False):
                try:
                    bufs = self._push(bufs, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    log.debug("writing to rank %d failed: %s; the sender thread tries again",
                              self.rank, exc)
                finally:
                    self._send_lock.release()
            if bufs:
                # The rest, or a write that failed, goes to the sender thread: a failed write
                # waits there for the reader (_send_failed), never in this caller, which may hold
                # a lock the reader needs to deliver what it has read (the engine's control lock:
                # a 5 s stall of a coordinator's survivors under load, before).
                begun = sum(b.nbytes for b in bufs) < whole
                self._sends.append((bufs, work, tag == _CTRL, begun))
                self._send_ready.notify()
            else:
                work.finish()

    def _send_failed(self, exc: OSError) -> BaseException:
        """The error of a write that failed, the peer failed with it. A peer that said goodbye
        and closed has left (ShutdownError), it is not lost (PeerError, which fails the job):
        its goodbye may still sit unread in the socket when this rank's reader thread is slow to
        run (seen on a loaded 2-core host: the coordinator's plan to a rank that had left hit a
        closed socket before the goodbye was read). The reader reads up to that end at once;
        wait for it, a little (on the sender thread, which holds no lock the reader needs)."""
        self._reader.join(_GOODBYE_GRACE_S)
        log.debug("sending to rank %d failed: %s", self.rank, exc)
        error: RingflowError = (ShutdownError(f"rank {self.rank} has shut down") if self.departed
                                else lost(self.rank, self.host))
        self.fail(error)  # nothing if the reader failed the peer first
        return self.error or error

    def _push(self, bufs: list[memoryview], flags: int) -> list[memoryview]:
        """Send as much of ``bufs`` as the socket takes; return what is left."""
        while bufs:
            sent = self.sock.sendmsg(bufs, (), flags)
            while bufs and sent >= bufs[0].nbytes:
                sent -= bufs[0].nbytes
                bufs.pop(0)
            if bufs and sent:
                bufs[0] = bufs[0][sent:]
        return bufs

    def _send_loop(self) -> None:
        while True:
            with self._send_ready:
                while not self._sends and self.error is None:
                    self._send_ready.wait()
                if self.error is not None:
                    return
                bufs, work, _, _ = self._sends[0]
                # Owned by this thread from now on: fail() must not fail a send whose bytes may
                # all have been written (a peer that got them may say goodbye before we finish).
                self._pushing = work
            try:
                with self._send_lock:
                    self._push(bufs, 0)
            except OSError as exc:
                work.finish(self._send_failed(exc))
                return
            with self._send_ready:
                self._pushing = None
                if self._sends and self._sends[0][1] is work:
                    self._sends.popleft()
            work.finish()

    # receiving ---------------------------------------------------------------------------------
    def post_recv(self, work: _Work) -> None:
        with self._lock:
            if self.error is not None:
                raise self.error
            self._recvs.append(work)
            self._recv_posted.notify()

    def _read_loop(self) -> None:
        sock = self.sock
        try:
            while True:
                tag, size = _HDR.unpack(wire.recv_exact(sock, _HDR.size))
                if tag == _CTRL:
                    if size > MAX_CTRL_BYTES:
                        raise ProtocolError(
                            f"rank {self.rank} sent a control frame of {size} bytes "
                            f"(limit {MAX_CTRL_BYTES})"
                        )
                    # A bytearray, handed on as it is: a copy to bytes would cost a pass over
                    # every large point-to-point chunk (ringflow.p2p).
                    payload = wire.recv_exact(sock, size)
                    if payload:
                        self.owner._deliver_ctrl(self.rank, payload)
                    else:
                        self.departed = True
                elif tag == _DATA:
                    work = self._next_recv()
                    if work is None and self.error is None:
                        # The job has failed (abort): nobody takes this any more.
                        _discard(sock, size)
                        continue
                    if work is None:
                        return
                    buf = work.buf
                    if buf is None or size != buf.nbytes:
                        raise ProtocolError(
                            f"rank {self.rank} sent {size} bytes where this rank expected "
                            f"{0 if buf is None else buf.nbytes}; the ranks disagree about "
                            "the collective"
                        )
                    wire.recv_into_exact(sock, buf)
                    with self._lock:
                        if self._recvs and self._recvs[0] is work:  # else: aborted meanwhile
                            self._recvs.popleft()
                    work.finish()
                else:
                    raise ProtocolError(f"rank {self.rank} sent a frame with unknown tag {tag}")
        except RingflowTimeoutError:
            # No socket timeout is set after the setup: this is TCP giving up on the connection
            # (ETIMEDOUT: its data unacknowledged for TCP_USER_TIMEOUT, see _tune).
            where = f" on host {self.host}" if self.host else ""
            self.fail(PeerError(f"rank {self.rank}{where} stopped responding: TCP gave up on "
                                "the connection"))
        except RingflowError as exc:
            if self.departed:
                # Let the peer's close() see our end-of-file at once: it is waiting for it.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                self.fail(ShutdownError(f"rank {self.rank} has shut down"))
                return
            if self.owner.closed:
                return
            if isinstance(exc, ProtocolError):
                self.fail(PeerError(f"lost rank {self.rank}: {exc}"))
            else:  # end of file or a reset, mid-frame or not: the same text on every rank
                log.debug("lost rank %d: %s", self.rank, exc)
                self.fail(lost(self.rank, self.host))

    def _next_recv(self) -> _Work | None:
        with self._lock:
            while not self._recvs and self.error is None and self.owner.aborted is None:
                self._recv_posted.wait()
            return self._recvs[0] if self.error is None and self._recvs else None

    def abort(self, error: BaseException) -> None:
        """Fail this peer's pending data-plane work with ``error`` (the peer stays usable for
        control messages: the coordinator's verdict, the goodbye).

        Frames whose first bytes are written stay queued, their work failed: the rest of such a
        frame must follow it, or the peer would read every later frame as its payload, and the
        connection would end mid-frame (the peer then reported this rank lost instead of the
        verdict this rank sent: seen under load, a 1 MiB ring chunk half-written at the abort).
        Control frames stay queued too; data frames not begun are dropped."""
        with self._lock:
            recvs = list(self._recvs)
            self._recvs.clear()
            self._recv_posted.notify_all()
        with self._send_ready:
            queued = list(self._sends)
            self._sends = collections.deque(
                q for q in queued if q[2] or q[3] or q[1] is self._pushing)
            # Every data frame's waiter is released now (a write to a frozen peer may never end).
            sends = [work for _, work, ctrl, _ in queued if not ctrl]
        for work in recvs + sends:
            work.finish(error)

    # failure -----------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            recvs = list(self._recvs)
            self._recvs.clear()
            self._recv_posted.notify_all()
        with self._send_ready:
            sends = [w for _, w, _, _ in self._sends if w is not self._pushing]
            self._sends.clear()
            self._send_ready.notify_all()
            if self._pushing is not None:
                # Unblock a write the peer will never read; the sender thread then fails it.
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)
        for work in recvs + sends:
            work.finish(error)
        if not self.owner.closed:
            self.owner._peer_failed(self.rank, error)

    def start_goodbye(self) -> _Work | None:
        """Tell the peer we are closing on purpose: the goodbye is queued behind what is being
        sent (None: the peer has failed already)."""
        work = _Work(None, self, 1.0)
        try:
            self.send(_CTRL, memoryview(b""), work)
        except (RingflowError, OSError):
            return None
        return work

    def end_goodbye(self, work: _Work | None, deadline: float) -> None:
        """Once the goodbye is written (by ``deadline`` at the latest), stop writing; reads go
        on. A goodbye still unwritten then is given up: the peer does not read (frozen, or its
        host unreachable), and :meth:`close` unblocks the write."""
        if work is None or not work.done_by(deadline) or work.failed:
            return
        if self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)
            finally:
                self._send_lock.release()

    def close(self, deadline: float) -> None:
        # Reading to the peer's end-of-file before closing avoids a reset that could destroy
        # data the peer has not read yet.
        self._reader.join(max(0.0, deadline - time.monotonic()))
        self.fail(PeerError(f"the transport to rank {self.rank} was closed"))
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def lost(rank: int, host: str = "") -> PeerError:
    """The error of a peer whose connection ended without a goodbye, however it was noticed (end
    of file, a reset, a failed write): one text, so that every rank reports the same (``host`` is
    the name the peer gave itself, the same on every rank)."""
    where = f" on host {host}" if host else ""
    return PeerError(f"lost rank {rank}{where}: the connection was closed (the process exited or "
                     "was killed)")


def _discard(sock: socket.socket, size: int) -> None:
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size:
        n = min(size, scratch.nbytes)
        wire.recv_into_exact(sock, scratch[:n])
        size -= n


class TcpTransport(Transport):
    """The ``tcp`` transport. See the module docstring for the protocol."""

    def __init__(
        self, rank: int, size: int, socks: dict[int, socket.socket], timeout: float,
        hosts: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.closed = False
        self.aborted: BaseException | None = None
        self._timeout = timeout
        self._ctrl_handler: Callable[[int, bytes], None] | None = None
        self._fail_handler: Callable[[int, BaseException], None] | None = None
        self._early: list[tuple[int, bytes | bytearray]] = []
        self._handler_lock = threading.Lock()
        hosts = hosts or {}
        self._peers = {r: _Peer(self, r, s, hosts.get(r, "")) for r, s in socks.items()}

    def isend(self, buf: memoryview, dst: int) -> _Work:
        if self.aborted is not None:
            raise self.aborted
        peer = self._peer(dst)
        work = _Work(None, peer, self._timeout)
        peer.send(_DATA, memoryview(buf).cast("B"), work)
        return work

    def irecv(self, buf: memoryview, src: int) -> _Work:
        if self.aborted is not None:
            raise self.aborted
        peer = self._peer(src)
        work = _Work(memoryview(buf).cast("B"), peer, self._timeout)
        peer.post_recv(work)
        return work

    def send_ctrl(self, payload: bytes, dst: int) -> None:
        """Send a control message; it is delivered to ``dst``'s control handler."""
        peer = self._peer(dst)
        peer.send(_CTRL, memoryview(payload), _Work(None, peer, self._timeout))

    def set_ctrl_handler(
        self,
        on_ctrl: Callable[[int, bytes], None],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        """Route control messages (src, payload) and peer failures (rank, error) to callbacks.

        The callbacks run on reader threads and must not block. Messages that arrived before
        the handler was set are delivered now, in order.
        """
        with self._handler_lock:
            self._ctrl_handler, self._fail_handler = on_ctrl, on_failure
            early, self._early = self._early, []
        for src, payload in early:
            on_ctrl(src, payload)
        for peer in self._peers.values():
            if peer.error is not None:
                on_failure(peer.rank, peer.error)

    def peer_host(self, rank: int) -> str:
        """The name of ``rank``'s host as that rank gave it ("" for this rank, or one unknown)."""
        peer = self._peers.get(rank)
        return peer.host if peer is not None else ""

    def check_peers(self, ranks: Iterable[int] | None = None) -> None:
        """Raise the error of the first of ``ranks`` (default: every peer) found broken or gone,
        if any (cheap; no I/O). Pass the ranks being waited for: a peer that finished and said
        goodbye is not a failure for a wait that does not involve it. After :meth:`abort`, the
        job's error."""
        if self.aborted is not None:
            raise self.aborted
        for rank in self._peers if ranks is None else ranks:
            peer = self._peers.get(rank)
            if peer is not None and peer.error is not None:
                raise peer.error

    def abort(self, error: BaseException) -> None:
        """See :meth:`ControlChannel.abort`."""
        if self.aborted is not None:
            return
        self.aborted = error
        for peer in self._peers.values():
            peer.abort(error)

    def _deliver_ctrl(self, src: int, payload: bytes | bytearray) -> None:
        with self._handler_lock:
            handler = self._ctrl_handler
            if handler is None:
                self._early.append((src, payload))
                return
        handler(src, payload)

    def _peer_failed(self, rank: int, error: BaseException) -> None:
        with self._handler_lock:
            handler = self._fail_handler
        if handler is not None:
            handler(rank, error)
        else:
            log.debug("rank %d: peer %d failed: %s", self.rank, rank, error)

    def _peer(self, rank: int) -> _Peer:
        if self.closed:
            raise PeerError("the transport is closed")
        try:
            return self._peers[rank]
        except KeyError:
            raise ValueError(
                f"rank {rank} is not a peer of rank {self.rank} (size {self.size})"
            ) from None

    def close(self, linger: float = 2.0) -> None:
        """Say goodbye to every peer, wait up to ``linger`` s for theirs, then close.

        Bounded whatever the number of peers that no longer read (a host that vanished with a
        write to it in flight): goodbyes go to every peer at once and get
        :data:`_GOODBYE_WRITE_S` together, then the peers' goodbyes get ``linger`` together.
        (One peer after the other, each goodbye blocked behind a dead write waited 2.5 s: 5 s for
        the two ranks of a vanished host, minutes for a large one.)"""
        if self.closed:
            return
        self.closed = True
        peers = list(self._peers.values())
        byes = [peer.start_goodbye() for peer in peers]
        deadline = time.monotonic() + _GOODBYE_WRITE_S
        for peer, work in zip(peers, byes, strict=True):
            peer.end_goodbye(work, deadline)
        deadline = time.monotonic() + linger
        for peer in peers:
            peer.close(deadline)


def _bind_host(config: object, store: object) -> str:
    """``bind_addr`` if set; else the address of the interface this process reaches the
    rendezvous store through, which is the one its peers can reach it on (127.0.0.1 for a
    store that is not on the network)."""
    host = getattr(config, "bind_addr", "") or ""
    if host:
        return host
    local = getattr(store, "local_address", None)
    return local() if local is not None else "127.0.0.1"


def _data_secret(rank: int, store: object, prefix: str, timeout: float) -> bytes:
    """The job secret where this process has one; else a key published by rank 0 in the store.

    The store fallback serves in-process tests (MemoryStore/FileStore, which are not network
    reachable); processes started by ringflow-run always have the job secret.
    """
    from .. import rendezvous

    try:
        return rendezvous.read_secret()
    except RingflowError:
        pass
    key = f"{prefix}tcp/key"
    if rank == 0:
        store.set(key, wire.new_secret())  # type: ignore[attr-defined]
    return store.get(key, timeout)  # type: ignore[attr-defined,no-any-return]


def create(
    rank: int, size: int, store: object, config: object, prefix: str = "",
    secret: bytes | None = None, hostname: str = "",
) -> TcpTransport:
    """Connect rank ``rank`` of ``size`` to every other rank; returns when all are connected.
    ``hostname`` is this rank's host as its errors on other ranks name it (default: the
    machine's host name)."""
    timeout = float(getattr(config, "timeout_s", 30.0))
    if secret is None:
        secret = _data_secret(rank, store, prefix, timeout) if size > 1 else b""
    if size == 1:
        return TcpTransport(rank, size, {}, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((_bind_host(config, store), 0))
    listener.listen(max(size, 128))
    host, port = listener.getsockname()
    name = _host_name(hostname or socket.gethostname())
    store.set(f"{prefix}tcp/{rank}",  # type: ignore[attr-defined]
              f"{host}:{port} {name.decode()}".encode())

    socks: dict[int, socket.socket] = {}
    accepted: dict[int, socket.socket] = {}
    hosts: dict[int, str] = {}
    errors: list[BaseException] = []
    expected = set(range(rank + 1, size))
    all_in = threading.Event()
    if not expected:
        all_in.set()
    throttle = wire.Throttle(log)

    def rejected(addr: object, why: str) -> None:
        throttle.log(logging.WARNING, "rank %d rejected a data connection from %s: %s",
                     rank, addr, why)

    def authenticated(conn: socket.socket, addr: object) -> None:
        # The peer proved the secret and sends its rank right after: a short blocking read.
        try:
            conn.settimeout(min(timeout, _HANDSHAKE_S))
            (peer,) = _RANK.unpack(wire.recv_exact(conn, _RANK.size))
            if peer not in expected:
                raise ProtocolError(f"a connection claimed rank {peer}, not expected here")
            (length,) = wire.recv_exact(conn, 1)
            hosts[peer] = bytes(wire.recv_exact(conn, length)).decode(errors="replace")
        except (RingflowError, OSError) as exc:
            rejected(addr, str(exc))
            conn.close()
            return
        _tune(conn, timeout)
        expected.discard(peer)
        accepted[peer] = conn
        if not expected:
            all_in.set()

    acceptor = wire.Acceptor(listener, secret, min(timeout, _HANDSHAKE_S), authenticated,
                             rejected, name=f"ringflow-accept-{rank}", limit=4 * size + 16)
    try:
        for peer in range(rank):
            value = store.get(f"{prefix}tcp/{peer}", timeout).decode()  # type: ignore[attr-defined]
            addr, _, hosts[peer] = value.partition(" ")
            phost, pport = addr.rsplit(":", 1)
            conn = socket.create_connection((phost, int(pport)), timeout=timeout)
            _tune(conn, timeout)
            wire.client_handshake(conn, secret, timeout)
            conn.sendall(_RANK.pack(rank) + bytes([len(name)]) + name)
            socks[peer] = conn
        if not all_in.wait(timeout):
            errors.append(RingflowTimeoutError(
                f"rank {rank}: ranks {sorted(expected)} did not connect within {timeout} s"))
    finally:
        acceptor.close()  # closes the listener
        if errors:
            for s in accepted.values():
                s.close()
    if errors:
        for s in socks.values():
            s.close()
        raise errors[0]
    socks.update(accepted)
    for s in socks.values():
        s.settimeout(None)
    return TcpTransport(rank, size, socks, timeout, hosts)


def _host_name(name: str) -> bytes:
    """``name`` as it travels in the rank's hello: UTF-8, no spaces, at most 255 bytes."""
    return "_".join(name.split())[:255].encode()[:255]


def _tune(sock: socket.socket, timeout: float) -> None:
    # Socket buffers stay with the kernel's autotuning: explicit SO_SNDBUF/SO_RCVBUF (which turn
    # it off) were no faster in benchmarks/tcp_tuning.py (engine path, loopback, medians of 5
    # runs, 64 MiB on 2 / 4 ranks: auto 103 / 261 ms, 256 KiB 137 / 257, 1 MiB 109 / 232,
    # 4 MiB 106 / 242 ms; benchmarks/RESULTS.md), and 256 KiB was slower on 2 ranks.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A link that was down comes back unnoticed until TCP's next retransmission, and its
    # backoff doubles from 0.2 s: a 5 s outage resumed after 6.2 s, an 8 s one after 12.6 s --
    # past a 10 s RINGFLOW_TIMEOUT_S, so a job failed on a link that had been back for 4 s
    # (tests/multihost/test_link_faults.py). Capped at 1 s (the least Linux takes), the
    # connection resumes within a second of the link, and a job rides through any outage
    # shorter than timeout_s minus about 2 s. Linux 6.15+; elsewhere the backoff stays.
    # The kernel gives up on a connection after tcp_retries2 (15) retransmissions, a budget it
    # computes with this ceiling: 15 s instead of ~15 min, so that with the default 30 s
    # timeout an outage of 15-30 s ended the job at 15 s ("stopped responding"; measured)
    # rather than being ridden through. TCP_USER_TIMEOUT gives it back its ~15 minutes (and
    # never less than twice the longest data wait): ringflow's heartbeats decide, at timeout_s.
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, 1000)
    except OSError:
        return
    limit_s = max(_TCP_GIVE_UP_S, 2 * data_wait_s(timeout))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(limit_s * 1000))
