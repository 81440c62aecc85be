"""The stand-in's ``cupy.cuda.nccl``: NCCL between processes through files, with the argument
types of cupy's Cython binding (see ../../README.md).

API generations (``CUPY_STANDIN_VERSION``): cupy 13's ``get_unique_id()`` returns a tuple of 128
signed chars and ``NcclCommunicator(ndev, commId: tuple, rank)`` takes one; cupy 14's returns
and takes 128 ``bytes``. Each refuses the other's with the TypeError Cython raises. Pointers
(``intptr_t``) and counts (``size_t``) must be Python integers (anything with ``__index__``), as
Cython demands; a negative count overflows.

Semantics: a communicator's ranks meet in a folder named by the unique id. Every collective is
numbered; each rank writes its contribution to ``c<seq>.<rank>``, waits for those it needs, and
computes its own result (reductions in rank order). Point to point goes through ``p<src>-<dst>-<k>``
files; inside ``groupStart()``/``groupEnd()`` sends and receives are deferred to
``groupEnd`` (sends first), outside a group a send waits until its receiver has taken it, as
NCCL's rendezvous does, so a program that posts sends and receives unpaired deadlocks here too.
Work runs in call order on a thread of the communicator, not in the call: the call returns at
once, and an event recorded on the call's stream afterwards is done when the work is (as on a
GPU, where the host only enqueues). A peer that does not arrive within ``CUPY_STANDIN_NCCL_TIMEOUT``
seconds (default 60), or ``abort()`` from another thread, ends the wait and leaves an error
that ``check_async_error()`` raises (the result is then garbage, as after a real NCCL error).
Two ranks on one device are refused at init with NCCL's "invalid usage".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .. import __version__

available = True
_VERSION = 22809  # NCCL 2.28.9
_API = int(__version__.split(".")[0])

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
           6: np.float16, 7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16}
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}
_ERRORS = {1: "unhandled cuda error", 2: "unhandled system error", 3: "internal error",
           4: "invalid argument", 5: "invalid usage", 6: "remote process exited or there was a "
           "network error"}
_group = threading.local()


class NcclError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"NCCL_ERROR_{_ERRORS.get(status, 'unknown').upper().replace(' ', '_')}"
                         f": {_ERRORS.get(status, 'unknown')}")


def get_version() -> int:
    return _VERSION


def get_build_version() -> int:
    return _VERSION


def _int(value: Any, name: str, unsigned: bool = False) -> int:
    """Cython's conversion of an argument typed int / intptr_t / size_t."""
    if isinstance(value, float) or not hasattr(value, "__index__"):
        raise TypeError(f"an integer is required (argument '{name}', got "
                        f"{type(value).__name__})")
    value = value.__index__()
    if unsigned and value < 0:
        raise OverflowError(f"can't convert negative value to size_t ('{name}')")
    return value


def _dtype(code: Any) -> np.dtype:
    code = _int(code, "datatype")
    if code not in _DTYPES:
        raise NcclError(4)
    return np.dtype(_DTYPES[code])


def get_unique_id() -> Any:
    raw = secrets.token_bytes(128)
    if _API >= 14:
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)  # <char>, signed on x86


def _root() -> Path:
    return Path(os.environ.get("CUPY_STANDIN_NCCL_DIR", tempfile.gettempdir()))


def groupStart() -> None:
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.ops = []


def groupEnd() -> None:
    depth = getattr(_group, "depth", 0)
    if depth == 0:
        raise NcclError(5)
    _group.depth = depth - 1
    if depth == 1:
        ops, _group.ops = _group.ops, []
        if not ops:
            return

        def run() -> None:
            for comm, kind, args, _ in sorted(ops, key=lambda o: o[1] != "send"):
                comm._p2p(kind, *args, wait_taken=False)

        ops[0][0]._submit(run, ops[0][3])


