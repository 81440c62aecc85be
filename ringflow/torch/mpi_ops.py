"""Collectives on torch tensors with Horovod 0.28's names, signatures and autograd rules.

Over 600 lines on purpose: one short function per Horovod name and form (``op``,
``op_async``, ``op_``) of twelve collectives, each converting tensors and calling the core; the
shared logic (names, ops, gradient rules) is in :mod:`ringflow._adapter`.

Every collective has Horovod's forms: ``op`` (synchronous and differentiable), ``op_async``
(returns a handle for :func:`poll` / :func:`synchronize`) and, where Horovod has them, ``op_`` /
``op_async_`` (in place). Tensors reach the engine without a copy (:mod:`._tensors`), CUDA
tensors included (they stay on their device, and so do the results); compression is the
engine's (it casts while fusing).

What is not torch-specific lives in the adapter kit (:mod:`ringflow._adapter`): op resolution,
names (``"<kind>.<name>"``; backward operations ``"<name>.grad"``), default splits, compression
dispatch and the gradient rule of each collective, which
:class:`_Collective` applies in ``backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ringflow as _rf

from .. import ProcessSet, global_process_set, submission
from .. import _adapter as kit
from ..compression import Compressor
from ..ops import Average, ReduceOp
from ._tensors import from_core, prepare, to_core
from .compression import Compression

__all__ = [
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "gather",
    "gather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reduce",
    "reduce_async",
    "reducescatter",
    "reducescatter_async",
    "scatter",
    "scatter_async",
    "sparse_allreduce_async",
    "synchronize",
]


class TorchHandle:
    """What an ``*_async`` call returns: the engine's handle plus how to build the torch result.

    ``finish`` runs once, on the caller's thread, when the result is first asked for (copying an
    in-place result back into a non-contiguous tensor, wrapping numpy outputs as tensors).
    """

    __slots__ = ("_done", "_finish", "_result", "core")

    def __init__(self, core: Any, finish: Callable[[Any], Any]) -> None:
        self.core = core
        self._finish = finish
        self._done = False
        self._result: Any = None

    def poll(self) -> bool:
        return self.core.poll()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._result = self._finish(self.core.wait(timeout))
            self._done = True
        return self._result

    def __repr__(self) -> str:
        return f"<TorchHandle {self.core!r}>"


def poll(handle: TorchHandle) -> bool:
    """True once the operation behind ``handle`` finished (synchronize will not block)."""
    return handle.poll()


def synchronize(handle: TorchHandle | Callable[[], Any]) -> Any:
    """Wait for ``handle`` and return its output (a tensor, a list, or a tuple for alltoall).

    A handle of :func:`sparse_allreduce_async` (a function, as in Horovod) is called.

    Raises:
        HorovodInternalError: the operation failed (a ringflow error of the same class and text
            on every rank).
    """
    return handle() if callable(handle) else handle.wait()


# starting operations -----------------------------------------------------------------------------
def _inplace_finish(tensor: torch.Tensor, t: torch.Tensor | None) -> Callable[[], None]:
    """Copy the result back where the engine wrote into a contiguous copy of ``tensor``."""
    if t is None or t.data_ptr() == tensor.data_ptr() or tensor.numel() == 0:
        return lambda: None

    def finish() -> None:
        with torch.no_grad():
            tensor.copy_(t)

    return finish


def _outputs(tensors: Sequence[Any], kind: str, inplace: bool
             ) -> tuple[list[Any], list[np.ndarray | None] | None, list[Any], list[Any]]:
    """(engine inputs, engine outputs or None, torch results, finishers) for ``tensors``."""
    prepared = [prepare(x, f"{kind} input {i}") for i, x in enumerate(tensors)]
    arrays = [a for a, _ in prepared]
    if inplace:
        outs: list[Any] = [a if t is not None else None for a, t in prepared]
        results = list(tensors)
        finishers = [_inplace_finish(x, t) for x, (_, t) in zip(tensors, prepared, strict=True)]
    else:
        results = [None if t is None else t.new_empty(t.shape) for _, t in prepared]
        outs = [None if r is None else to_core(r) for r in results]
        finishers = []
    # An input that failed validation: its request fails the whole operation on every rank.
    return arrays, (None if any(o is None for o in outs) else outs), results, finishers


def _finished(results: list[Any], finishers: list[Any], group: bool) -> Callable[[Any], Any]:
    def finish(_: Any) -> Any:
        for f in finishers:
            f()
        return results if group else results[0]

    return finish


def _wrap(result: Any) -> torch.Tensor:
    return from_core(result)


def _allreduce_async(tensors: Sequence[Any], group: bool, inplace: bool, name: str | None,
                     op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet,
                     compression: Any) -> TorchHandle:
    arrays, outs, results, finishers = _outputs(tensors, "allreduce", inplace)
    core_compression = compression if isinstance(compression, Compressor) else Compression.none
    kwargs = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale,
              "process_set": process_set, "compression": core_compression}
    if group:
        core = _rf.grouped_allreduce_async(arrays, kit.op_name("grouped_allreduce", name),
                                           outs=outs, **kwargs)
    else:
        core = _rf.allreduce_async(arrays[0], kit.op_name("allreduce", name),
                                   out=None if outs is None else outs[0], **kwargs)
    return TorchHandle(core, _finished(results, finishers, group))


def allreduce_many_async_(tensors: Sequence[torch.Tensor], names: Sequence[str | None],
                          op: ReduceOp, prescale: float, postscale: float,
                          process_set: ProcessSet, compression: Compressor) -> list[TorchHandle]:
    """In-place allreduces of ``tensors``, each its own operation, handed to the engine in one
    call (:func:`ringflow.submission.submit_many`): a DistributedOptimizer's bucket."""
    arrays, outs, finishes = [], [], []
    for tensor in tensors:
        (array,), out, results, finishers = _outputs([tensor], "allreduce", True)
        arrays.append(array)
        outs.append(None if out is None else out[0])
        finishes.append(_finished(results, finishers, False))
    fields = submission.scales(op, prescale, postscale)
    fields["compression"] = compression.name
    cores = submission.submit_many("allreduce", arrays,
                                   [kit.op_name("allreduce", n) for n in names], process_set,
                                   outs, fields)
    return [TorchHandle(core, finish) for core, finish in zip(cores, finishes, strict=True)]


