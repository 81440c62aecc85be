"""torch.distributed's backend ``"ringflow"``: torch's own API on ringflow's engine.

Over 600 lines on purpose: one method per entry point of torch's ``ProcessGroup`` (about
twenty-five), each translating torch's arguments and outputs, beside the one table of torch's
call -> ringflow's operation (DESIGN.md section 13) that they implement.

``import ringflow.torch`` registers it; then ``torch.distributed.init_process_group(
backend="ringflow")`` (any init method: ``env://``, ``tcp://``, ``file://``, a ``store=``) makes
the default group a :class:`ProcessGroupRingflow`, and ``all_reduce``, ``broadcast``,
DistributedDataParallel, ``DistributedSampler``-driven scripts, ... run on ringflow's
negotiation, fusion and transports (shared memory on one host, TCP, MPI).

Joining. torch calls the creator with the store of its rendezvous, this process's rank and the
world size (on every rank, once). The creator starts ringflow's engine on exactly that:
``ringflow.init(rank=, size=, store=TorchStore(store))``; ringflow's own rendezvous (addresses,
data-plane secret, host names) goes through torch's store, under its ``ringflow/`` keys. A
process where ringflow is already running (``hvd.init()`` first) keeps its engine when the rank
and size agree, and fails with ConfigError when they do not. The default group's ``shutdown()``
(``destroy_process_group()``) shuts the engine down if the group started it.

Groups. ``new_group(ranks)`` reaches :meth:`ProcessGroupRingflow.new_group` on every rank of the
default group (torch delegates it to a Python default group), which adds a ringflow process set
of those global ranks (a collective of all ranks, as ``add_process_set`` is) and returns the
members their group. Ranks in torch's API are global, as in ringflow; ranks inside options
(``rootRank``, a send's ``dstRank``) are group ranks, which the group maps back.

Names. ringflow negotiates named tensors; torch's collectives have none, but every member calls
a group's collectives in the same order (torch's own contract, which gloo and NCCL rely on with
their sequence numbers). The n-th collective of a group is named ``torch.<group>.<n>``, group
``pg0`` being the default group and ``pgK`` the K-th ``new_group``. The coordinator checks the
ranks' requests for a name against each other, so ranks that call different collectives (or
different dtypes, shapes, ops, roots) at the same point fail with one MismatchError on every
rank, naming the field and each rank's value, instead of pairing wrong data. Such names never
repeat, so they never take the response cache's fast path: each costs a full negotiation (the
request, validated by rank 0), ~0.3 ms here.

Semantics (torch's, not Horovod's): ``all_reduce`` sums by default and writes in place; AVG
divides by the group size (integers truncate, Horovod's arithmetic); BAND/BOR/BXOR/PREMUL_SUM
are refused. ``reduce`` writes the root's tensor only (the others keep theirs). ``all_gather``
and ``gather`` need every rank's tensor to have the same number of elements (gloo's rule); a rank
that differs fails the operation on every rank. Point to point is ringflow's (``ringflow.p2p``):
a send completes when the receiver has the data (MPI's synchronous mode), messages of one
(source, tag) arrive in order, tags of a sub-group never match the default group's, and a
receive needs its source (``recv(src=None)`` raises UnsupportedError, a NotImplementedError).
Any operation that fails -- a mismatch, a tensor ringflow cannot move, a peer that died -- fails
its Work, and ``wait()`` raises the ringflow error (the same class and text on every rank for
collectives);
nothing hangs past the engine's own limits (``RINGFLOW_TIMEOUT_S`` for a silent peer,
``RINGFLOW_DEADLOCK_SHUTDOWN_S`` for ranks waiting on each other) or the group's ``timeout``.

CUDA tensors (registered for ``cpu`` and ``cuda``): a CUDA tensor goes to the core as the
tensor itself, so collectives run over NCCL where the job can (``ringflow.backends.Nccl``: each
rank on its own GPU, ``torch.cuda.set_device(local_rank)``), else through host memory; results
are written in place, and a copy into an output tensor is finished on the GPU before the Work
completes (torch's future of a Python group records no CUDA event). scatter's root pieces and
point to point are staged through host memory here (the core moves host arrays for them).
DistributedDataParallel of a CUDA model with ``device_ids=[local_rank]`` runs on this.

Not supported (raising at the call, or failing the Work on every rank): unsorted
``new_group(..., sort_ranks=False)`` rank lists, ``new_group(use_local_synchronization=True)``,
a ringflow sub-group of a default group on another backend, ``allgather_coalesced``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import runtime, submission
from .._adapter import Invalid
from ..config import Config
from ..errors import ConfigError, TensorError, UnsupportedError
from ..negotiation import ONCE, Request
from ..ops import ReduceOp
from ..process_sets import ProcessSet, add_process_set, global_process_set
from ..rendezvous.torch_store import TorchStore, _master_of
from ..submission import start_recv, start_send
from ._tensors import from_numpy, prepare
from ._work import Work, as_seconds

__all__ = ["BACKEND", "ProcessGroupRingflow", "register"]

BACKEND = "ringflow"

_REDUCE_OPS = ((dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVERAGE),
               (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT), (dist.ReduceOp.MIN, ReduceOp.MIN),
               (dist.ReduceOp.MAX, ReduceOp.MAX))
#: torch's point-to-point tags of group K >= 1 travel as ``K << 48 | tag``: gloo keeps each
#: group's messages apart, and so does this.
_TAG_BITS = 48


def _reduce_op(opts: Any, what: str) -> tuple[ReduceOp, str]:
    """ringflow's op for torch's ``opts.reduceOp``, or SUM and why it cannot be used."""
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for theirs, ours in _REDUCE_OPS:
        if op == theirs:
            return ours, ""
    return ReduceOp.SUM, (f"{what}: ReduceOp {op} is not supported by the ringflow backend; "
                          "use SUM, AVG, PRODUCT, MIN or MAX")


def _array(tensor: Any, what: str) -> tuple[Any, torch.Tensor | None]:
    """(what the engine moves for a contiguous copy-or-self of ``tensor``: a numpy view of a
    CPU tensor, a CUDA tensor itself; that tensor), or (Invalid, None): the reason then fails
    the operation on every rank."""
    return prepare(tensor, what)


def _host(tensor: Any, what: str) -> tuple[Any, torch.Tensor | None]:
    """:func:`_array` of a host copy of a CUDA tensor (scatter's root pieces and point to
    point, which move host arrays: staged here)."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
        tensor = tensor.detach().cpu()
    return prepare(tensor, what)