class NcclCommunicator:
    def __init__(self, ndev: int, commId: Any, rank: int) -> None:
        ndev, rank = _int(ndev, "ndev"), _int(rank, "rank")
        want = bytes if _API >= 14 else tuple
        if not isinstance(commId, want):
            raise TypeError(f"Argument 'commId' has incorrect type (expected {want.__name__}, "
                            f"got {type(commId).__name__})")
        if len(commId) != 128:
            raise ValueError(f"commId must have 128 entries, got {len(commId)}")
        raw = commId if isinstance(commId, bytes) else bytes(b & 0xFF for b in commId)
        if not 0 <= rank < ndev:
            raise NcclError(4)
        from . import Device, uuid_of

        self._rank, self._size = rank, ndev
        self._device = Device().id
        self._dir = _root() / f"cupy-standin-nccl-{raw[:12].hex()}"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._timeout = float(os.environ.get("CUPY_STANDIN_NCCL_TIMEOUT", "60"))
        self._seq = 0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._error: NcclError | None = None
        self._aborted = False
        self._destroyed = False
        self._work: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name="nccl-standin").start()
        self._write(f"member.{rank}", uuid_of(self._device))
        members = [self._read(f"member.{r}", keep=True) for r in range(ndev)]
        if self._error is not None:
            raise self._error
        if len(set(members)) != len(members):
            raise NcclError(5)  # "Duplicate GPU detected": NCCL refuses two ranks on one device

    # plumbing -------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            run, flag = job
            try:
                run()
            except Exception:  # a bug of the stand-in's own: fail the communicator, visibly
                self._error = self._error or NcclError(3)
                raise
            finally:
                flag.set()

    def _submit(self, run: Any, stream: int) -> None:
        from . import queue_on

        self._work.put((run, queue_on(stream)))

    def _write(self, name: str, data: bytes) -> None:
        tmp = self._dir / f".{name}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_bytes(data)
        tmp.rename(self._dir / name)

    def _read(self, name: str, keep: bool = False) -> bytes:
        """The file ``name`` once a peer wrote it; b"" (and the error set) if it never came."""
        path = self._dir / name
        deadline = time.monotonic() + self._timeout
        pause = 1e-5
        while not path.exists():
            if self._aborted or time.monotonic() > deadline:
                self._error = self._error or NcclError(6)
                return b""
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        data = path.read_bytes()
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return data

    def _live(self) -> None:
        """A call on a destroyed communicator is invalid usage (a freed one, in cupy)."""
        if self._destroyed:
            raise NcclError(5)

    @staticmethod
    def _get(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
        return np.frombuffer(ctypes.string_at(ptr, count * dtype.itemsize), dtype).copy()

    @staticmethod
    def _put(ptr: int, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values).tobytes()
        ctypes.memmove(ptr, data, len(data))

    def _exchange(self, mine: np.ndarray, need: range | list[int]) -> dict[int, np.ndarray]:
        """Every rank's contribution to this collective that ``need`` names ({} after an
        error: the work is then skipped, as a GPU's would never finish)."""
        if self._error is not None or self._aborted:
            return {}
        seq = self._seq
        self._seq += 1
        self._write(f"c{seq}.{self._rank}", mine.tobytes())
        got = {}
        for r in need:
            data = self._read(f"c{seq}.{r}", keep=True)
            if self._error is not None:
                return {}
            got[r] = np.frombuffer(data, mine.dtype).copy()
        return got

    def _reduce(self, parts: dict[int, np.ndarray], op: int) -> np.ndarray:
        op = _int(op, "op")
        if op == NCCL_AVG:
            total = self._reduce(parts, NCCL_SUM)
            return (total / self._size).astype(total.dtype)
        if op not in _OPS:
            raise NcclError(4)
        acc = parts[0].copy()
        for r in range(1, self._size):
            _OPS[op](acc, parts[r], out=acc)
        return acc

    # cupy's methods ---------------------------------------------------------------------------
    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def check_async_error(self) -> None:
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        self._aborted = True
        self._error = self._error or NcclError(6)

    def destroy(self) -> None:
        """Leave; the last rank out removes the folder (a collective's files are kept until
        then: a root may be done, and gone, while a rank still has to read its file)."""
        if self._destroyed:
            return
        self._destroyed = True
        self._work.put(None)
        self._write(f"closed.{self._rank}", b"")
        try:  # two ranks closing at once may both count them all: the other may have removed it
            closed = len(list(self._dir.glob("closed.*")))
        except FileNotFoundError:
            return
        if closed == self._size:
            shutil.rmtree(self._dir, ignore_errors=True)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        send, recv = _int(sendbuf, "sendbuf"), _int(recvbuf, "recvbuf")
        count, dtype, op = _int(count, "count", True), _dtype(datatype), _int(op, "op")
        self._live()

        def run() -> None:
            parts = self._exchange(self._get(send, count, dtype), range(self._size))
            if parts:
                self._put(recv, self._reduce(parts, op))

        self._submit(run, _int(stream, "stream"))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        send, recv = _int(sendbuf, "sendbuf"), _int(recvbuf, "recvbuf")
        count, dtype, op = _int(count, "count", True), _dtype(datatype), _int(op, "op")
        root = _int(root, "root")
        self._live()

        def run() -> None:
            parts = self._exchange(self._get(send, count, dtype),
                                   range(self._size) if self._rank == root else [])
            if parts:
                self._put(recv, self._reduce(parts, op))

        self._submit(run, _int(stream, "stream"))

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        send, recv = _int(sendbuff, "sendbuff"), _int(recvbuff, "recvbuff")
        count, dtype, root = _int(count, "count"), _dtype(datatype), _int(root, "root")
        self._live()

        def run() -> None:
            mine = self._get(send, count, dtype) if self._rank == root else np.empty(0, dtype)
            parts = self._exchange(mine, [root])
            if parts:
                self._put(recv, parts[root])

        self._submit(run, _int(stream, "stream"))

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        send, recv = _int(sendbuf, "sendbuf"), _int(recvbuf, "recvbuf")
        count, dtype = _int(count, "count", True), _dtype(datatype)
        self._live()

        def run() -> None:
            parts = self._exchange(self._get(send, count, dtype), range(self._size))
            if parts:
                self._put(recv, np.concatenate([parts[r] for r in range(self._size)]))

        self._submit(run, _int(stream, "stream"))

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,
                      op: int, stream: int) -> None:
        send, recv = _int(sendbuf, "sendbuf"), _int(recvbuf, "recvbuf")
        count, dtype, op = _int(recvcount, "recvcount", True), _dtype(datatype), _int(op, "op")
        self._live()

        def run() -> None:
            parts = self._exchange(self._get(send, count * self._size, dtype),
                                   range(self._size))
            if parts:
                total = self._reduce(parts, op)
                self._put(recv, total[self._rank * count:(self._rank + 1) * count])

        self._submit(run, _int(stream, "stream"))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        args = (_int(sendbuf, "sendbuf"), _int(count, "count", True), _dtype(datatype),
                _int(peer, "peer"))
        self._post("send", args, _int(stream, "stream"))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        args = (_int(recvbuf, "recvbuf"), _int(count, "count", True), _dtype(datatype),
                _int(peer, "peer"))
        self._post("recv", args, _int(stream, "stream"))

    def _post(self, kind: str, args: tuple, stream: int) -> None:
        self._live()
        if getattr(_group, "depth", 0):
            _group.ops.append((self, kind, args, stream))
        else:
            self._submit(lambda: self._p2p(kind, *args, wait_taken=True), stream)

    def _p2p(self, kind: str, ptr: int, count: int, dtype: np.dtype, peer: int,
             wait_taken: bool) -> None:
        if self._error is not None or self._aborted:
            return
        if not 0 <= peer < self._size:
            self._error = NcclError(4)
            return
        if kind == "send":
            k = self._sent[peer] = self._sent.get(peer, -1) + 1
            name = f"p{self._rank}-{peer}-{k}"
            self._write(name, self._get(ptr, count, dtype).tobytes())
            deadline = time.monotonic() + self._timeout
            while wait_taken and (self._dir / name).exists():
                if self._aborted or time.monotonic() > deadline:
                    self._error = self._error or NcclError(6)
                    return
                time.sleep(1e-4)
        else:
            k = self._received[peer] = self._received.get(peer, -1) + 1
            data = self._read(f"p{peer}-{self._rank}-{k}")
            if self._error is None:
                if len(data) != count * dtype.itemsize:
                    self._error = NcclError(3)  # a message of another size: NCCL's "internal"
                    return
                self._put(ptr, np.frombuffer(data, dtype))