def _allgather_async(tensors: Sequence[Any], group: bool, name: str | None,
                     process_set: ProcessSet) -> TorchHandle:
    arrays = [prepare(x, f"allgather input {i}")[0] for i, x in enumerate(tensors)]
    if group:
        core = _rf.grouped_allgather_async(arrays, kit.op_name("grouped_allgather", name),
                                           process_set=process_set)
        return TorchHandle(core, lambda res: [_wrap(r) for r in res])
    core = _rf.allgather_async(arrays[0], kit.op_name("allgather", name), process_set=process_set)
    return TorchHandle(core, _wrap)


def _broadcast_async(tensor: Any, root_rank: int, name: str | None, process_set: ProcessSet,
                     inplace: bool) -> TorchHandle:
    arrays, outs, results, finishers = _outputs([tensor], "broadcast", inplace)
    core = _rf.broadcast_async(arrays[0], root_rank, kit.op_name("broadcast", name),
                               process_set=process_set, out=None if outs is None else outs[0])
    return TorchHandle(core, _finished(results, finishers, False))


def _reducescatter_async(tensors: Sequence[Any], group: bool, name: str | None, op: ReduceOp,
                         process_set: ProcessSet, prescale: float, postscale: float,
                         compression: Compressor = Compression.none) -> TorchHandle:
    arrays = [prepare(x, f"reducescatter input {i}")[0] for i, x in enumerate(tensors)]
    kwargs = {"op": op, "process_set": process_set, "prescale_factor": prescale,
              "postscale_factor": postscale, "compression": compression}
    if group:
        core = _rf.grouped_reducescatter_async(
            arrays, kit.op_name("grouped_reducescatter", name), **kwargs)
        return TorchHandle(core, lambda res: [_wrap(r) for r in res])
    core = _rf.reducescatter_async(arrays[0], kit.op_name("reducescatter", name), **kwargs)
    return TorchHandle(core, _wrap)


