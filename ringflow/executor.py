"""Execution of plan items on the data plane: fusion packing and each collective's algorithm.

The engine thread hands :meth:`Executor.run` one plan item at a time, in plan order, outside the
control lock. The executor packs fused tensors into a reusable buffer of the wire dtype (the
cast *is* the fp16/bf16 compression; prescale is applied while packing), runs the algorithm on
the process set's link, and unpacks (the cast back decompresses). Allreduce takes the first
enabled implementation of :class:`~ringflow.backends.Backends` (shared memory, hierarchical,
native, ring), which may offer the buffer to pack into (shared memory saves a copy). A rank that
joined takes part in allreduces with zeros (the only collective with data it takes part in;
the paths for a joined rank's allgather and broadcast, no rows and a relay, are no longer
planned: Horovod refuses both after a join, and so does the coordinator).

Buffers: one fusion buffer per (device, wire dtype), grown and never shrunk. Outputs are fresh
arrays unless the caller passed one (``out``, the in-place forms).

Devices (:mod:`ringflow.devices`). An item whose requests name a non-CPU device kind runs with
the entries' array namespace instead of numpy, through the same code: an allreduce is packed into
a fusion buffer *on the device* (the cast to the wire dtype and the prescale run there), reduced
by the implementation :meth:`~ringflow.backends.Backends.allreduce_for` picks (NCCL, or host
staging of the fused buffer: one copy each way per item), and unpacked on the device. Every other
collective, and Adasum, is *staged*: each input copied to host memory with its namespace, the
CPU algorithm run, each output copied back to an array on the input's device (alltoall's
received splits stay host integers). The item ends with the namespace's ``fence``: the handles
complete only once the device has finished, found by polling. Small device allreduces never take
the coordinator's eager path (:func:`eager_input`): that would copy to the host on the
submitting thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import algorithms, devices
from .algorithms import buffers, device
from .backends import Backends
from .collectives import COLLECTIVES
from .devices import ArrayNamespace, casts
from .devices.host import HOST
from .negotiation import EAGER_BYTES, Request, Response
from .ops import DTYPES, ReduceOp, scale_into
from .transport.base import Link, Subset

__all__ = ["Entry", "Executor", "eager_input", "output_of", "solo_allreduce", "unpack"]


class Entry:
    """A tensor handed to the engine: its request, input, optional output, and handle."""

    __slots__ = ("array", "handle", "out", "request")

    def __init__(self, request: Request, array: np.ndarray | None, out: Any, handle: Any):
        self.request = request
        self.array = array
        self.out = out
        self.handle = handle


class Executor:
    """Runs plan items over ``backends``; ``process_sets`` maps set id -> global ranks."""

    def __init__(self, backends: Backends, process_sets: dict[int, list[int]]) -> None:
        self.backends = backends
        self.process_sets = process_sets
        self._fusion: dict[tuple[str, str, str], Any] = {}  # (namespace, device, dtype)
        self._subsets: dict[int, Subset] = {}

    def link(self, ps: int) -> Link:
        """The link of process set ``ps`` (ranks counted within the set)."""
        if ps == 0:
            return self.backends.transport
        sub = self._subsets.get(ps)
        if sub is None:
            sub = self._subsets[ps] = Subset(self.backends.transport, self.process_sets[ps])
        return sub

    def forget(self, ps: int) -> None:
        """Process set ``ps`` was removed."""
        self._subsets.pop(ps, None)

    def run(self, item: Response, entries: list[Entry | None]) -> list[Any]:
        """Execute one data-plane plan item; the outputs, one per entry (None for a joined
        rank's)."""
        if item.chunk:
            with buffers.chunk_size(item.chunk):
                return self._run(item, entries)
        return self._run(item, entries)

    def _run(self, item: Response, entries: list[Entry | None]) -> list[Any]:
        ref = item.requests[0]
        if ref.device == "cpu":
            return _RUN[item.kind](self, self.link(item.process_set), item, entries)
        ns, like = self._device(ref.device, entries)
        link = self.link(item.process_set)
        comm = self.backends.device_comm(link, ns, like)
        if comm is not None and _nccl_takes(comm, item):
            outs = self._on_device(link, item, entries, comm, ns, like)
        elif item.kind == "allreduce" and ref.reduce_op != ReduceOp.ADASUM:
            outs = self._allreduce(link, item, entries, ns, like)
        else:
            outs = self._staged(item, entries, ns)
        ns.fence(like, self.backends.timeout_s)
        return outs

    def _on_device(self, t: Link, item: Response, entries: list[Entry | None], comm: Any,
                   ns: ArrayNamespace, like: Any) -> list[Any]:
        """``item`` through NCCL (:mod:`ringflow.algorithms.device`)."""
        ref, kind = item.requests[0], item.kind
        what = f"{kind} of {ref.name!r} over NCCL"
        if kind in ("allreduce", "reduce"):
            outs = self._allreduce(t, item, entries, ns, like, DeviceAllreduce(comm, ns, what))
            if kind == "reduce" and t.rank != self._root(item):
                return [None]
            return outs
        if kind == "allgather":  # tensor by tensor; a joined rank contributes no rows
            outs = [device.allgather(comm, ns, e.array if e is not None else
                                     ns.empty((0, *r.shape[1:]), DTYPES[r.dtype], like),
                                     list(dims), what)
                    for e, r, dims in zip(entries, item.requests, item.first_dims, strict=True)]
            return [o if e is not None else None for o, e in zip(outs, entries, strict=True)]
        (entry,) = entries
        array = None if entry is None else entry.array
        if kind == "broadcast":
            out = ns.empty(ref.shape, DTYPES[ref.dtype], like) if entry is None \
                else output_of(entry, ref, ns)
            if entry is not None and out is not entry.array:
                ns.copy(ns.flat(out), ns.flat(entry.array))
            device.broadcast(comm, ns, out, self._root(item), what)
            return [out]
        if kind == "reducescatter":
            return [device.reducescatter(comm, ns, array, ReduceOp(ref.reduce_op), ref.prescale,
                                         ref.postscale, ref.wire_dtype, what)]
        if kind == "alltoall":
            splits = list(entry.request.splits)
            received = algorithms.exchange_counts(t, splits)
            return [(device.alltoall(comm, ns, array, splits, received, what), received)]
        return [device.gather(comm, ns, array, list(item.first_dims[0]), self._root(item), what)]

    @staticmethod
    def _device(kind: str, entries: list[Entry | None]) -> tuple[ArrayNamespace, Any]:
        """The namespace of the item's arrays on this rank, and one of them to allocate like."""
        for e in entries:
            if e is not None and e.array is not None:
                ns = devices.namespace_of(e.array)
                if ns is not None:
                    return ns, e.array
        return devices.joined_like(kind)  # nothing of this rank's own: it joined

    def _staged(self, item: Response, entries: list[Entry | None],
                ns: ArrayNamespace) -> list[Any]:
        """Run ``item`` on host copies of the device inputs; outputs back on the device."""
        host: list[Entry | None] = []
        for e in entries:
            if e is None or e.array is None or devices.namespace_of(e.array) is None:
                host.append(e)
                continue
            h = np.empty(tuple(e.array.shape), ns.dtype(e.array))
            ns.to_host(e.array, h)
            host.append(Entry(e.request, h, None, e.handle))
        results = _RUN[item.kind](self, self.link(item.process_set), item, host)
        outs: list[Any] = []
        for e, r in zip(entries, results, strict=True):
            if e is None or r is None or e.array is None or devices.namespace_of(e.array) is None:
                outs.append(r)
            elif isinstance(r, tuple):  # alltoall: (rows, received splits)
                outs.append((self._to_device(ns, r[0], e.array, None), *r[1:]))
            else:
                outs.append(self._to_device(ns, r, e.array, e.out))
        return outs

    @staticmethod
    def _to_device(ns: ArrayNamespace, host: np.ndarray, like: Any, out: Any) -> Any:
        if out is None:
            out = ns.empty(host.shape, host.dtype, like)
        ns.from_host(np.ascontiguousarray(host), out)
        return out

    def _root(self, item: Response) -> int:
        """The item's root within its process set (``root`` is a global rank)."""
        return self.process_sets[item.process_set].index(item.requests[0].root)

    def _broadcast(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        (entry,), req = entries, item.requests[0]
        if entry is None:  # a joined rank relays the root's data (the root has not joined)
            out = np.empty(req.shape, DTYPES[req.dtype])
        else:
            out = output_of(entry, req)
            if out is not entry.array:
                np.copyto(out, entry.array)
        algorithms.broadcast(t, out.reshape(-1), self._root(item))
        return [out]

    def _reduce(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        # The allreduce implementation, kept on the root: the root's bits equal an allreduce's.
        (out,) = self._allreduce(t, item, entries)
        return [out if t.rank == self._root(item) else None]

    def _gather(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        (entry,) = entries
        return [algorithms.gather(t, entry.array, item.first_dims[0], self._root(item))]

    def _scatter(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        (entry,), ref = entries, item.requests[0]  # the root's request (collectives.py)
        root = self._root(item)
        return [algorithms.scatter(t, entry.array if t.rank == root else None, ref.splits, root,
                                   ref.shape[1:], DTYPES[ref.dtype])]

    def _alltoall(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        (entry,) = entries
        # Splits differ by rank: each rank sends by its own request, not the reference one.
        return [algorithms.alltoall(t, entry.array, list(entry.request.splits))]

    def _reducescatter(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        (entry,), req = entries, item.requests[0]
        buf, wire = entry.array, req.wire_dtype  # casting to the wire dtype compresses
        if req.prescale != 1.0:
            buf = casts.astype(buf, wire, req.prescale)
        elif buf.dtype != wire:
            buf = casts.astype(buf, wire)
        out = algorithms.reducescatter(t, buf, ReduceOp(req.reduce_op), req.postscale)
        return [casts.astype(out, entry.array.dtype)]

    def _allreduce(self, t: Link, item: Response, entries: list[Entry | None],
                   ns: ArrayNamespace = HOST, like: Any = None, impl: Any = None) -> list[Any]:
        refs = item.requests
        ref = refs[0]
        wire = ref.wire_dtype
        reduce_op = ReduceOp(ref.reduce_op)
        sizes = [math.prod(r.shape) for r in refs]
        total = sum(sizes)
        if reduce_op == ReduceOp.ADASUM:  # its own algorithm, always through a buffer
            buf = self._pack(self._fusion_buffer(wire, total), entries, sizes, ref.prescale)
            algorithms.adasum(t, buf, sizes)
            if ref.postscale != 1.0:
                scale_into(buf, ref.postscale, buf)
            return unpack(buf, refs, entries)
        if impl is None:
            impl = self.backends.allreduce_for(item.process_set, wire, reduce_op, ref.device)
        e0 = entries[0]
        if (len(refs) == 1 and e0 is not None and e0.array is not None
                and ns.dtype(e0.array) == wire):
            result = output_of(e0, ref, ns)
            out, src = ns.flat(result), ns.flat(e0.array)
            if ref.prescale != 1.0:
                view = impl.input_view(total, wire)
                src = out if view is None else view
                ns.copy(src, ns.flat(e0.array), ref.prescale)
            impl.allreduce(t, src, out, reduce_op, ref.postscale)
            return [result]
        view = impl.input_view(total, wire)
        buf = self._fusion_buffer(wire, total, ns, like) if view is None else view
        self._pack(buf, entries, sizes, ref.prescale, ns)
        impl.allreduce(t, buf, buf, reduce_op, ref.postscale)
        return unpack(buf, refs, entries, ns)

    @staticmethod
    def _pack(buf: Any, entries: list[Entry | None], sizes: list[int], prescale: float,
              ns: ArrayNamespace = HOST) -> Any:
        """Each entry's input, prescaled, cast to ``buf``'s dtype; zeros for a joined rank."""
        offset = 0
        for entry, n in zip(entries, sizes, strict=True):
            view = buf[offset:offset + n]
            if entry is None or entry.array is None:
                ns.zero(view)
            else:
                ns.copy(view, ns.flat(entry.array), prescale)
            offset += n
        return buf

    def _allgather(self, t: Link, item: Response, entries: list[Entry | None]) -> list[Any]:
        refs = item.requests
        me = t.rank
        if len(refs) == 1 and entries[0] is not None:
            return [algorithms.allgather(t, entries[0].array, list(item.first_dims[0]))]
        row_bytes = [math.prod(r.shape[1:]) * DTYPES[r.dtype].itemsize for r in refs]
        counts = [sum(d[m] * rb for d, rb in zip(item.first_dims, row_bytes, strict=True))
                  for m in range(t.size)]
        send = self._fusion_buffer(np.dtype(np.uint8), counts[me])
        offset = 0
        for entry, dims, rb in zip(entries, item.first_dims, row_bytes, strict=True):
            n = dims[me] * rb
            if entry is not None and n:
                send[offset:offset + n] = entry.array.reshape(-1).view(np.uint8)
            offset += n
        gathered = algorithms.allgather(t, send[:counts[me]].copy(), counts)
        outs = [np.empty((sum(d), *r.shape[1:]), DTYPES[r.dtype])
                for d, r in zip(item.first_dims, refs, strict=True)]
        flat = [o.reshape(-1).view(np.uint8) for o in outs]
        cursor = [0] * len(outs)
        offset = 0
        for m in range(t.size):
            for i, (dims, rb) in enumerate(zip(item.first_dims, row_bytes, strict=True)):
                n = dims[m] * rb
                flat[i][cursor[i]:cursor[i] + n] = gathered[offset:offset + n]
                cursor[i] += n
                offset += n
        return [o if e is not None else None for o, e in zip(outs, entries, strict=True)]

    def _fusion_buffer(self, dtype: np.dtype, n: int, ns: ArrayNamespace = HOST,
                       like: Any = None) -> Any:
        """A reused buffer of at least ``n`` elements of ``dtype`` on ``like``'s device (grown,
        never shrunk)."""
        key = (ns.name, "cpu" if like is None else ns.device(like), dtype.str)
        buf = self._fusion.get(key)
        if buf is None or math.prod(buf.shape) < n:
            buf = self._fusion[key] = ns.empty((max(n, 1),), dtype, like)
        return buf[:n]


class DeviceAllreduce:
    """An allreduce implementation over a set's NCCL communicator (the fused device buffer)."""

    name = "nccl"

    def __init__(self, comm: Any, ns: ArrayNamespace, what: str) -> None:
        self.comm, self.ns, self.what = comm, ns, what

    def input_view(self, n: int, dtype: np.dtype) -> None:
        return None

    def allreduce(self, link: Link, src: Any, out: Any, op: ReduceOp, postscale: float) -> None:
        if src is not out:
            self.ns.copy(out, src)
        device.allreduce(self.comm, self.ns, out, op, postscale, self.what)


#: What runs over NCCL; scatter's root concatenates its pieces on the host (a host array).
_ON_DEVICE = {"allreduce", "reduce", "allgather", "broadcast", "reducescatter", "alltoall",
              "gather"}


def _nccl_takes(comm: Any, item: Response) -> bool:
    """Whether NCCL moves every tensor of ``item`` (its dtypes, on the wire, and its op)."""
    if item.kind not in _ON_DEVICE:
        return False
    for r in item.requests:
        reduces = item.kind in ("allreduce", "reduce", "reducescatter")
        if reduces and r.reduce_op == ReduceOp.ADASUM:
            return False
        op = ReduceOp(r.reduce_op) if reduces else None
        if not comm.takes(r.wire_dtype if reduces else DTYPES[r.dtype], op):
            return False
    return True


#: How each collective that moves data runs (collectives.COLLECTIVES says which do).
_RUN = {"allreduce": Executor._allreduce, "allgather": Executor._allgather,
        "broadcast": Executor._broadcast, "alltoall": Executor._alltoall,
        "reducescatter": Executor._reducescatter, "reduce": Executor._reduce,
        "gather": Executor._gather, "scatter": Executor._scatter}
_MISSING = {k for k, c in COLLECTIVES.items() if c.data} ^ set(_RUN)
if _MISSING:  # a collective in the table that the executor cannot run, or the other way round
    raise ImportError(f"ringflow.executor and ringflow.collectives disagree on {_MISSING}")


def output_of(entry: Entry, req: Request, ns: ArrayNamespace = HOST) -> Any:
    """Where the result of ``entry`` goes: its given output, or a new array like its input."""
    if entry.out is not None:
        return entry.out
    if entry.array is None:
        return np.empty(req.shape, DTYPES[req.dtype])
    return ns.empty(req.shape, ns.dtype(entry.array), entry.array)


def _scaled(array: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    out = np.empty(array.shape, dtype)
    scale_into(array, factor, out)
    return out


def eager_input(entry: Entry) -> np.ndarray | None:
    """What this rank sends with a cache bit so that rank 0 can reduce the tensor itself: the
    prescaled tensor in its wire dtype, for allreduces of at most ``EAGER_BYTES``."""
    req, arr = entry.request, entry.array
    if (req.kind != "allreduce" or arr is None or req.nbytes > EAGER_BYTES
            or req.reduce_op == ReduceOp.ADASUM or req.device != "cpu"):
        return None
    flat = arr.reshape(-1)
    wire = req.wire_dtype
    if req.prescale != 1.0:
        return _scaled(flat, req.prescale, wire)
    # No copy: a worker pickles it at once, and rank 0 reduces it before the handle can finish.
    return flat if flat.dtype == wire else flat.astype(wire)


def solo_allreduce(entry: Entry) -> Any:
    """The allreduce of a job of one rank, in the submitting thread: the input cast to the wire
    dtype with its prescale, scaled by the postscale (Average over one rank), cast back; the
    arithmetic of the plan path (``reduce_parts`` of one part), without negotiation, a transport
    or a communicator.

    On a device the work is queued on the caller's current stream and not waited for: what the
    caller queues next on that stream, or on the device's default stream (``ready`` orders it
    after), sees the result, as after torch.distributed's NCCL ``all_reduce``. A wait here cost a
    4 KiB allreduce on an H200 ~50 us of host time and stalled the queue of a training step."""
    req = entry.request
    ns = devices.namespace_of(entry.array) or HOST
    out = output_of(entry, req, ns)
    wire, factor = req.wire_dtype, req.postscale
    plain = ns.dtype(entry.array) == wire and req.prescale == 1.0 and factor == 1.0
    if plain and out is entry.array:
        return out  # in place, nothing to do: the input is the result
    src, dst = ns.flat(entry.array), ns.flat(out)
    if plain:
        ns.copy(dst, src)
    else:
        buf = ns.empty((math.prod(req.shape),), wire, entry.array)
        ns.copy(buf, src, req.prescale)
        if factor != 1.0:
            ns.copy(buf, buf, factor)
        ns.copy(dst, buf)
    ns.ready(out)
    return out


def unpack(result: Any, refs: tuple[Request, ...], entries: list[Entry | None],
           ns: ArrayNamespace = HOST) -> list:
    """Each entry's output from the fused ``result`` (casting decompresses)."""
    outs: list[Any] = []
    offset = 0
    for r, entry in zip(refs, entries, strict=True):
        n = math.prod(r.shape)
        if entry is None:
            outs.append(None)
        else:
            out = output_of(entry, r, ns)
            ns.copy(ns.flat(out), result[offset:offset + n])
            outs.append(out)
        offset += n
    return outs
