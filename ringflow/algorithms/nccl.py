"""NCCL through cupy: collectives on GPU arrays, without a trip through host memory.

**Status: UNVERIFIED.** Written on a machine without a GPU; nothing here has run on one. The pure
functions (dtype/op tables, unique-id encoding, row splits) are tested on CPU; everything that
touches CUDA is covered by ``tests/gpu/``, which skips without cupy and a device. The engine uses
:meth:`NcclComm.allreduce` through :class:`ringflow.backends.Nccl` (the ``cuda`` allreduce
implementation); the other collectives here are not wired in (the executor stages them through
host memory).

Setup: :class:`NcclComm` is one NCCL communicator per (process set, device). Rank 0 draws the
unique id (``ncclGetUniqueId``) and publishes it in the rendezvous store under
``{prefix}nccl/id`` (hex text); every rank reads it and calls ``ncclCommInitRank`` on its device.

Streams and completion: every operation runs on the communicator's own non-blocking stream, after
that stream waits (``cudaStreamWaitEvent``) for an event recorded on the caller's current stream,
so inputs written by the framework are complete. Each operation records a CUDA event and returns
a :class:`GpuWork`: ``poll()`` asks the event (never blocks), ``wait()`` polls it against
``timeout_s`` and checks ``ncclCommGetAsyncError``; on a timeout or an asynchronous NCCL error
the communicator is aborted (``ncclCommAbort``) and a ringflow error is raised, so the engine
thread never blocks on the GPU. ``GpuWork.stream_wait(stream)`` makes a framework stream wait for
the result instead of the host.

Semantics follow :mod:`ringflow.algorithms.ring`: AVERAGE is SUM then one multiplication by
``postscale / n``; integers are scaled in float64, truncated toward zero and wrapped
(:func:`ringflow.ops.wrap_integers`, the rule of every path); bool reduces as uint8
(SUM/MAX = or, MIN/PRODUCT = and). NCCL has no 16-bit integers: int16/uint16 raise TensorError
(stage them through host memory with :func:`stage_to_host`). NCCL gives every rank the same bits
for the same reduction (a ring or tree result is broadcast), but may pick a different algorithm
for a different size, so results are not comparable across buffer sizes bit for bit.

Fusion and compression on the device: :func:`pack` casts each array to the wire dtype (the cast
to float16/bfloat16 *is* the compression) into one device buffer; :func:`unpack` casts back.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, PeerError, RingflowTimeoutError, TensorError
from ..ops import ReduceOp, wrap_integers

__all__ = [
    "NCCL_DTYPES",
    "NCCL_OPS",
    "GpuWork",
    "NcclComm",
    "available",
    "decode_unique_id",
    "encode_unique_id",
    "pack",
    "row_splits",
    "stage_to_host",
    "unpack",
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


def _cupy() -> Any:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ConfigError(f"GPU collectives need cupy with NCCL ({exc}); {_INSTALL}") from exc
    if not getattr(nccl, "available", True):
        raise ConfigError(f"this cupy was built without NCCL; {_INSTALL}")
    return cupy


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
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"NCCL {major}.{minor}.{patch}"


def unusable_reason() -> str:
    """Why NCCL cannot run in this process ("" if it can): cupy's NCCL loads and a CUDA device
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


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """cupy's unique id (128 signed chars) as hex text for the store."""
    if len(uid) != 128:
        raise ValueError(f"an NCCL unique id has 128 bytes, got {len(uid)}")
    return bytes(b & 0xFF for b in uid).hex().encode()


def decode_unique_id(text: bytes) -> tuple[int, ...]:
    """Inverse of :func:`encode_unique_id`: the tuple of signed chars cupy expects."""
    raw = bytes.fromhex(text.decode())
    if len(raw) != 128:
        raise ValueError(f"an NCCL unique id has 128 bytes, got {len(raw)}")
    return tuple(b - 256 if b > 127 else b for b in raw)


def row_splits(rows: int, size: int) -> list[tuple[int, int]]:
    """ringflow's split of ``rows`` over ``size`` ranks (lower ranks take the remainder)."""
    from .buffers import even_split

    return even_split(rows, size)


def pack(arrays: Sequence[Any], wire: Any, out: Any = None) -> Any:
    """Cast and concatenate ``arrays`` (cupy) into one flat device buffer of dtype ``wire``."""
    cp = _cupy()
    total = sum(int(a.size) for a in arrays)
    buf = cp.empty(total, wire) if out is None else out[:total]
    offset = 0
    for a in arrays:
        n = int(a.size)
        buf[offset:offset + n] = a.reshape(-1).astype(wire, copy=False)
        offset += n
    return buf