# autograd ----------------------------------------------------------------------------------------
class _Collective(torch.autograd.Function):
    """A differentiable collective: ``run`` computes it, the kit's rule for ``spec.kind`` is
    its backward. ``run(tensors) -> (outputs, spec)``; outputs after ``differentiable`` of them
    (alltoall's received splits) are marked non-differentiable."""

    @staticmethod
    def forward(ctx: Any, spec: kit.Spec, run: Callable[..., Any], differentiable: int,
                *tensors: torch.Tensor) -> Any:
        outs, ctx.spec = run(tensors)
        ctx.shapes = [t.shape for t in tensors]
        ctx.mark_non_differentiable(*outs[differentiable:])
        ctx.differentiable = differentiable
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        dys = [g.contiguous() for g in grads[:ctx.differentiable]]
        dxs = kit.GRADIENTS[ctx.spec.kind](_OPS, dys, ctx.spec)
        return (None, None, None, *(g.reshape(s) for g, s in zip(dxs, ctx.shapes, strict=True)))


def _apply(spec: kit.Spec, run: Callable[..., Any], tensors: Sequence[torch.Tensor],
           differentiable: int | None = None) -> tuple[torch.Tensor, ...]:
    n = len(tensors) if differentiable is None else differentiable
    return _Collective.apply(spec, run, n, *tensors)


class _TorchOps:
    """The kit's :class:`~ringflow._adapter.Ops` on torch tensors (differentiable collectives,
    so that second derivatives work too)."""

    def allreduce(self, xs: list[torch.Tensor], op: ReduceOp, prescale: float, postscale: float,
                  process_set: ProcessSet, name: str | None) -> list[torch.Tensor]:
        if len(xs) == 1:
            return [allreduce(xs[0], name=name, op=op, prescale_factor=prescale,
                              postscale_factor=postscale, process_set=process_set)]
        return grouped_allreduce(xs, name=name, op=op, prescale_factor=prescale,
                                 postscale_factor=postscale, process_set=process_set)

    def allgather(self, xs: list[torch.Tensor], process_set: ProcessSet,
                  name: str | None) -> list[torch.Tensor]:
        if len(xs) == 1:
            return [allgather(xs[0], name=name, process_set=process_set)]
        return grouped_allgather(xs, name=name, process_set=process_set)

    def alltoall(self, x: torch.Tensor, splits: Any, process_set: ProcessSet,
                 name: str | None) -> torch.Tensor:
        return alltoall(x, splits, name=name, process_set=process_set)[0]

    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    def zeros_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def own_rows(self, xs: list[torch.Tensor], rows: Any, process_set: ProcessSet,
                 name: str | None) -> list[torch.Tensor]:
        counts = synchronize(_allgather_async([torch.tensor([rows], dtype=torch.int64)], False,
                                              name, process_set))
        starts = counts[:process_set.rank()].sum(dim=0)
        return [x.narrow(0, int(start), n) for x, start, n in zip(xs, starts, rows, strict=True)]


_OPS = _TorchOps()


