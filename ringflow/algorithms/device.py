"""ringflow's collectives on device arrays, composed of NCCL's primitives.

The executor runs a plan item whose tensors live on a GPU here when the job can run NCCL on that
device (:class:`ringflow.backends.Nccl`); otherwise it stages them through host memory. Each
function takes the process set's :class:`~ringflow.algorithms.nccl.DeviceComm` (ranks counted
within the set), the arrays' :class:`~ringflow.devices.ArrayNamespace` (allocation and copies
on the device) and contiguous arrays of that library, and returns once the device has finished
(``comm.wait``). Outputs are new arrays on the input's device.

What NCCL lacks is made here, as the host algorithms make it:

* ragged rows (allgather, reducescatter): padded to the largest share for NCCL's equal counts,
  then copied out; when the shares are equal, NCCL reads and writes the arrays themselves;
* scale factors and Average: one scale on the device after the Sum, with the arithmetic of
  :func:`ringflow.ops.scale_into` (integers: :func:`ringflow.ops.wrap_integers`);
* gather and alltoall: grouped sends and receives; a rank's own part is a copy. (scatter takes
  host arrays only: its root concatenates the pieces on the host.)

Cost: as NCCL's collective (ring or tree), plus one device copy of what is padded or reordered.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..ops import ReduceOp
from .buffers import even_split
from .nccl import DeviceComm

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "gather", "reducescatter",
           "self_test"]


def _scale(comm: DeviceComm, ns: Any, buf: Any, op: ReduceOp, postscale: float) -> None:
    factor = postscale / comm.size if op == ReduceOp.AVERAGE else postscale
    if factor != 1.0 and math.prod(buf.shape):
        ns.copy(buf, buf, factor)


def allreduce(comm: DeviceComm, ns: Any, buf: Any, op: ReduceOp, postscale: float,
              what: str) -> None:
    """``buf`` (flat) reduced in place over the set, then scaled once."""
    comm.allreduce(buf, op)
    comm.wait(what)
    _scale(comm, ns, buf, op, postscale)


def broadcast(comm: DeviceComm, ns: Any, out: Any, root: int, what: str) -> None:
    """``out`` (the root's input, elsewhere to be overwritten) becomes the root's."""
    comm.broadcast(ns.flat(out), root)
    comm.wait(what)


def allgather(comm: DeviceComm, ns: Any, array: Any, counts: list[int], what: str) -> Any:
    """Every rank's rows (``counts[r]`` on rank r) in rank order."""
    rest = tuple(array.shape[1:])
    row = math.prod(rest)
    dtype = ns.dtype(array)
    out = ns.empty((sum(counts), *rest), dtype, array)
    if len(set(counts)) == 1:
        if counts[0] * row:
            comm.allgather(ns.flat(array), ns.flat(out))
            comm.wait(what)
        return out
    most = max(counts) * row
    send = ns.empty((most,), dtype, array)
    ns.copy(send[:counts[comm.rank] * row], ns.flat(array))
    recv = ns.empty((comm.size * most,), dtype, array)
    comm.allgather(send, recv)
    comm.wait(what)
    flat, offset = ns.flat(out), 0
    for r, count in enumerate(counts):
        ns.copy(flat[offset:offset + count * row], recv[r * most:r * most + count * row])
        offset += count * row
    return out


def reducescatter(comm: DeviceComm, ns: Any, array: Any, op: ReduceOp, prescale: float,
                  postscale: float, wire: np.dtype, what: str) -> Any:
    """This rank's rows of the reduction (rows split as the ring splits them), in the input's
    dtype; reduced in ``wire`` (the compression), prescaled while cast to it."""
    rest = tuple(array.shape[1:])
    row = math.prod(rest)
    dtype = ns.dtype(array)
    buf = ns.flat(array)
    if prescale != 1.0 or dtype != wire:
        buf = ns.empty((math.prod(array.shape),), wire, array)
        ns.copy(buf, ns.flat(array), prescale)
    splits = even_split(array.shape[0], comm.size)
    shares = [(hi - lo) * row for lo, hi in splits]
    most = max(shares)
    if len(set(shares)) == 1:
        send = buf
    else:
        send = ns.empty((comm.size * most,), wire, array)
        ns.zero(send)
        for r, (lo, hi) in enumerate(splits):
            ns.copy(send[r * most:r * most + shares[r]], buf[lo * row:hi * row])
    recv = ns.empty((most,), wire, array)
    if most:
        comm.reducescatter(send, recv, op)
        comm.wait(what)
    lo, hi = splits[comm.rank]
    mine = recv[:shares[comm.rank]]
    _scale(comm, ns, mine, op, postscale)
    out = ns.empty((hi - lo, *rest), dtype, array)
    ns.copy(ns.flat(out), mine)
    return out


def alltoall(comm: DeviceComm, ns: Any, array: Any, splits: list[int], received: list[int],
             what: str) -> Any:
    """Rows ``splits[d]`` of this rank's input to rank d; ``received[s]`` rows from rank s."""
    rest = tuple(array.shape[1:])
    row = math.prod(rest)
    out = ns.empty((sum(received), *rest), ns.dtype(array), array)
    src, dst = ns.flat(array), ns.flat(out)
    sends, recvs = [], []
    s_off = r_off = 0
    for peer in range(comm.size):
        s, r = splits[peer] * row, received[peer] * row
        if peer == comm.rank:
            ns.copy(dst[r_off:r_off + r], src[s_off:s_off + s])
        else:
            sends.append((peer, src[s_off:s_off + s]))
            recvs.append((peer, dst[r_off:r_off + r]))
        s_off, r_off = s_off + s, r_off + r
    comm.exchange(sends, recvs)
    comm.wait(what)
    return out


def gather(comm: DeviceComm, ns: Any, array: Any, counts: list[int], root: int,
           what: str) -> Any:
    """Every rank's rows on ``root`` in rank order; None elsewhere."""
    rest = tuple(array.shape[1:])
    row = math.prod(rest)
    if comm.rank != root:
        comm.exchange([(root, ns.flat(array))], [])
        comm.wait(what)
        return None
    out = ns.empty((sum(counts), *rest), ns.dtype(array), array)
    flat, recvs, offset = ns.flat(out), [], 0
    for r, count in enumerate(counts):
        part = flat[offset:offset + count * row]
        if r == root:
            ns.copy(part, ns.flat(array))
        else:
            recvs.append((r, part))
        offset += count * row
    comm.exchange([], recvs)
    comm.wait(what)
    return out


def self_test(provider: str) -> str:
    """Run a one-rank allreduce and broadcast on GPU 0 through ``provider`` ("cupy" or "torch");
    return its NCCL version text. Raises whatever stopped it (``ringflow-run --check-build``
    reports a provider as usable only after this ran, in a child process)."""
    from ..rendezvous import MemoryStore
    if provider == "cupy":
        from .nccl import CupyNccl, _cupy, version_text

        cp, binding = _cupy()
        from ..devices.cupy_cuda import CupyNamespace

        comm: Any = CupyNccl(0, 1, MemoryStore(), "selftest/", 0, 30.0)
        ns, make, host = CupyNamespace(), cp.asarray, cp.asnumpy
        version = f"cupy {cp.__version__}, NCCL {version_text(int(binding.get_version()))}"
    else:
        import torch

        from ..devices.torch_tensors import TorchNamespace
        from .nccl_torch import TorchNccl
        from .nccl_torch import unusable_reason as torch_reason
        from .nccl_torch import version as torch_nccl

        if torch_reason():
            raise RuntimeError(torch_reason())
        comm = TorchNccl(0, 1, MemoryStore(), "selftest/", 0, 30.0)
        ns, host = TorchNamespace(), (lambda t: t.cpu().numpy())

        def make(a: np.ndarray) -> Any:
            return torch.from_numpy(a).cuda()

        version = f"torch {torch.__version__}, NCCL {torch_nccl()}"
    try:
        x = make(np.arange(5, dtype=np.float32))
        allreduce(comm, ns, x, ReduceOp.AVERAGE, 2.0, "the self-test's allreduce")
        broadcast(comm, ns, x, 0, "the self-test's broadcast")
        got = host(x)
        if not np.array_equal(got, np.arange(5, dtype=np.float32) * 2):
            raise RuntimeError(f"a one-rank allreduce of [0 1 2 3 4] (x2) gave {got}")
    finally:
        comm.close()
    return version
