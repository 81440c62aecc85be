"""NCCL's primitives on GPU buffers, through the NCCL the user already has.

Two providers give the same :class:`DeviceComm`, one communicator per (process set, device):

* :class:`CupyNccl` -- cupy's binding ``cupy.cuda.nccl`` (``pip install 'ringflow[gpu]'``).
  Rank 0 draws the unique id and publishes it in the job's authenticated store (hex text);
  cupy 13 and earlier take it as a tuple of 128 signed chars, cupy 14 as 128 bytes
  (:func:`decode_unique_id` gives each its own; cupy 14 refuses the tuple with a TypeError).
  Buffers are passed by pointer (``intptr_t``), so a torch CUDA tensor needs no cupy view.
* :class:`ringflow.algorithms.nccl_torch.TorchNccl` -- torch's ``ProcessGroupNCCL``, built on the
  same store, for a torch user without cupy (torch's CUDA wheels ship NCCL).

Primitives only, in place or from one buffer to another of the same dtype, with NCCL's rules
(equal counts on every rank); :mod:`ringflow.algorithms.device` composes them into ringflow's
collectives (ragged rows, scale factors, roots). Ops: Sum, Min, Max, Product; Average is a Sum
the caller scales. bool travels as uint8 (Sum/Max = or, Min/Product = and). NCCL has no 16-bit
integers: :meth:`DeviceComm.takes` refuses them and the executor stages such tensors through
host memory.

Streams and completion (cupy): every call runs on the communicator's own non-blocking stream,
after that stream waits for an event recorded on the caller's current stream (the engine
thread's, where the fusion buffer was just packed). :meth:`DeviceComm.wait` polls an event
recorded after the calls, never blocking in CUDA, and between polls asks NCCL for an
asynchronous error and ``check()`` (the engine's: a failed peer or a data plane aborted by
another thread) for the job's; on any of them, or after ``timeout`` s, the communicator is
aborted (``ncclCommAbort``), so nothing waits on a GPU that will never finish.

Checked on CPU by the stand-in in ``tests/standins/cupy`` (both unique-id generations, the
argument types of cupy's Cython binding, NCCL's refusal of two ranks on one device), and on a GPU
by ``tests/gpu`` and ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError, PeerError, RingflowTimeoutError, TensorError
from ..ops import ReduceOp
from ..polling import SLEEP_0, polls

__all__ = [
    "NCCL_DTYPES",
    "NCCL_OPS",
    "CupyNccl",
    "DeviceComm",
    "available",
    "decode_unique_id",
    "encode_unique_id",
    "unusable_reason",
]

log = logging.getLogger(__name__)

_INSTALL = "pip install 'ringflow[gpu]' (cupy-cuda12x, which brings NCCL)"

#: ncclDataType_t values of nccl.h (stable ABI); bfloat16 needs NCCL >= 2.10. bool travels as
#: uint8. No 16-bit integers in NCCL.
NCCL_DTYPES = {
    "bool": 1, "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
#: ncclRedOp_t values of nccl.h: sum 0, prod 1, max 2, min 3. AVERAGE is a SUM, then a scale.
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.AVERAGE: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2,
            ReduceOp.MIN: 3}
_BOOL_OPS = {ReduceOp.SUM: 2, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.PRODUCT: 3}


class DeviceComm(Protocol):
    """An NCCL communicator of a process set's ranks (``rank`` of ``size``) on one device.

    Buffers are flat, contiguous arrays of one library (cupy arrays or torch tensors) on this
    communicator's device. Every call only enqueues; :meth:`wait` returns once everything
    enqueued has finished, or raises.
    """

    provider: str
    rank: int
    size: int

    def takes(self, dtype: np.dtype, op: ReduceOp | None = None) -> bool:
        """Whether NCCL moves (and, with ``op``, reduces) this dtype."""

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        """``buf`` = the reduction of every rank's ``buf`` (Average: the Sum, unscaled)."""

    def broadcast(self, buf: Any, root: int) -> None: ...

    def allgather(self, send: Any, recv: Any) -> None:
        """``recv`` = every rank's ``send`` (all the same size), in rank order."""

    def reducescatter(self, send: Any, recv: Any, op: ReduceOp) -> None:
        """``recv`` = block ``rank`` of the reduction of every rank's ``send`` (``size`` equal
        blocks of ``recv``'s size)."""

    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]]
                 ) -> None:
        """Send each ``(peer, buf)`` of ``sends`` and receive each of ``recvs``, as one group
        (the order of calls between two ranks pairs them)."""

    def wait(self, what: str) -> None:
        """Return once the enqueued work is done.

        Raises:
            PeerError: NCCL reported an error, or ``check()`` did (the communicator is aborted).
            RingflowTimeoutError: not done within the timeout (the communicator is aborted).
        """

    def close(self) -> None: ...