# allreduce ---------------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    compression: Any = Compression.none) -> TorchHandle:
    """Start reducing ``tensor`` over ``process_set`` into a new tensor (default op Average).

    ``compression`` is a ringflow extension: a core compressor makes the engine send 16 bits.
    """
    return _allreduce_async([tensor], False, False, name, kit.resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set, compression)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                     compression: Any = Compression.none) -> TorchHandle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns ``tensor`` itself."""
    return _allreduce_async([tensor], False, True, name, kit.resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set, compression)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``process_set`` and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped_allreduce(tensors: Sequence[torch.Tensor], group: bool, name: str | None,
                       op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet,
                       compression: Any) -> list[torch.Tensor]:
    spec = kit.Spec("allreduce", name, process_set, op, prescale, postscale)

    def reduce(xs: Sequence[torch.Tensor], core: Compressor) -> list[torch.Tensor]:
        def run(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], kit.Spec]:
            outs = synchronize(_allreduce_async(ts, group, False, name, op, prescale, postscale,
                                                process_set, core))
            return (outs if group else [outs]), spec

        return list(_apply(spec, run, xs))

    return kit.compressed(compression, tensors, reduce)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ``process_set`` (default Average); differentiable.

    ``compression``: ``Compression.fp16`` / ``bf16`` make the engine send 16-bit values; any other
    Horovod-style compressor is applied around the collective. A sparse COO tensor takes
    :func:`sparse_allreduce_async`'s path (ringflow extension; Horovod raises ValueError).
    """
    op = kit.resolve_op(op, average)
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        return sparse_allreduce_async(tensor, name, op, process_set, prescale_factor,
                                      postscale_factor)()
    return _grouped_allreduce([tensor], False, name, op, prescale_factor, postscale_factor,
                              process_set, compression)[0]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: Any = Compression.none) -> TorchHandle:
    """Start reducing a list of tensors, negotiated together and fused into few buffers."""
    return _allreduce_async(tensors, True, False, name, kit.resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set, compression)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set,
                             compression: Any = Compression.none) -> TorchHandle:
    """In-place form of :func:`grouped_allreduce_async`."""
    return _allreduce_async(tensors, True, True, name, kit.resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set, compression)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors together; differentiable."""
    return _grouped_allreduce(tensors, True, name, kit.resolve_op(op, average), prescale_factor,
                              postscale_factor, process_set, compression)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> Callable[[], torch.Tensor]:
    """Start reducing the sparse COO ``tensor``: every rank's indices and values are allgathered
    (Average divides the values by the set size); returns a function that waits and gives the
    coalesced sparse sum, as Horovod's returns one (Horovod's result is not coalesced; the
    dense values are the same).
    """
    scale = kit.sparse_scale(kit.resolve_op(op, None), prescale_factor, postscale_factor,
                             process_set, name)
    t = tensor.coalesce()
    started = _allgather_async([t.values(), t.indices().t().contiguous()], True,
                               kit.op_name("sparse", name), process_set)

    def result() -> torch.Tensor:
        values, indices = synchronize(started)
        if scale != 1.0:
            values = values * scale
        return torch.sparse_coo_tensor(indices.t(), values, t.size(),
                                       check_invariants=True).coalesce()

    return result


# allgather ---------------------------------------------------------------------------------------
def _rows(x: Any) -> int:
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else 1


def _allgather(tensors: Sequence[torch.Tensor], group: bool, name: str | None,
               process_set: ProcessSet) -> list[torch.Tensor]:
    spec = kit.Spec("allgather", name, process_set, rows=[_rows(x) for x in tensors])

    def run(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], kit.Spec]:
        outs = synchronize(_allgather_async(ts, group, name, process_set))
        return (outs if group else [outs]), spec

    return list(_apply(spec, run, tensors))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dims may differ)."""
    return _allgather_async([tensor], False, name, process_set)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""
    return _allgather([tensor], False, name, process_set)[0]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    return _allgather_async(tensors, True, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors together; differentiable."""
    return _allgather(tensors, True, name, process_set)


# broadcast ---------------------------------------------------------------------------------------
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start copying ``root_rank``'s tensor into a new tensor on every rank of ``process_set``.

    ``root_rank`` is a global rank (as in Horovod 0.28) and must be a member of the set.
    """
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """In-place form of :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank gets ``root_rank``'s ``tensor`` as a new tensor; differentiable."""
    spec = kit.Spec("broadcast", name, process_set, root=int(root_rank))

    def run(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], kit.Spec]:
        return [synchronize(_broadcast_async(ts[0], root_rank, name, process_set, False))], spec

    return _apply(spec, run, [tensor])[0]


# alltoall ----------------------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start sending ``splits[d]`` rows of ``tensor`` to rank ``d`` of ``process_set``.

    Without ``splits`` every rank gets an equal share of the rows; a first dimension that is not
    a multiple of the set's size fails the operation on every rank with a TensorError (a
    ValueError, as Horovod's). :func:`synchronize` returns ``(received rows, received splits as
    an int32 tensor)``.
    """
    arr, _ = prepare(tensor, "alltoall input")
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().reshape(-1).tolist()
    core = _rf.alltoall_async(arr, splits=splits, name=kit.op_name("alltoall", name),
                              process_set=process_set)

    def finish(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, received = result
        return _wrap(rows), torch.tensor([int(s) for s in received], dtype=torch.int32)

    return TorchHandle(core, finish)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows of ``tensor`` to every rank and gather theirs; differentiable.

    Returns the received rows, and also the received splits when ``splits`` was given (Horovod).
    """
    spec = kit.Spec("alltoall", name, process_set)

    def run(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], kit.Spec]:
        rows, received = synchronize(alltoall_async(ts[0], splits, name, process_set))
        return [rows, received], kit.Spec("alltoall", name, process_set, received=received)

    rows, received = _apply(spec, run, [tensor], differentiable=1)
    return rows if splits is None else (rows, received)


# reducescatter -----------------------------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Start reducing ``tensor``; each rank receives its share of rows (lower ranks the rest)."""
    return _reducescatter_async([tensor], False, name, kit.resolve_op(op, None), process_set,
                                prescale_factor, postscale_factor)


