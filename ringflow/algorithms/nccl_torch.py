"""NCCL through torch: :class:`TorchNccl`, a :class:`~ringflow.algorithms.nccl.DeviceComm` on
``torch.distributed.ProcessGroupNCCL``, for a torch user without cupy (torch's CUDA wheels ship
NCCL, so nothing else is installed).

The group is built directly, without ``init_process_group`` (which would claim torch's default
group from the user): ``ProcessGroupNCCL(store, rank, size, options)`` over :class:`C10dStore`,
a torch ``Store`` whose keys live in ringflow's own job store under the process set's prefix.
ProcessGroupNCCL needs ``set`` and a blocking ``get`` there (rank 0 publishes the unique id
under ``"0"``, ``"1"``, ... per communicator, and ``"low:high"`` for a pair); its heartbeat
monitor polls ``check``. The id therefore travels in the same HMAC-authenticated store as
everything else of the job (torch's own ``init_process_group`` would put it in a TCPStore that
anyone who reaches the port can read).

torch's collectives take tensors: a cupy buffer is seen through DLPack (no copy). Each call
returns a torch ``Work``; :meth:`TorchNccl.wait` polls ``is_completed()`` (an event query),
with the job's ``check()`` between polls and the timeout, then ``wait()``s each (which only
orders the current stream after it). On failure the group is aborted (``abort()``, torch 2.7
and later; ``_shutdown()`` before).

On CPU the tests build the same class over ``ProcessGroupGloo`` (``group=``), which takes the
same store and the same calls: everything here but the NCCL library itself runs in CI.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerError, RingflowError, RingflowTimeoutError, TensorError
from ..ops import ReduceOp
from ..polling import polls
from . import nccl

__all__ = ["C10dStore", "TorchNccl", "unusable_reason"]

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT, ReduceOp.MAX: dist.ReduceOp.MAX,
        ReduceOp.MIN: dist.ReduceOp.MIN}
_BOOL_OPS = {ReduceOp.SUM: dist.ReduceOp.MAX, ReduceOp.MAX: dist.ReduceOp.MAX,
             ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.PRODUCT: dist.ReduceOp.MIN}


def unusable_reason() -> str:
    """Why torch's NCCL cannot run here ("" if it can)."""
    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch has no NCCL (a CPU build)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def version() -> str:
    return ".".join(map(str, torch.cuda.nccl.version()))