def _cupy() -> tuple[Any, Any]:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ConfigError(f"GPU collectives need cupy with NCCL ({exc}); {_INSTALL}") from exc
    if not getattr(nccl, "available", True):
        raise ConfigError(f"this cupy was built without NCCL; {_INSTALL}")
    return cupy, nccl


def available() -> str | None:
    """``"NCCL x.y.z"`` when cupy and its NCCL load here, else None (never initializes CUDA)."""
    try:
        if importlib.util.find_spec("cupy") is None:
            return None
        from cupy.cuda import nccl

        code = int(nccl.get_version())
    except Exception as exc:  # any failure to load means "not available", with the reason logged
        log.debug("NCCL is not available: %s", exc)
        return None
    return f"NCCL {version_text(code)}"


def version_text(code: int) -> str:
    """NCCL's version code as x.y.z (``X*10000 + Y*100 + Z`` since 2.9, ``X*1000 + ...``
    before)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def unusable_reason() -> str:
    """Why cupy's NCCL cannot run in this process ("" if it can): it loads and a CUDA device
    is present. Imports nothing when cupy is not installed."""
    version = available()
    if version is None:
        return f"cupy with NCCL does not load here ({_INSTALL})"
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver or no device: any CUDA failure means "not usable"
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return "" if count else "no CUDA device"


def encode_unique_id(uid: bytes | Sequence[int]) -> bytes:
    """An NCCL unique id as hex text for the store: cupy 14's bytes or cupy 13's tuple of 128
    signed chars alike."""
    raw = uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)
    if len(raw) != 128:
        raise ValueError(f"an NCCL unique id has 128 bytes, got {len(raw)}")
    return raw.hex().encode()


def decode_unique_id(text: bytes, api: int) -> bytes | tuple[int, ...]:
    """Inverse of :func:`encode_unique_id`, in the form cupy ``api`` (its major version) takes:
    bytes from cupy 14 on, a tuple of signed chars before."""
    raw = bytes.fromhex(text.decode())
    if len(raw) != 128:
        raise ValueError(f"an NCCL unique id has 128 bytes, got {len(raw)}")
    if api >= 14:
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)


def dtype_name(buf: Any) -> str:
    """The dtype of a cupy array or torch tensor, by its numpy-style name."""
    return str(buf.dtype).removeprefix("torch.")


def _ptr_count(buf: Any) -> tuple[int, int]:
    """(device address, elements) of a contiguous cupy array or torch tensor."""
    if hasattr(buf, "data_ptr"):  # torch
        return int(buf.data_ptr()), int(buf.numel())
    return int(buf.data.ptr), int(buf.size)


def check_op(dtype: str, op: ReduceOp) -> int:
    """NCCL's op code for ``op`` on ``dtype`` (bool: or / and)."""
    table = _BOOL_OPS if dtype == "bool" else NCCL_OPS
    if op not in table:
        raise TensorError(f"reduce op {ReduceOp(op).name} is not supported on the GPU")
    return table[op]


def takes(dtype: np.dtype, op: ReduceOp | None = None) -> bool:
    """Whether NCCL moves ``dtype`` and reduces it with ``op`` (None: moves it)."""
    name = np.dtype(dtype).name
    if name not in NCCL_DTYPES:
        return False
    return op is None or op in (_BOOL_OPS if name == "bool" else NCCL_OPS)