def _numel(arr: Any) -> int:
    return math.prod(arr.shape)


def _cat(arrays: Sequence[Any]) -> Any:
    """The flat concatenation of numpy arrays or of device tensors."""
    if arrays and isinstance(arrays[0], torch.Tensor):
        return torch.cat([a.reshape(-1) for a in arrays])
    return np.concatenate([a.reshape(-1) for a in arrays])


def _flat(values: Any) -> Any:
    return values.reshape(-1) if isinstance(values, torch.Tensor) else \
        np.asarray(values).reshape(-1)


def _rows(arr: Any, rows: int = 1) -> Any:
    """``arr`` as (rows, -1): concatenations along the first dimension then stack whole
    tensors, and the coordinator compares the rest (the element count) across ranks."""
    if isinstance(arr, Invalid):
        return arr
    return arr.reshape(rows, _numel(arr) // rows if rows else 0)


def _put(out: torch.Tensor, values: Any) -> None:
    """Copy ``values`` (as many elements as ``out``, its dtype: a numpy array, or a tensor on
    ``out``'s device) into ``out``, any layout. On a GPU the copy is finished before the Work
    completes (torch's future of a Python group records no CUDA event)."""
    with torch.no_grad():
        if isinstance(values, torch.Tensor):
            out.copy_(values.reshape(out.shape))
        else:
            out.copy_(from_numpy(np.ascontiguousarray(values)).view(out.shape))
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()


def _write_back(tensor: torch.Tensor, t: torch.Tensor | None) -> None:
    """An in-place result computed in a contiguous copy ``t`` of ``tensor``."""
    if t is not None and t.data_ptr() != tensor.data_ptr() and tensor.numel():
        with torch.no_grad():
            tensor.copy_(t)


def _numel_error(what: str, tensors: Sequence[Any], numel: int) -> str:
    bad = [i for i, x in enumerate(tensors)
           if not isinstance(x, torch.Tensor) or x.numel() != numel]
    if bad:
        return (f"{what}: tensor {bad[0]} of the list has "
                f"{getattr(tensors[bad[0]], 'shape', type(tensors[bad[0]]).__name__)}, but "
                f"every tensor must have the input's {numel} elements")
    return ""


class ProcessGroupRingflow(dist.ProcessGroup):
    """A torch.distributed process group whose collectives are ringflow's (see the module doc).

    ``ranks`` are the group's global ranks in group-rank order; ``process_set`` the ringflow
    set of those ranks; ``label`` names its operations (``torch.<label>.<n>``); ``owner``: this
    group started ringflow's engine, and its ``shutdown()`` stops it.
    """

    def __init__(self, rank: int, ranks: Sequence[int], process_set: ProcessSet, label: str,
                 gid: int, timeout_s: float, owner: bool = False) -> None:
        super().__init__(rank, len(ranks))
        self._ranks = list(ranks)
        self._ps = process_set
        self._label = label
        self._gid = gid
        self._timeout_s = timeout_s
        self._owner = owner
        self._seq = itertools.count()
        self._coalesced: list[Work] | None = None

    # identity -----------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # torch's C++ name (trampoline)
        return BACKEND

    def __repr__(self) -> str:
        return (f"ProcessGroupRingflow({self._label}, rank {self.rank()} of {self.size()}, "
                f"global ranks {self._ranks})")

    # helpers ------------------------------------------------------------------------------------
    def _name(self) -> str:
        return f"{ONCE}torch.{self._label}.{next(self._seq)}"  # never cached: never repeats

    def _global(self, group_rank: int, what: str) -> int:
        if not 0 <= int(group_rank) < len(self._ranks):
            raise TensorError(f"{what}: rank {group_rank} is not a rank of {self!r}")
        return self._ranks[int(group_rank)]

    def _work(self, name: str, handles: Sequence[Any],
              finish: Callable[[list[Any]], list[torch.Tensor]],
              opts: Any = None) -> Work:
        timeout = as_seconds(getattr(opts, "timeout", None), self._timeout_s)
        work = Work(name, handles, finish, timeout)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _submit(self, kind: str, array: Any, name: str, error: str = "", **fields: Any) -> Any:
        return submission.submit(kind, array, name, self._ps, error=error, **fields)

    def _group(self, kind: str, arrays: Sequence[Any], name: str, error: str = "",
               outs: Sequence[Any] | None = None, **fields: Any) -> Any:
        fields = {**fields, "error": error} if error else fields
        return submission.submit_group(kind, arrays, name, self._ps, outs, **fields)

    def _tag(self, tag: int) -> int:
        return int(tag) if self._gid == 0 else (self._gid << _TAG_BITS) + int(tag)

    # collectives --------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        name = self._name()
        op, error = _reduce_op(opts, "all_reduce")
        if len(tensors) != 1:
            error = error or f"all_reduce takes one tensor per call, got {len(tensors)}"
        tensor = tensors[0] if tensors else None
        arr, t = _array(tensor, "all_reduce's tensor")
        handle = self._submit("allreduce", arr, name, error, out=arr if t is not None else None,
                              **submission.scales(op, 1.0, 1.0))

        def finish(_: list[Any]) -> list[torch.Tensor]:
            _write_back(tensor, t)
            return [tensor]

        return self._work(name, [handle], finish, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        name = self._name()
        op, error = _reduce_op(opts, "all_reduce_coalesced")
        prepared = [_array(x, f"all_reduce_coalesced's tensor {i}") for i, x in enumerate(tensors)]
        arrays = [a for a, _ in prepared]
        outs = None if any(t is None for _, t in prepared) else arrays
        handle = self._group("allreduce", arrays, name, error, outs,
                             **submission.scales(op, 1.0, 1.0))

        def finish(_: list[Any]) -> list[torch.Tensor]:
            for x, (_, t) in zip(tensors, prepared, strict=True):
                _write_back(x, t)
            return list(tensors)

        return self._work(name, [handle], finish, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        root = self._global(getattr(opts, "rootRank", 0), "broadcast")
        name = self._name()
        error = "" if len(tensors) == 1 else f"broadcast takes one tensor, got {len(tensors)}"
        tensor = tensors[0] if tensors else None
        arr, t = _array(tensor, "broadcast's tensor")
        handle = self._submit("broadcast", arr, name, error, out=arr if t is not None else None,
                              root=root)

        def finish(_: list[Any]) -> list[torch.Tensor]:
            _write_back(tensor, t)
            return [tensor]

        return self._work(name, [handle], finish, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        root = self._global(getattr(opts, "rootRank", 0), "reduce")
        name = self._name()
        op, error = _reduce_op(opts, "reduce")
        tensor = tensors[0] if tensors else None
        arr, _ = _array(tensor, "reduce's tensor")
        handle = self._submit("reduce", arr, name, error, root=root,
                              **submission.scales(op, 1.0, 1.0))

        def finish(values: list[Any]) -> list[torch.Tensor]:
            if values[0] is not None:  # the root: the reduction; elsewhere the input stays
                _put(tensor, values[0])
            return [tensor]

        return self._work(name, [handle], finish, opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        name = self._name()
        tensor = input_tensors[0] if input_tensors else None
        outs = output_tensors[0] if output_tensors else []
        arr, _ = _array(tensor, "all_gather's input")
        error = ""
        if not isinstance(arr, Invalid):
            if len(outs) != self.size():
                error = (f"all_gather: the output list has {len(outs)} tensors for a group of "
                         f"{self.size()} ranks")
            else:
                error = _numel_error("all_gather's output list", outs, _numel(arr))
        handle = self._submit("allgather", _rows(arr), name, error)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            for out, row in zip(outs, values[0], strict=True):
                _put(out, row)
            return list(outs)

        return self._work(name, [handle], finish, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        name = self._name()
        arr, _ = _array(input, "all_gather_into_tensor's input")
        error = ""
        if not isinstance(arr, Invalid) and output.numel() != _numel(arr) * self.size():
            error = (f"all_gather_into_tensor: the output has {output.numel()} elements, but "
                     f"{self.size()} ranks x {_numel(arr)} input elements make "
                     f"{_numel(arr) * self.size()}")
        handle = self._submit("allgather", _rows(arr), name, error)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            _put(output, values[0])
            return [output]

        return self._work(name, [handle], finish, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Work:
        name = self._name()
        arrays = [_rows(_array(x, f"all_gather_into_tensor's input {i}")[0])
                  for i, x in enumerate(inputs)]
        bad = [i for i, (o, a) in enumerate(zip(outputs, arrays, strict=True))
               if not isinstance(a, Invalid) and o.numel() != _numel(a) * self.size()]
        error = (f"all_gather_into_tensor (coalesced): output {bad[0]} does not hold "
                 f"{self.size()} ranks' inputs") if bad else ""
        handle = self._group("allgather", arrays, name, error)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            for out, value in zip(outputs, values[0], strict=True):
                _put(out, value)
            return list(outputs)

        return self._work(name, [handle], finish, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Work:
        root = self._global(getattr(opts, "rootRank", 0), "gather")
        name = self._name()
        tensor = input_tensors[0] if input_tensors else None
        outs = output_tensors[0] if output_tensors else []
        arr, _ = _array(tensor, "gather's input")
        error = ""
        if runtime.rank() == root and not isinstance(arr, Invalid):
            if len(outs) != self.size():
                error = (f"gather: the root's gather_list has {len(outs)} tensors for a group "
                         f"of {self.size()} ranks")
            else:
                error = _numel_error("gather's gather_list", outs, _numel(arr))
        handle = self._submit("gather", _rows(arr), name, error, root=root)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            if values[0] is not None:
                for out, row in zip(outs, values[0], strict=True):
                    _put(out, row)
            return list(outs)

        return self._work(name, [handle], finish, opts)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:
        root = self._global(getattr(opts, "rootRank", 0), "scatter")
        name = self._name()
        out = output_tensors[0]
        error, splits = "", ()
        joined: Any = np.empty(0, np.uint8)
        if runtime.rank() == root:
            pieces = input_tensors[0] if input_tensors else []
            arrays = [_host(x, f"scatter's tensor {i}")[0] for i, x in enumerate(pieces)]
            invalid = [a for a in arrays if isinstance(a, Invalid)]
            if invalid:
                joined = invalid[0]
            elif len(arrays) != self.size():
                error = (f"scatter: the root's scatter_list has {len(arrays)} tensors for a "
                         f"group of {self.size()} ranks")
            elif len({a.dtype for a in arrays}) > 1:
                error = "scatter: the root's scatter_list mixes dtypes"
            else:
                error = _numel_error("scatter's scatter_list", pieces, out.numel())
                if not error:
                    joined = np.concatenate([a.reshape(-1) for a in arrays])
                    splits = tuple(a.size for a in arrays)
        handle = self._submit("scatter", joined, name, error, root=root, splits=splits)
        want = _host(out, "scatter's output")[0]

        def finish(values: list[Any]) -> list[torch.Tensor]:
            piece = np.asarray(values[0])
            if not isinstance(want, Invalid) and (piece.size != out.numel()
                                                  or piece.dtype != want.dtype):
                raise TensorError(
                    f"scatter {name!r}: rank {runtime.rank()}'s output is {out.dtype} with "
                    f"{out.numel()} elements, but the root sent {piece.dtype} with {piece.size}")
            _put(out, piece)
            return [out]

        return self._work(name, [handle], finish, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:
        name = self._name()
        op, error = _reduce_op(opts, "reduce_scatter")
        out = output_tensors[0]
        pieces = input_tensors[0] if input_tensors else []
        n, me = self.size(), self.rank()
        arrays = [_array(x, f"reduce_scatter's input {i}")[0] for i, x in enumerate(pieces)]
        invalid = [a for a in arrays if isinstance(a, Invalid)]
        sizes = [0 if isinstance(a, Invalid) else _numel(a) for a in arrays]
        if not error and not invalid and len(arrays) != n:
            error = (f"reduce_scatter: the input list has {len(arrays)} tensors for a group of "
                     f"{n} ranks")
        even = len(set(sizes)) <= 1
        if not error and not invalid and sizes[me] != out.numel():
            error = (f"reduce_scatter: input {me} has {sizes[me]} elements but the output "
                     f"{out.numel()}")
        if invalid or error:
            joined: Any = invalid[0] if invalid else np.empty(0, np.float32)
        else:
            joined = _cat(arrays)
        scales = submission.scales(op, 1.0, 1.0)
        if even:  # ringflow's reducescatter hands rank q row q of (n, m)
            handle = self._submit("reducescatter", _rows(joined, n), name, error, **scales)
        else:  # uneven pieces: reduce everything, keep this rank's piece
            handle = self._submit("allreduce", joined, name, error, **scales)
        start = sum(sizes[:me])

        def finish(values: list[Any]) -> list[torch.Tensor]:
            result = _flat(values[0])
            _put(out, result if even else result[start:start + out.numel()])
            return [out]

        return self._work(name, [handle], finish, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        name = self._name()
        op, error = _reduce_op(opts, "reduce_scatter_tensor")
        n = self.size()
        arr, _ = _array(input, "reduce_scatter_tensor's input")
        if not error and not isinstance(arr, Invalid) and _numel(arr) != n * output.numel():
            error = (f"reduce_scatter_tensor: the input has {_numel(arr)} elements, but a group "
                     f"of {n} ranks with outputs of {output.numel()} needs {n * output.numel()}")
        rows = arr if error else _rows(arr, n)
        handle = self._submit("reducescatter", rows, name, error,
                              **submission.scales(op, 1.0, 1.0))

        def finish(values: list[Any]) -> list[torch.Tensor]:
            _put(output, values[0])
            return [output]

        return self._work(name, [handle], finish, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        name = self._name()
        op, error = _reduce_op(opts, "reduce_scatter_tensor (coalesced)")
        n = self.size()
        arrays = [_array(x, f"reduce_scatter_tensor's input {i}")[0]
                  for i, x in enumerate(inputs)]
        bad = [i for i, (o, a) in enumerate(zip(outputs, arrays, strict=True))
               if not isinstance(a, Invalid) and _numel(a) != n * o.numel()]
        if bad and not error:
            error = (f"reduce_scatter_tensor (coalesced): input {bad[0]} does not hold "
                     f"{n} outputs")
        rows = [a if error else _rows(a, n) for a in arrays]
        handle = self._group("reducescatter", rows, name, error,
                             **submission.scales(op, 1.0, 1.0))

        def finish(values: list[Any]) -> list[torch.Tensor]:
            for out, value in zip(outputs, values[0], strict=True):
                _put(out, value)
            return list(outputs)

        return self._work(name, [handle], finish, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Work:
        name = self._name()
        n = self.size()
        arr, _ = _array(input, "all_to_all_single's input")
        error, splits = "", ()
        if not isinstance(arr, Invalid):
            rows = int(input.shape[0]) if input.dim() else 0
            if input_split_sizes:
                splits = tuple(int(s) for s in input_split_sizes)
            elif rows % n:
                error = (f"all_to_all_single: the input's {rows} rows do not split evenly among "
                         f"{n} ranks; pass input_split_sizes")
            else:
                splits = (rows // n,) * n
            arr = arr.reshape(rows, int(np.prod(input.shape[1:]))) if input.dim() else arr
        handle = self._submit("alltoall", arr, name, error, splits=splits)
        want = list(output_split_sizes)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            received, recv_splits = values[0]
            got = [int(s) for s in np.asarray(recv_splits).reshape(-1)]
            if (want and got != want) or _numel(received) != output.numel():
                raise TensorError(
                    f"all_to_all_single {name!r}: rank {runtime.rank()} received rows {got} "
                    f"({_numel(received)} elements) but its output expects "
                    f"{want or 'an even split'} ({output.numel()} elements)")
            _put(output, received)
            return [output]

        return self._work(name, [handle], finish, opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        name = self._name()
        n = self.size()
        arrays = [_array(x, f"all_to_all's input {i}")[0] for i, x in enumerate(input_tensors)]
        invalid = [a for a in arrays if isinstance(a, Invalid)]
        error = ""
        if not invalid and (len(arrays) != n or len(output_tensors) != n):
            error = (f"all_to_all: {len(arrays)} inputs and {len(output_tensors)} outputs for a "
                     f"group of {n} ranks; pass one of each per rank")
        if invalid or error:
            joined: Any = invalid[0] if invalid else np.empty(0, np.float32)
            splits: tuple[int, ...] = ()
        else:
            joined = _cat(arrays)
            splits = tuple(_numel(a) for a in arrays)
        handle = self._submit("alltoall", joined, name, error, splits=splits)

        def finish(values: list[Any]) -> list[torch.Tensor]:
            received, recv_splits = values[0]
            got = [int(s) for s in np.asarray(recv_splits).reshape(-1)]
            want = [x.numel() for x in output_tensors]
            if got != want:
                raise TensorError(f"all_to_all {name!r}: rank {runtime.rank()} received "
                                  f"{got} elements from the ranks, its outputs hold {want}")
            offsets = np.cumsum([0, *got])
            flat = _flat(received)
            for i, out in enumerate(output_tensors):
                _put(out, flat[offsets[i]:offsets[i + 1]])
            return list(output_tensors)

        return self._work(name, [handle], finish, opts)

    def barrier(self, opts: Any = None) -> Work:
        name = self._name()
        ps = self._ps.process_set_id
        handle = runtime.running().enqueue(Request(name, "barrier", process_set=ps))
        return self._work(name, [handle], lambda _: [], opts)

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Work:
        raise UnsupportedError("all_gather_coalesced (deprecated in torch) is not supported "
                                  "by the ringflow backend; use all_gather_into_tensor inside "
                                  "torch.distributed._coalescing_manager, or all_gather")

    # coalescing: torch.distributed._coalescing_manager(group, device) ---------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        if self._coalesced is not None:
            raise ConfigError("torch.distributed._coalescing_manager blocks do not nest")
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> Work:
        works, self._coalesced = self._coalesced or [], None
        return Work(f"torch.{self._label}.coalesced", works,
                    lambda _: [t for w in works for t in w.result()], self._timeout_s)

    # point to point -----------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Work:
        dst = self._global(dstRank, "send")
        tensor = tensors[0]
        arr, _ = _host(tensor, f"the tensor sent to rank {dst}")
        handle = start_send(arr, dst, self._tag(tag))
        return self._work(f"send to {dst} tag {tag}", [handle], lambda _: [tensor])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Work:
        src = self._global(srcRank, "recv")
        tensor = tensors[0]
        arr, t = _host(tensor, f"recv from rank {src}")
        if t is None:
            raise TensorError(str(arr))  # nothing was sent for it yet: this rank alone fails
        handle = start_recv(src, self._tag(tag), out=arr)

        def finish(_: list[Any]) -> list[torch.Tensor]:
            if tensor.is_cuda:
                _put(tensor, arr)
            else:
                _write_back(tensor, t)
            return [tensor]

        return self._work(f"recv from {src} tag {tag}", [handle], finish)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        raise UnsupportedError(
            "recv / irecv without src (from any source) is not supported by the ringflow "
            "backend: ringflow matches messages per (source, tag); pass src=")

    # groups -------------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int], timeout: Any = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None
                  ) -> ProcessGroupRingflow | None:
        """torch's ``new_group(ranks)`` (on every rank of the default group): a ringflow process
        set of ``ranks``; the members' group, None elsewhere.

        Raises:
            ConfigError: ``use_local_synchronization=True`` (only the members would call this,
                and ringflow adds a process set with every rank), or unsorted ranks
                (``sort_ranks=False``: ringflow orders a set's ranks increasingly).
        """
        if self._ranks != list(range(len(self._ranks))):
            raise ConfigError("new_group is called on the default group only")
        label = str(group_name)
        if not label.isdigit():
            raise ConfigError(
                "new_group(use_local_synchronization=True) is not supported by the ringflow "
                "backend: every rank of the default group must call new_group (the default)")
        ranks = [int(r) for r in ranks]
        if ranks != sorted(ranks):
            raise ConfigError(f"new_group(ranks={ranks}, sort_ranks=False): the ringflow backend "
                             "orders a group's ranks increasingly; pass them sorted")
        whole = ranks == self._ranks
        ps = global_process_set if whole else add_process_set(ProcessSet(ranks))
        me = runtime.rank()
        if me not in ranks:
            return None
        seconds = as_seconds(timeout, self._timeout_s)
        pg = ProcessGroupRingflow(ranks.index(me), ranks, ps, f"pg{label}", int(label), seconds)
        pg._set_group_name(label)
        if group_desc:
            pg._set_group_desc(group_desc)
        return pg

    # lifecycle ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """``destroy_process_group()``: the group that started ringflow's engine stops it."""
        if self._owner:
            self._owner = False
            runtime.shutdown()

    def abort(self) -> None:
        self.shutdown()


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupRingflow:
    """torch's creator for backend ``"ringflow"`` (``extended_api``): join (or reuse) ringflow's
    engine as rank ``opts.group_rank`` of ``opts.group_size`` through ``opts.store``.

    Raises:
        ConfigError: a sub-group of a default group on another backend, or ringflow already
            runs as another rank or size.
        PeerError / RingflowTimeoutError: the other ranks could not be reached in time.
    """
    rank, size = int(opts.group_rank), int(opts.group_size)
    if list(opts.global_ranks_in_group or []):
        raise ConfigError(
            "new_group(backend='ringflow') under a default group of another backend is not "
            "supported: ringflow's sub-groups are process sets of its job; use "
            "init_process_group(backend='ringflow') and new_group(ranks)")
    timeout_s = as_seconds(opts.timeout, 1800.0)
    owner = False
    if runtime.is_initialized():
        if (runtime.rank(), runtime.size()) != (rank, size):
            raise ConfigError(
                f"init_process_group(backend='ringflow') as rank {rank} of {size}, but ringflow "
                f"already runs as rank {runtime.rank()} of {runtime.size()} in this process; "
                "call ringflow.shutdown() first, or pass the same rank and world size")
    else:
        store = TorchStore(opts.store, "ringflow/", Config.from_env().timeout_s,
                           _master_of(opts.store) or "127.0.0.1")
        runtime.init(rank=rank, size=size, store=store)
        owner = True
    label = str(opts.group_id) if str(opts.group_id).isdigit() else "0"
    return ProcessGroupRingflow(rank, list(range(size)), global_process_set, f"pg{label}", 0,
                                timeout_s, owner=owner)


def register() -> None:
    """Make ``backend="ringflow"`` known to torch.distributed (once per process)."""
    if hasattr(dist.Backend, BACKEND.upper()):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])

