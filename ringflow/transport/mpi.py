"""MPI transport: the ranks of an mpi4py communicator, for data and for the engine's control plane.

Selected when the job was started by ``mpirun`` (topology detector ``openmpi`` or ``pmi``), mpi4py
imports and gives ``MPI_THREAD_MULTIPLE`` on every rank, and ``RINGFLOW_TRANSPORT`` is ``auto``
or ``mpi`` (see :func:`ringflow.transport.connect`); or by ``ringflow.init(comm=...)``, which makes
a job of just the ranks of that communicator (Horovod's ``hvd.init(comm=...)``).

Setup: :func:`create` duplicates the communicator (``MPI_Comm_dup``, collective), so that no
message of ringflow can ever match one of the application's, and sets ``MPI_ERRORS_RETURN`` on
the duplicate so that MPI errors become Python exceptions. Nothing goes through the rendezvous
store.

Data: :meth:`MpiTransport.isend` / :meth:`MpiTransport.irecv` are ``MPI_Isend`` / ``MPI_Irecv``
of the buffer's bytes on tag ``DATA_TAG``; MPI's non-overtaking rule keeps messages of one pair in
order, as the Transport protocol requires. A receive that gets a different number of bytes than
it posted is a ProtocolError (``MPI_ERR_TRUNCATE`` or a short count), never a silent truncation.

Control plane (what :class:`~ringflow.engine.Engine` uses, same semantics as the tcp transport):
:meth:`MpiTransport.send_ctrl` is an ``MPI_Isend`` of the pickled message on tag ``CTRL_TAG``;
one receiver thread per rank takes them with ``MPI_Improbe`` + ``MPI_Mrecv`` (matched probe:
no other thread can steal the probed message) and hands them to the handler. An empty control
message is a goodbye (the peer is closing on purpose): its pending and later operations with this
rank fail with ShutdownError, and the failure handler is called, exactly as a tcp goodbye.

Threads: the engine thread (data, native allreduce), the heartbeat thread (control sends) and the
receiver thread call MPI concurrently, so the library must provide ``MPI_THREAD_MULTIPLE``
(Open MPI 5 and MPICH 4 do; mpi4py asks for it by default). :func:`create` checks
``MPI.Query_thread()`` and raises ConfigError naming the fix otherwise.

Waiting: every wait polls (``MPI_Test`` / ``MPI_Improbe``) and sleeps between polls, spinning
first and backing off to at most 0.1 ms for data (MPI progresses a transfer only inside MPI calls)
and ``POLL_MAX_S`` for the idle control receiver. A blocking ``MPI_Wait`` / ``MPI_Probe`` would
busy-spin a core per thread inside Open MPI (bad for oversubscribed hosts), and cannot time out:
polling gives every wait the ``timeout_s`` deadline of the other transports (RingflowTimeoutError
naming the peer), so a frozen peer is reported instead of hanging the engine thread.

Native allreduce (:class:`~ringflow.transport.base.NativeAllreduce`):
:meth:`MpiTransport.native_allreduce` is ``MPI_Iallreduce`` (in place, on the whole fused
buffer, unscaled) for bool and the 8..64-bit integer and 32/64-bit float dtypes with SUM,
AVERAGE, MIN, MAX and PRODUCT; the executor prefers it for the global process set (process sets
use the ring over this transport's point-to-point messages) and scales the result afterwards on
each rank with the ring's own code (:class:`~ringflow.algorithms.reduction.Reduction`): an
identical function of identical bits keeps ranks identical. float16 / bfloat16 (which MPI has no
type for) use the ring, which keeps its overflow guard. MPI does not promise that
``MPI_Allreduce`` gives bitwise identical results on every rank;
``tests/mpi/test_mpi_transport.py`` checks that it does for Open MPI 5 at 2 and 3 ranks on the
suite's buffers.

Failures: a rank that *dies* (killed, ``os._exit``, a crash) is not reported by MPI to the other
ranks: Open MPI's runtime (``prterun``) notices that a process exited without ``MPI_Finalize`` or
with a non-zero status and terminates every other process of the job, so nothing hangs, but the
other ranks are killed rather than given a PeerError. A rank that is *frozen* (stopped, stuck) is
found by the engine's heartbeats over this control plane after ``timeout_s`` and fails the job on
every rank with one text; a rank that calls ``shutdown()`` says goodbye (ShutdownError elsewhere).

Cost per message: one ``MPI_Isend`` / ``MPI_Irecv`` and the polls of its ``wait()``; the native
allreduce costs what the MPI library's algorithm costs (Open MPI: ring or recursive doubling).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import (
    ConfigError,
    PeerError,
    ProtocolError,
    RingflowTimeoutError,
    ShutdownError,
)
from ..ops import ReduceOp
from ..polling import SLEEP_0, polls
from .base import MAX_CTRL_BYTES, NativeAllreduce, data_wait_s

__all__ = [
    "CTRL_TAG",
    "DATA_TAG",
    "MAX_CTRL_BYTES",
    "POLL_MAX_S",
    "MpiTransport",
    "available",
    "create",
    "unusable_reason",
]

log = logging.getLogger(__name__)

#: Tags on ringflow's private duplicate of the communicator: data and control never mix.
DATA_TAG, CTRL_TAG = 1, 2
#: Longest sleep between two polls. 0.5 ms keeps a control round trip (submit, plan) within the
#: engine's 1 ms cycle while an idle rank wakes 2000 times a second (~1% of a core).
POLL_MAX_S = 5e-4
#: Longest sleep between two polls of a pending send, receive or collective: MPI makes progress
#: only inside MPI calls, so a long sleep would stall the transfer itself.
_DATA_POLL_MAX_S = 1e-4
#: Polls before the first sleep: a chunk of the ring usually arrives within microseconds.
_SPINS = 200
#: How long data still in flight from a peer that said goodbye may take to land (MPI does not
#: order messages of different tags, so the goodbye can overtake the peer's last data).
_GRACE_S = 1.0
#: MPI datatypes and ops (mpi4py names) of the native allreduce; others take the ring.
_NATIVE_TYPES = {
    "bool": "C_BOOL", "int8": "INT8_T", "uint8": "UINT8_T", "int16": "INT16_T",
    "uint16": "UINT16_T", "int32": "INT32_T", "int64": "INT64_T", "float32": "FLOAT",
    "float64": "DOUBLE",
}
_NATIVE_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVERAGE: "SUM", ReduceOp.MIN: "MIN",
               ReduceOp.MAX: "MAX", ReduceOp.PRODUCT: "PROD"}
_BOOL_OPS = {ReduceOp.SUM: "LOR", ReduceOp.MAX: "LOR", ReduceOp.MIN: "LAND",
             ReduceOp.PRODUCT: "LAND"}
_INSTALL = "pip install 'ringflow[mpi]' (mpi4py and Open MPI)"


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(
            f"the mpi transport needs mpi4py, which cannot be imported ({exc}); {_INSTALL}, "
            "or set RINGFLOW_TRANSPORT=tcp"
        ) from exc
    return MPI


def _level_name(mpi: Any, level: int) -> str:
    names = {mpi.THREAD_SINGLE: "MPI_THREAD_SINGLE", mpi.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             mpi.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
             mpi.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    return names.get(level, str(level))


def unusable_reason() -> str:
    """Why the mpi transport cannot be used in this process ("" when it can).

    Imports ``mpi4py.MPI`` (which initializes MPI, as mpirun'd processes expect). Used by
    :func:`ringflow.transport.connect` to decide, alike on every rank, whether ``auto`` means MPI.
    """
    try:
        mpi = _mpi()
    except ConfigError as exc:
        return str(exc)
    if not mpi.Is_initialized() or mpi.Is_finalized():
        return ("MPI is not initialized (mpi4py.rc.initialize is False) or already finalized; "
                "call MPI.Init_thread(MPI.THREAD_MULTIPLE) before ringflow.init()")
    level = mpi.Query_thread()
    if level < mpi.THREAD_MULTIPLE:
        return (f"the MPI library was initialized with {_level_name(mpi, level)}, but the mpi "
                "transport calls MPI from several threads and needs MPI_THREAD_MULTIPLE; leave "
                "mpi4py.rc.thread_level at 'multiple' (its default) before importing mpi4py.MPI, "
                "use an MPI built with thread support, or set RINGFLOW_TRANSPORT=tcp")
    return ""


@functools.cache
def _library_version_subprocess() -> str | None:
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "import sys; sys.stdout.write(MPI.Get_library_version())")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("could not ask mpi4py for the MPI version: %s", exc)
        return None
    if proc.returncode != 0:
        log.debug("mpi4py.MPI does not import: %s", proc.stderr.strip()[-500:])
        return None
    return _first_line(proc.stdout) or None


def _first_line(text: str) -> str:
    # Open MPI's string ends with a NUL; MPICH's spans several lines.
    return text.replace("\0", "").strip().splitlines()[0].strip() if text.strip("\0 \n") else ""


def available() -> str | None:
    """The MPI library's version string (first line) if ringflow can use MPI here, else None.

    This is what ``mpi_built()`` of the adapters and ``ringflow-run --check-build`` report. It
    never initializes MPI in this process: if ``mpi4py.MPI`` is already imported it is asked
    directly; otherwise a child Python imports it with ``mpi4py.rc.initialize = False`` (once per
    process, ~0.2 s), because importing it here would initialize MPI as a side effect.
    """
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        return _first_line(str(module.Get_library_version())) or None
    try:
        if importlib.util.find_spec("mpi4py") is None:
            return None
    except (ImportError, ValueError):
        return None
    return _library_version_subprocess()


class _Work:
    """A pending MPI request; ``wait()`` polls it against the transport's deadline."""

    __slots__ = ("_done", "_nbytes", "_owner", "_peer", "_req", "_what")

    def __init__(self, owner: MpiTransport, req: Any, peer: int | None, nbytes: int | None,
                 what: str) -> None:
        self._owner = owner
        self._req = req
        self._peer = peer  # None: a collective (any rank may be the one missing)
        self._nbytes = nbytes  # posted size of a receive; None for a send or a collective
        self._what = what
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        owner, mpi = self._owner, self._owner.mpi
        status = mpi.Status()
        gone_since: float | None = None
        for now in polls(data_wait_s(owner.timeout), 1e-5, _DATA_POLL_MAX_S, spins=_SPINS,
                         spin_with=SLEEP_0):
            try:
                if self._req.Test(status):
                    break
            except mpi.Exception as exc:
                self._done = True
                raise ProtocolError(f"{self._what} failed in MPI: {exc}; the ranks disagree "
                                    "about the collective") from exc
            error = owner._gone_error(self._peer)
            if error is not None:
                gone_since = gone_since or now
                if now - gone_since > _GRACE_S:
                    self._abandon()
                    raise error
            if owner.closed:
                self._abandon()
                raise PeerError(f"{self._what}: the transport was closed")
            if owner.aborted is not None:
                self._abandon()
                raise owner.aborted
        else:
            self._abandon()
            who = "a peer's" if self._peer is None else f"rank {self._peer}'s"
            raise RingflowTimeoutError(
                f"{self._what}: {who} part of the collective did not arrive within "
                f"{owner.timeout} s; it may be frozen (RINGFLOW_TIMEOUT_S sets the limit)")
        self._done = True
        if self._nbytes is not None:
            got = status.Get_count(mpi.BYTE)
            if got != self._nbytes:
                raise ProtocolError(
                    f"rank {self._peer} sent {got} bytes where this rank expected "
                    f"{self._nbytes}; the ranks disagree about the collective")

    def _abandon(self) -> None:
        """Give up on the request: cancel a receive so that MPI never writes into the buffer."""
        self._done = True
        with contextlib.suppress(Exception):
            if self._nbytes is not None:
                self._req.Cancel()
            self._req.Free()


class MpiTransport(NativeAllreduce):
    """The ``mpi`` transport over a private duplicate of a communicator (see the module doc)."""

    def __init__(self, comm: Any, timeout: float) -> None:
        self.mpi = _mpi()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.closed = False
        self.aborted: BaseException | None = None
        self._gone: dict[int, BaseException] = {}  # peers that said goodbye
        self._lock = threading.Lock()
        self._ctrl_sends: list[tuple[Any, bytes]] = []
        self._ctrl_handler: Callable[[int, bytes], None] | None = None
        self._fail_handler: Callable[[int, BaseException], None] | None = None
        self._early: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._receiver: threading.Thread | None = None
        if self.size > 1:
            self._receiver = threading.Thread(target=self._recv_loop, daemon=True,
                                              name=f"ringflow-mpi-{self.rank}-ctrl")
            self._receiver.start()

    # data --------------------------------------------------------------------------------------
    def isend(self, buf: memoryview, dst: int) -> _Work:
        self._usable(dst)
        req = self.comm.Isend([buf, self.mpi.BYTE], dst, DATA_TAG)
        return _Work(self, req, dst, None, f"sending to rank {dst}")

    def irecv(self, buf: memoryview, src: int) -> _Work:
        self._usable(src, data_from=True)
        view = memoryview(buf).cast("B")
        req = self.comm.Irecv([view, self.mpi.BYTE], src, DATA_TAG)
        return _Work(self, req, src, view.nbytes, f"receiving from rank {src}")

    def native_supported(self, dtype: np.dtype, op: ReduceOp) -> bool:
        table = _BOOL_OPS if dtype == np.bool_ else _NATIVE_OPS
        return dtype.name in _NATIVE_TYPES and op in table

    def native_allreduce(self, flat: np.ndarray, op: ReduceOp) -> None:
        """``MPI_Iallreduce`` of the 1-D ``flat`` in place, unscaled (AVERAGE is summed); the
        caller scales (:class:`~ringflow.algorithms.reduction.Reduction`). Raises ProtocolError
        for an MPI error, RingflowTimeoutError past ``timeout_s``."""
        if self.size == 1 or flat.size == 0:
            return
        self._usable(None)
        table = _BOOL_OPS if flat.dtype == np.bool_ else _NATIVE_OPS
        mpi = self.mpi
        mtype = getattr(mpi, _NATIVE_TYPES[flat.dtype.name])
        req = self.comm.Iallreduce(mpi.IN_PLACE, [flat, mtype], getattr(mpi, table[ReduceOp(op)]))
        _Work(self, req, None, None, f"MPI allreduce of {flat.size} {flat.dtype}").wait()

    # control plane -----------------------------------------------------------------------------
    def send_ctrl(self, payload: bytes, dst: int) -> None:
        """Send a control message; it is delivered to ``dst``'s control handler."""
        self._usable(dst)
        if not 0 < len(payload) <= MAX_CTRL_BYTES:
            raise ProtocolError(f"a control message must have 1 to {MAX_CTRL_BYTES} bytes, not "
                                f"{len(payload)}")
        self._post_ctrl(payload, dst)

    def _post_ctrl(self, payload: bytes, dst: int) -> None:
        req = self.comm.Isend([payload, self.mpi.BYTE], dst, CTRL_TAG)
        with self._lock:
            # Keep each payload alive until MPI is done with it; reap the finished ones.
            self._ctrl_sends = [(r, p) for r, p in self._ctrl_sends if not r.Test()]
            self._ctrl_sends.append((req, payload))

    def set_ctrl_handler(
        self,
        on_ctrl: Callable[[int, bytes], None],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        """Route control messages (src, payload) and peer failures (rank, error) to callbacks.

        The callbacks run on the receiver thread and must not block. Messages that arrived
        before the handler was set are delivered now, in order.
        """
        with self._lock:
            self._ctrl_handler, self._fail_handler = on_ctrl, on_failure
            early, self._early = self._early, []
            gone = dict(self._gone)
        for src, payload in early:
            on_ctrl(src, payload)
        for rank, error in gone.items():
            on_failure(rank, error)

    def peer_host(self, rank: int) -> str:
        """Not known here ("": errors name the rank alone)."""
        return ""

    def check_peers(self, ranks: Iterable[int] | None = None) -> None:
        """Raise the error of the first of ``ranks`` (default: any peer) that has gone, if any
        (cheap; no I/O). A failure of MPI itself (rank -1) counts for every rank; after
        :meth:`abort`, the job's error."""
        if self.aborted is not None:
            raise self.aborted
        with self._lock:
            for rank, error in self._gone.items():
                if ranks is None or rank == -1 or rank in ranks:
                    raise error

    def abort(self, error: BaseException) -> None:
        """See :meth:`ControlChannel.abort`: pending waits fail with ``error`` at their next
        poll."""
        if self.aborted is None:
            self.aborted = error

    def _recv_loop(self) -> None:
        mpi = self.mpi
        status = mpi.Status()
        while True:
            try:
                # No deadline: _stop ends the wait. The backoff starts over after each message.
                for _ in polls(math.inf, 1e-5, POLL_MAX_S, spins=_SPINS, spin_with=SLEEP_0):
                    if self._stop.is_set():
                        return
                    message = self.comm.Improbe(mpi.ANY_SOURCE, CTRL_TAG, status)
                    if message is not None:
                        break
                src, size = status.Get_source(), status.Get_count(mpi.BYTE)
                payload = bytearray(size)
                message.Recv([payload, mpi.BYTE])
            except mpi.Exception as exc:
                if not self._stop.is_set():
                    log.error("rank %d: the MPI control receiver failed: %s", self.rank, exc)
                    self._peer_gone(-1, PeerError(f"MPI failed while receiving control "
                                                  f"messages: {exc}"))
                return
            if size == 0:
                self._peer_gone(src, ShutdownError(f"rank {src} has shut down"))
                continue
            with self._lock:
                handler = self._ctrl_handler
                if handler is None:
                    self._early.append((src, bytes(payload)))
                    continue
            handler(src, bytes(payload))

    def _peer_gone(self, rank: int, error: BaseException) -> None:
        with self._lock:
            if rank in self._gone:
                return
            self._gone[rank] = error
            handler = self._fail_handler
        if handler is not None and not self.closed:
            handler(rank, error)

    def _gone_error(self, peer: int | None) -> BaseException | None:
        with self._lock:
            if peer is None:
                return next(iter(self._gone.values()), None)
            return self._gone.get(peer) or self._gone.get(-1)

    def _usable(self, peer: int | None, data_from: bool = False) -> None:
        if self.closed:
            raise PeerError("the mpi transport is closed")
        if peer is not None and not (0 <= peer < self.size and peer != self.rank):
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} (size {self.size})")
        if not data_from:  # a receive may still match data sent before the goodbye
            error = self._gone_error(peer)
            if error is not None:
                raise error

    def close(self, linger: float = 2.0) -> None:
        """Say goodbye to every peer, wait up to ``linger`` s for theirs, then stop the receiver.

        Waiting for the goodbyes means every control message a peer sent has been received
        (MPI keeps one pair's messages of one tag in order), so none is left unmatched when MPI
        is finalized. The communicator is not freed: ``MPI_Comm_free`` is collective.
        """
        if self.closed:
            return
        deadline = time.monotonic() + linger
        if self._receiver is not None:
            for dst in range(self.size):
                if dst != self.rank and dst not in self._gone:
                    with contextlib.suppress(self.mpi.Exception):
                        self._post_ctrl(b"", dst)
            while time.monotonic() < deadline and len(self._gone) < self.size - 1:
                time.sleep(POLL_MAX_S)
            self._stop.set()
            self._receiver.join(max(0.1, deadline - time.monotonic()))
        self.closed = True
        with self._lock:
            sends, self._ctrl_sends = self._ctrl_sends, []
        for req, _ in sends:
            # A send the peer never matched (it died or left early) must not keep finalize
            # waiting: give it until the deadline, then free it.
            while time.monotonic() < deadline and not req.Test():
                time.sleep(POLL_MAX_S)
            with contextlib.suppress(Exception):
                if req != self.mpi.REQUEST_NULL:
                    req.Free()


def create(rank: int, size: int, store: object = None, config: object = None, prefix: str = "",
           comm: Any = None, **_: object) -> MpiTransport:
    """The mpi transport of rank ``rank`` of ``size`` over ``comm`` (default ``COMM_WORLD``).

    Collective over ``comm`` (it is duplicated). ``store`` and ``prefix`` are not used: MPI
    already connects the ranks.

    Raises:
        ConfigError: mpi4py is missing, MPI is not initialized or lacks MPI_THREAD_MULTIPLE,
            ``comm`` is an intercommunicator, or its rank/size differ from ``rank``/``size``.
    """
    mpi = _mpi()
    why = unusable_reason()
    if why:
        raise ConfigError(f"RINGFLOW_TRANSPORT=mpi cannot be used: {why}")
    comm = mpi.COMM_WORLD if comm is None else comm
    if not isinstance(comm, mpi.Comm) or comm.Is_inter():
        raise ConfigError(f"init(comm=...) needs an mpi4py intracommunicator (e.g. "
                          f"MPI.COMM_WORLD.Split(...)), got {type(comm).__name__}")
    if (comm.Get_rank(), comm.Get_size()) != (rank, size):
        raise ConfigError(
            f"the MPI communicator has rank {comm.Get_rank()} of {comm.Get_size()}, but the "
            f"launcher environment says rank {rank} of {size}; unset stale launcher variables "
            "or pass the communicator to init(comm=...)")
    timeout = float(getattr(config, "timeout_s", 30.0))
    private = comm.Dup()
    private.Set_errhandler(mpi.ERRORS_RETURN)
    return MpiTransport(private, timeout)