class C10dStore(dist.Store):
    """A torch ``Store`` over ringflow's ``store``, every key under ``prefix``."""

    def __init__(self, store: Any, prefix: str, timeout: float) -> None:
        super().__init__()
        self._store, self._prefix, self._timeout = store, prefix, timeout

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._prefix + key, value.encode() if isinstance(value, str)
                        else bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(self._prefix + key, self._timeout)

    def add(self, key: str, value: int) -> int:
        return self._store.add(self._prefix + key, int(value))

    def check(self, keys: list[str]) -> bool:
        try:
            self._store.wait([self._prefix + k for k in keys], 0.0)
        except RingflowError:
            return False
        return True

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        seconds = (timeout.total_seconds() if isinstance(timeout, datetime.timedelta)
                   else self._timeout)
        self._store.wait([self._prefix + k for k in keys], seconds)

    def delete_key(self, key: str) -> bool:
        return self._store.delete(self._prefix + key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """Not atomic (ringflow's store has no compare-and-set); nothing of ProcessGroupNCCL's
        uses it."""
        full = self._prefix + key
        try:
            have = self._store.get(full, 0.0)
        except RingflowError:
            have = b""
        if have == bytes(expected):
            self.set(key, desired)
            return bytes(desired)
        return have


def _tensor(buf: Any) -> torch.Tensor:
    return buf if isinstance(buf, torch.Tensor) else torch.from_dlpack(buf)


class TorchNccl:
    """:class:`~ringflow.algorithms.nccl.DeviceComm` on a torch process group (module doc)."""

    provider = "torch"

    def __init__(self, rank: int, size: int, store: Any, prefix: str, device: int,
                 timeout: float, check: Callable[[], None] = lambda: None,
                 group: Callable[..., Any] | None = None) -> None:
        self.rank, self.size, self.device, self.timeout = rank, size, device, timeout
        self._check = check
        self._store = C10dStore(store, prefix, timeout)
        limit = datetime.timedelta(seconds=timeout)
        if group is None:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = limit
            self.pg = dist.ProcessGroupNCCL(self._store, rank, size, options)
        else:  # the CPU test's ProcessGroupGloo: the same store and calls
            self.pg = group(self._store, rank, size, limit)
        self._works: list[Any] = []
        self._aborted = False

    takes = staticmethod(nccl.takes)

    def abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            stop = getattr(self.pg, "abort", None) or getattr(self.pg, "_shutdown", None)
            if stop is not None:
                stop()

    def close(self) -> None:
        if not self._aborted:
            self._aborted = True
            stop = getattr(self.pg, "shutdown", None) or getattr(self.pg, "_shutdown", None)
            if stop is not None:
                stop()

    def _add(self, work: Any) -> None:
        if self._aborted:
            raise PeerError("the NCCL communicator was aborted after an earlier error")
        self._works.append(work)

    def wait(self, what: str) -> None:
        works, self._works = self._works, []
        works.reverse()  # popped from the end: in the order they were posted
        # One deadline and one growing pause for them all: a work found finished is waited for
        # and the next one polled at once.
        for _ in polls(self.timeout, 1e-6, 1e-4):
            while works and self._completed(works[-1], what):
                self._wait_on(works.pop(), what)
            if not works:
                return
        self.abort()
        raise RingflowTimeoutError(
            f"{what} on the GPU did not finish within {self.timeout} s; a peer may "
            "be frozen or gone (RINGFLOW_TIMEOUT_S sets the limit)")

    def _completed(self, work: Any, what: str) -> bool:
        """``work.is_completed()`` (an event query) after the job's check; an error of either
        aborts the communicator."""
        try:
            self._check()  # the job's error (a failed peer) as it is: one text
        except Exception:
            self.abort()
            raise
        try:
            return bool(work.is_completed())
        except Exception as exc:  # torch's NCCL error: abort, name it
            self.abort()
            raise PeerError(f"{what} failed on the GPU on rank {self.rank}: {exc}") from exc

    def _wait_on(self, work: Any, what: str) -> None:
        try:
            work.wait()  # orders the current stream after it; raises torch's error
        except Exception as exc:
            self.abort()
            raise PeerError(f"{what} failed on the GPU on rank {self.rank}: {exc}") from exc

    @staticmethod
    def _op(t: torch.Tensor, op: ReduceOp) -> Any:
        table = _BOOL_OPS if t.dtype == torch.bool else _OPS
        if op not in table:
            raise TensorError(f"reduce op {ReduceOp(op).name} is not supported on the GPU")
        return table[op]

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        t = _tensor(buf)
        opts = dist.AllreduceOptions()
        opts.reduceOp = self._op(t, op)
        self._add(self.pg.allreduce([t], opts))

    def broadcast(self, buf: Any, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self._add(self.pg.broadcast([_tensor(buf)], opts))

    def allgather(self, send: Any, recv: Any) -> None:
        self._add(self.pg._allgather_base(_tensor(recv), _tensor(send)))

    def reducescatter(self, send: Any, recv: Any, op: ReduceOp) -> None:
        s = _tensor(send)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = self._op(s, op)
        self._add(self.pg._reduce_scatter_base(_tensor(recv), s, opts))

    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]]
                 ) -> None:
        # Pair by pair in rank order: each pair has its own communicator and stream in torch,
        # so a root that sends to every rank in turn waits for nobody.
        for peer, buf in sorted(sends, key=lambda s: s[0]):
            t = _tensor(buf)
            if t.numel():
                self._add(self.pg.send([t], peer, 0))
        for peer, buf in sorted(recvs, key=lambda s: s[0]):
            t = _tensor(buf)
            if t.numel():
                self._add(self.pg.recv([t], peer, 0))