def _reducescatter(tensors: Sequence[torch.Tensor], group: bool, name: str | None, op: ReduceOp,
                   process_set: ProcessSet, prescale: float, postscale: float,
                   compression: Any) -> list[torch.Tensor]:
    op = kit.resolve_op(op, None)
    spec = kit.Spec("reducescatter", name, process_set, op, prescale, postscale)

    def reduce(xs: Sequence[torch.Tensor], core: Compressor) -> list[torch.Tensor]:
        def run(ts: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], kit.Spec]:
            outs = synchronize(_reducescatter_async(ts, group, name, op, process_set, prescale,
                                                    postscale, core))
            return (outs if group else [outs]), spec

        return list(_apply(spec, run, xs))

    return kit.compressed(compression, tensors, reduce)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` and keep this rank's share of rows; differentiable."""
    return _reducescatter([tensor], False, name, op, process_set, prescale_factor,
                          postscale_factor, compression)[0]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    return _reducescatter_async(tensors, True, name, kit.resolve_op(op, None), process_set,
                                prescale_factor, postscale_factor)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter a list of tensors together; differentiable."""
    return _reducescatter(tensors, True, name, op, process_set, prescale_factor,
                          postscale_factor, compression)


# synchronization ---------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Stop contributing data until every rank joined; returns the last rank to join.

    ``device`` is accepted for Horovod compatibility: a joined rank's zeros go on the device
    its earlier tensors were on (see :func:`ringflow.devices.joined_like`).
    """
    return _rf.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    _rf.barrier(process_set=process_set)


# reduce, gather, scatter (to and from a root; not differentiable) -------------------------------
# The core returns None off the root; these return an empty tensor there instead (the same in
# ringflow.tensorflow, whose graph ops must return a tensor), so a result never looks like data.
def _empty_off_root(like: torch.Tensor, rows: bool) -> Callable[[Any], torch.Tensor]:
    shape = (0, *like.shape[1:]) if rows and like.dim() else (0,)

    def finish(result: Any) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype) if result is None else _wrap(result)

    return finish


def reduce_async(tensor: torch.Tensor, root_rank: int, op: ReduceOp = Average,
                 name: str | None = None, process_set: ProcessSet = global_process_set,
                 prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> TorchHandle:
    """Start reducing ``tensor`` over ``process_set`` onto ``root_rank`` (a global rank)."""
    arr, _ = prepare(tensor, "reduce input")
    core = _rf.reduce_async(arr, root_rank, op, kit.op_name("reduce", name), process_set,
                            prescale_factor, postscale_factor)
    return TorchHandle(core, _empty_off_root(tensor, rows=False))


def reduce(tensor: torch.Tensor, root_rank: int, op: ReduceOp = Average, name: str | None = None,
           process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
           postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction on ``root_rank``; an empty tensor on the other ranks."""
    return synchronize(reduce_async(tensor, root_rank, op, name, process_set, prescale_factor,
                                    postscale_factor))


def gather_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                 process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start concatenating every rank's ``tensor`` (first dimensions may differ) on the root."""
    arr, _ = prepare(tensor, "gather input")
    core = _rf.gather_async(arr, root_rank, kit.op_name("gather", name), process_set)
    return TorchHandle(core, _empty_off_root(tensor, rows=True))


def gather(tensor: torch.Tensor, root_rank: int, name: str | None = None,
           process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The concatenation on ``root_rank``; a tensor of no rows on the other ranks."""
    return synchronize(gather_async(tensor, root_rank, name, process_set))


def scatter_async(tensors: Sequence[torch.Tensor] | None, root_rank: int,
                  name: str | None = None,
                  process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start handing piece ``q`` of the root's ``tensors`` to rank ``q`` of the set."""
    pieces = None if tensors is None else [prepare(t, f"scatter input {i}")[0]
                                           for i, t in enumerate(tensors)]
    core = _rf.scatter_async(pieces, root_rank, kit.op_name("scatter", name), process_set)
    return TorchHandle(core, _wrap)


def scatter(tensors: Sequence[torch.Tensor] | None, root_rank: int, name: str | None = None,
            process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """This rank's piece of the root's ``tensors`` (one per rank of the set; ignored elsewhere)."""
    return synchronize(scatter_async(tensors, root_rank, name, process_set))