def unpack(buf: Any, like: Sequence[Any]) -> list[Any]:
    """Split ``buf`` back into arrays shaped and typed like ``like`` (casting decompresses)."""
    out = []
    offset = 0
    for a in like:
        n = int(a.size)
        out.append(buf[offset:offset + n].astype(a.dtype).reshape(a.shape))
        offset += n
    return out


_staging_logged = False


def stage_to_host(array: Any, why: str) -> Any:
    """Copy a GPU array into pinned host memory (numpy), logging once why NCCL is not used."""
    global _staging_logged
    cp = _cupy()
    import numpy as np

    if not _staging_logged:
        log.warning("ringflow: GPU tensors are staged through pinned host memory (%s)", why)
        _staging_logged = True
    mem = cp.cuda.alloc_pinned_memory(max(int(array.nbytes), 1))
    host = np.frombuffer(mem, array.dtype, int(array.size)).reshape(array.shape)
    array.get(out=host)
    return host


class GpuWork:
    """A GPU operation in flight; completion is a CUDA event (see the module doc)."""

    def __init__(self, owner: NcclComm, event: Any, result: Any, what: str) -> None:
        self._owner = owner
        self.event = event
        self.result = result
        self._what = what

    def poll(self) -> bool:
        """True once the GPU has finished; never blocks."""
        return bool(self.event.done)

    def stream_wait(self, stream: Any) -> None:
        """Make ``stream`` (a framework's) wait for the result on the GPU, not on the host."""
        stream.wait_event(self.event)

    def wait(self) -> Any:
        """Block the calling thread (polling) until done; return the result.

        Raises:
            RingflowTimeoutError: not done within ``timeout_s`` (the communicator is aborted).
            PeerError: NCCL reported an asynchronous error (the communicator is aborted).
        """
        deadline = time.monotonic() + self._owner.timeout
        pause = 1e-5
        while not self.event.done:
            self._owner.check()
            if time.monotonic() > deadline:
                self._owner.abort()
                raise RingflowTimeoutError(
                    f"{self._what} on the GPU did not finish within {self._owner.timeout} s; a "
                    "peer may be frozen or gone (RINGFLOW_TIMEOUT_S sets the limit)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        self._owner.check()
        return self.result


class NcclComm:
    """One NCCL communicator for the ranks of a process set on this process's GPU ``device``."""

    def __init__(self, rank: int, size: int, store: Any, prefix: str = "", device: int = 0,
                 timeout: float = 30.0) -> None:
        cp = _cupy()
        from cupy.cuda import nccl

        self.cp, self.nccl = cp, nccl
        self.rank, self.size, self.device, self.timeout = rank, size, device, timeout
        key = f"{prefix}nccl/id"
        if rank == 0:
            store.set(key, encode_unique_id(nccl.get_unique_id()))
        uid = decode_unique_id(store.get(key, timeout))
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.comm = nccl.NcclCommunicator(size, uid, rank)
        self._aborted = False

    # plumbing ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise PeerError (after aborting) if NCCL reported an asynchronous error."""
        if self._aborted:
            raise PeerError("the NCCL communicator was aborted after an earlier error")
        try:
            self.comm.check_async_error()
        except self.nccl.NcclError as exc:
            self.abort()
            raise PeerError(f"NCCL failed on rank {self.rank}: {exc}") from exc

    def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            self.comm.abort()

    def close(self) -> None:
        if not self._aborted:
            self.comm.destroy()

    def _start(self) -> Any:
        """Make our stream wait for the caller's current stream; return it for the NCCL call."""
        self.check()
        ready = self.cp.cuda.Event(disable_timing=True)
        ready.record(self.cp.cuda.get_current_stream())
        self.stream.wait_event(ready)
        return self.stream

    def _finish(self, result: Any, what: str) -> GpuWork:
        event = self.cp.cuda.Event(disable_timing=True, block=False)
        event.record(self.stream)
        return GpuWork(self, event, result, what)

    @staticmethod
    def _dtype(array: Any, what: str) -> int:
        code = NCCL_DTYPES.get(str(array.dtype))
        if code is None:
            raise TensorError(f"{what}: NCCL cannot move dtype {array.dtype}; cast it (int16 -> "
                              "int32) or stage it through host memory")
        return code

    # collectives -------------------------------------------------------------------------------
    def allreduce(self, array: Any, op: ReduceOp = ReduceOp.SUM, postscale: float = 1.0,
                  what: str = "allreduce") -> GpuWork:
        """Reduce ``array`` (flat, contiguous cupy array) in place over the ranks."""
        op = ReduceOp(op)
        table = self._check_op(array, op, postscale, what)
        dtype = self._dtype(array, what)
        stream = self._start()
        with self.cp.cuda.Device(self.device), stream:
            ptr = array.data.ptr
            self.comm.allReduce(ptr, ptr, int(array.size), dtype, table[op], stream.ptr)
            self._scale(array, op, postscale)
        return self._finish(array, what)

    def _scale(self, array: Any, op: ReduceOp, postscale: float) -> None:
        """AVERAGE's 1/n and ``postscale``, once, on the current stream (ring semantics)."""
        factor = postscale / self.size if op == ReduceOp.AVERAGE else postscale
        if factor == 1.0 or not array.size:
            return
        if array.dtype.kind in "iu":
            scaled = self.cp.trunc(array.astype(self.cp.float64) * factor)
            array[...] = wrap_integers(scaled, array.dtype, self.cp.fmod).astype(array.dtype)
        else:
            array *= array.dtype.type(factor)

    def _check_op(self, array: Any, op: ReduceOp, postscale: float, what: str) -> dict:
        is_bool = str(array.dtype) == "bool"
        table = _BOOL_OPS if is_bool else NCCL_OPS
        if op not in table:
            raise TensorError(f"{what}: reduce op {op.name} is not supported on the GPU")
        if is_bool and (op == ReduceOp.AVERAGE or postscale != 1.0):
            raise TensorError(f"{what} has dtype bool, which cannot be averaged or scaled; use "
                              "Sum, Min, Max or Product, or cast to a numeric dtype")
        return table

    def broadcast(self, array: Any, root: int, what: str = "broadcast") -> GpuWork:
        stream = self._start()
        with self.cp.cuda.Device(self.device), stream:
            ptr = array.data.ptr
            self.comm.broadcast(ptr, ptr, int(array.size), self._dtype(array, what), root,
                                stream.ptr)
        return self._finish(array, what)

    def allgather(self, array: Any, counts: Sequence[int], what: str = "allgather") -> GpuWork:
        """Concatenate every rank's rows (``counts[r]`` rows on rank r): padded to the largest."""
        cp = self.cp
        rest = array.shape[1:]
        most = max(counts)
        stream = self._start()
        with cp.cuda.Device(self.device), stream:
            send = cp.zeros((most, *rest), array.dtype)
            send[: counts[self.rank]] = array
            recv = cp.empty((self.size * most, *rest), array.dtype)
            self.comm.allGather(send.data.ptr, recv.data.ptr, int(send.size),
                                self._dtype(array, what), stream.ptr)
            parts = [recv[r * most: r * most + counts[r]] for r in range(self.size)]
            out = cp.concatenate(parts) if parts else recv[:0]
        return self._finish(out, what)

    def reducescatter(self, array: Any, op: ReduceOp = ReduceOp.SUM, postscale: float = 1.0,
                      what: str = "reducescatter") -> GpuWork:
        """This rank's rows of the reduction, split like :func:`row_splits`."""
        cp = self.cp
        op = ReduceOp(op)
        table = self._check_op(array, op, postscale, what)
        dtype = self._dtype(array, what)
        splits = row_splits(array.shape[0], self.size)
        most = max(hi - lo for lo, hi in splits)
        rest = array.shape[1:]
        lo, hi = splits[self.rank]
        stream = self._start()
        with cp.cuda.Device(self.device), stream:
            # NCCL gives every rank the same count: pad each rank's rows to the largest share.
            padded = cp.zeros((self.size * most, *rest), array.dtype)
            for r, (a, b) in enumerate(splits):
                padded[r * most: r * most + b - a] = array[a:b]
            recv = cp.empty((most, *rest), array.dtype)
            if recv.size:
                self.comm.reduceScatter(padded.data.ptr, recv.data.ptr, int(recv.size), dtype,
                                        table[op], stream.ptr)
            mine = recv[: hi - lo]
            self._scale(mine, op, postscale)
        return self._finish(mine, what)

    def alltoall(self, array: Any, splits: Sequence[int], recv_splits: Sequence[int],
                 what: str = "alltoall") -> GpuWork:
        """Send ``splits[d]`` rows to rank d, receive ``recv_splits[s]`` rows from rank s.

        The receive splits come from negotiation (every rank's request carries its splits).
        """
        cp, nccl = self.cp, self.nccl
        rest = array.shape[1:]
        dtype = self._dtype(array, what)
        out = cp.empty((sum(recv_splits), *rest), array.dtype)
        stream = self._start()
        with cp.cuda.Device(self.device), stream:
            nccl.groupStart()
            s_off = r_off = 0
            for peer in range(self.size):
                s, r = splits[peer], recv_splits[peer]
                if s:
                    chunk = array[s_off:s_off + s]
                    self.comm.send(chunk.data.ptr, int(chunk.size), dtype, peer, stream.ptr)
                if r:
                    dest = out[r_off:r_off + r]
                    self.comm.recv(dest.data.ptr, int(dest.size), dtype, peer, stream.ptr)
                s_off += s
                r_off += r
            nccl.groupEnd()
        return self._finish(out, what)