class CupyNccl:
    """:class:`DeviceComm` through cupy's binding (see the module doc)."""

    provider = "cupy"

    def __init__(self, rank: int, size: int, store: Any, prefix: str, device: int,
                 timeout: float, check: Callable[[], None] = lambda: None) -> None:
        cp, nccl = _cupy()
        self.cp, self.nccl = cp, nccl
        self.rank, self.size, self.device, self.timeout = rank, size, device, timeout
        self._check = check
        key = f"{prefix}id"
        if rank == 0:
            store.set(key, encode_unique_id(nccl.get_unique_id()))
        uid = decode_unique_id(store.get(key, timeout), int(cp.__version__.split(".")[0]))
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.comm = nccl.NcclCommunicator(size, uid, rank)
        self._done = None
        self._held: list[Any] = []
        self._aborted = False

    takes = staticmethod(takes)

    # plumbing ---------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, what: str) -> BaseException:
        """Abort; the error to raise: the job's own (a failed peer, an aborted data plane) as
        it is, so that every rank reports one text, or NCCL's, naming the operation."""
        self.abort()
        if isinstance(exc, self.nccl.NcclError):
            return PeerError(f"{what} failed in NCCL on rank {self.rank}: {exc}")
        return exc

    def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            self.comm.abort()

    def close(self) -> None:
        if not self._aborted:
            self._aborted = True
            self.comm.destroy()

    def _enqueue(self, call: Callable[[int], None], *buffers: Any) -> None:
        """``call(stream pointer)`` on our stream, after the caller's current stream. The
        ``buffers`` are kept until :meth:`wait`: NCCL reads and writes them after the call
        returns, and a buffer freed meanwhile would be reused by cupy's or torch's pool."""
        if self._aborted:
            raise PeerError("the NCCL communicator was aborted after an earlier error")
        cp = self.cp
        with cp.cuda.Device(self.device):
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
            self.stream.wait_event(ready)
            call(self.stream.ptr)
            self._held.extend(buffers)
            self._done = cp.cuda.Event(disable_timing=True, block=False)
            self._done.record(self.stream)

    def wait(self, what: str) -> None:
        done, self._done = self._done, None
        if done is None:
            return
        try:
            self._poll(done, what)
        finally:
            self._held.clear()

    def _poll(self, done: Any, what: str) -> None:
        for _ in polls(self.timeout, 2e-5, 5e-4, spin=5e-5, spin_with=SLEEP_0):  # as devices.poll
            try:
                self.comm.check_async_error()
                self._check()
            except Exception as exc:  # NCCL's error or the job's: abort, then raise
                error = self._fail(exc, what)
                if error is exc:
                    raise
                raise error from exc
            if done.done:
                return
        self.abort()
        raise RingflowTimeoutError(
            f"{what} on the GPU did not finish within {self.timeout} s; a peer may be "
            "frozen or gone (RINGFLOW_TIMEOUT_S sets the limit)")

    # primitives -------------------------------------------------------------------------------
    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        name = dtype_name(buf)
        code, ptr, n = NCCL_DTYPES[name], *_ptr_count(buf)
        nop = check_op(name, op)
        self._enqueue(lambda s: self.comm.allReduce(ptr, ptr, n, code, nop, s), buf)

    def broadcast(self, buf: Any, root: int) -> None:
        code, ptr, n = NCCL_DTYPES[dtype_name(buf)], *_ptr_count(buf)
        self._enqueue(lambda s: self.comm.broadcast(ptr, ptr, n, code, root, s), buf)

    def allgather(self, send: Any, recv: Any) -> None:
        code, src, n = NCCL_DTYPES[dtype_name(send)], *_ptr_count(send)
        dst, _ = _ptr_count(recv)
        self._enqueue(lambda s: self.comm.allGather(src, dst, n, code, s), send, recv)

    def reducescatter(self, send: Any, recv: Any, op: ReduceOp) -> None:
        name = dtype_name(send)
        code, src, _ = NCCL_DTYPES[name], *_ptr_count(send)
        dst, n = _ptr_count(recv)
        nop = check_op(name, op)
        self._enqueue(lambda s: self.comm.reduceScatter(src, dst, n, code, nop, s), send, recv)

    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]]
                 ) -> None:
        calls = [(self.comm.send, peer, NCCL_DTYPES[dtype_name(b)], *_ptr_count(b))
                 for peer, b in sends]
        calls += [(self.comm.recv, peer, NCCL_DTYPES[dtype_name(b)], *_ptr_count(b))
                  for peer, b in recvs]

        def group(stream: int) -> None:
            self.nccl.groupStart()
            try:
                for call, peer, code, ptr, n in calls:
                    if n:
                        call(ptr, n, code, peer, stream)
            finally:
                self.nccl.groupEnd()

        self._enqueue(group, *(b for _, b in sends), *(b for _, b in recvs))

