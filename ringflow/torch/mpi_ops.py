"""Collectives on torch tensors with Horovod 0.28's names, signatures and autograd rules.

Every collective has three forms, as in ``horovod.torch``: ``op`` (synchronous and
differentiable), ``op_async`` (returns a handle for :func:`poll` / :func:`synchronize`) and, where
Horovod has them, ``op_`` / ``op_async_`` (in place). Tensors reach the engine without a copy
(:mod:`ringflow.torch._tensors`); compression is the engine's (it casts while fusing).

Names: a named operation travels as ``"<op>.<name>"`` (Horovod's C++ layer prefixes names the same
way), so a broadcast and an allreduce may share a user name. The backward operation of a named
forward one is named ``"<name>.grad"``; anonymous operations get the core's deterministic names.

Gradients (Horovod 0.28's definitions, for the loss summed over ranks *as Horovod assumes it*):

- allreduce: allreduce of the gradient with the same op and scale factors;
- grouped_allreduce: grouped allreduce of the gradients;
- allgather: the rows of ``allreduce(grad, Average)`` that this rank contributed (Horovod averages
  here since PR #2687: every rank's loss is taken to be an average);
- broadcast: ``allreduce(grad, Average)`` on the root, zeros elsewhere (as Horovod);
- alltoall: alltoall of the gradient with the received splits;
- reducescatter: allgather of the gradient, times ``prescale * postscale`` and divided by the set
  size for Average (the exact derivative; Horovod's scaling is the same for Sum and Average).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ringflow as _rf

from .. import ProcessSet, global_process_set
from ..compression import Compressor
from ..ops import Average, ReduceOp, Sum
from ._tensors import from_numpy, prepare, to_numpy
from .compression import Compression

__all__ = [
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "join",
    "poll", "reducescatter", "reducescatter_async", "synchronize",
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


def synchronize(handle: TorchHandle) -> Any:
    """Wait for ``handle`` and return its output (a tensor, a list, or a tuple for alltoall).

    Raises:
        RingflowError: the operation failed (same class and text on every rank).
    """
    return handle.wait()


# helpers -------------------------------------------------------------------------------------
def _op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's handling of the deprecated ``average`` flag next to ``op``."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else ReduceOp(op)


def _named(prefix: str, name: str | None) -> str | None:
    return None if name is None else f"{prefix}.{name}"


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def _core_compression(compression: Any) -> Compressor:
    return compression if isinstance(compression, Compressor) else Compression.none


def _inplace_finish(tensor: torch.Tensor, t: torch.Tensor | None) -> Callable[[Any], Any]:
    if t is None or t.data_ptr() == tensor.data_ptr() or tensor.numel() == 0:
        return lambda _: tensor

    def finish(_: Any) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(t)
        return tensor

    return finish


def _new_output(t: torch.Tensor | None) -> tuple[torch.Tensor | None, np.ndarray | None]:
    if t is None:
        return None, None
    out = torch.empty(t.shape, dtype=t.dtype)
    return out, to_numpy(out)


# allreduce -----------------------------------------------------------------------------------
def _allreduce_async(tensor: Any, output: str, name: str | None, op: ReduceOp,
                     prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                     compression: Any) -> TorchHandle:
    arr, t = prepare(tensor, f"allreduce input {name or ''}".rstrip())
    if output == "inplace":
        out, finish = (arr if t is not None else None), _inplace_finish(tensor, t)
    else:
        result, out = _new_output(t)
        finish = lambda _: result  # noqa: E731
    core = _rf.allreduce_async(arr, name=_named("allreduce", name), op=op,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               process_set=process_set,
                               compression=_core_compression(compression), out=out)
    return TorchHandle(core, finish)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    compression: Any = Compression.none) -> TorchHandle:
    """Start reducing ``tensor`` over ``process_set`` into a new tensor (default op Average).

    ``compression`` is a ringflow extension: a core compressor makes the engine send 16 bits.
    """
    return _allreduce_async(tensor, "new", name, _op(op, average), prescale_factor,
                            postscale_factor, process_set, compression)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                     compression: Any = Compression.none) -> TorchHandle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns ``tensor`` itself."""
    return _allreduce_async(tensor, "inplace", name, _op(op, average), prescale_factor,
                            postscale_factor, process_set, compression)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``process_set`` and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose backward is the allreduce of the gradient (same op and scales)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float, process_set: ProcessSet, compression: Any) -> torch.Tensor:
        ctx.args = (name, op, prescale, postscale, process_set)
        return synchronize(_allreduce_async(tensor, "new", name, op, prescale, postscale,
                                            process_set, compression))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, op, prescale, postscale, process_set = ctx.args
        out = synchronize(_allreduce_async(grad, "new", _grad_name(name), op, prescale,
                                           postscale, process_set, Compression.none))
        return (out, None, None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ``process_set`` (default Average); differentiable.

    ``compression``: ``Compression.fp16`` / ``bf16`` make the engine send 16-bit values; any other
    Horovod-style compressor is applied around the collective.
    """
    op = _op(op, average)
    if isinstance(compression, Compressor):
        return HorovodAllreduce.apply(tensor, name, op, prescale_factor, postscale_factor,
                                      process_set, compression)
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                                 process_set, Compression.none)
    return compression.decompress(out, ctx)


# grouped allreduce ---------------------------------------------------------------------------
def _grouped_allreduce_async(tensors: Sequence[Any], inplace: bool, name: str | None,
                             op: ReduceOp, prescale: float, postscale: float,
                             process_set: ProcessSet, compression: Any) -> TorchHandle:
    prepared = [prepare(x, f"grouped_allreduce input {i}") for i, x in enumerate(tensors)]
    arrays = [a for a, _ in prepared]
    if inplace:
        outs = [a if t is not None else None for a, t in prepared]
        finishers = [_inplace_finish(x, t) for x, (_, t) in zip(tensors, prepared, strict=False)]
        results: list[Any] = list(tensors)
    else:
        made = [_new_output(t) for _, t in prepared]
        outs = [o for _, o in made]
        results = [r for r, _ in made]
        finishers = []
    if any(o is None for o in outs):
        outs = None  # a failed input: let the core fail the whole group on every rank
    core = _rf.grouped_allreduce_async(arrays, name=_named("allreduce", name), op=op,
                                       prescale_factor=prescale, postscale_factor=postscale,
                                       process_set=process_set,
                                       compression=_core_compression(compression), outs=outs)

    def finish(_: Any) -> list[torch.Tensor]:
        for f in finishers:
            f(None)
        return results

    return TorchHandle(core, finish)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            compression: Any = Compression.none) -> TorchHandle:
    """Start reducing a list of tensors, negotiated together and fused into few buffers."""
    return _grouped_allreduce_async(tensors, False, name, _op(op, average), prescale_factor,
                                    postscale_factor, process_set, compression)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set,
                             compression: Any = Compression.none) -> TorchHandle:
    """In-place form of :func:`grouped_allreduce_async`."""
    return _grouped_allreduce_async(tensors, True, name, _op(op, average), prescale_factor,
                                    postscale_factor, process_set, compression)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: ProcessSet, compression: Any, *tensors: torch.Tensor) -> Any:
        ctx.args = (name, op, prescale, postscale, process_set)
        return tuple(synchronize(_grouped_allreduce_async(
            tensors, False, name, op, prescale, postscale, process_set, compression)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name, op, prescale, postscale, process_set = ctx.args
        out = synchronize(_grouped_allreduce_async(grads, False, _grad_name(name), op, prescale,
                                                   postscale, process_set, Compression.none))
        return (None, None, None, None, None, None, *out)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors together; differentiable."""
    op = _op(op, average)
    if isinstance(compression, Compressor):
        return list(HorovodGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                                  process_set, compression, *tensors))
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                         process_set, Compression.none, *(p for p, _ in pairs))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=False)]


# allgather -----------------------------------------------------------------------------------
def _wrap(result: Any) -> torch.Tensor:
    return from_numpy(np.asarray(result))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dims may differ)."""
    arr, _ = prepare(tensor, f"allgather input {name or ''}".rstrip())
    core = _rf.allgather_async(arr, name=_named("allgather", name), process_set=process_set)
    return TorchHandle(core, _wrap)


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.dim = int(tensor.shape[0]) if tensor.dim() else 1
        ctx.args = (name, process_set)
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, process_set = ctx.args
        reduced = allreduce(grad, name=_grad_name(name), op=Average, process_set=process_set)
        dims = synchronize(allgather_async(torch.tensor([ctx.dim], dtype=torch.int64),
                                           _grad_name(name and f"{name}.dims"), process_set))
        offset = int(dims[: process_set.rank()].sum())
        return reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    arrays = [prepare(x, f"grouped_allgather input {i}")[0] for i, x in enumerate(tensors)]
    core = _rf.grouped_allgather_async(arrays, name=_named("allgather", name),
                                       process_set=process_set)
    return TorchHandle(core, lambda res: [_wrap(r) for r in res])


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.dims = [int(t.shape[0]) if t.dim() else 1 for t in tensors]
        ctx.args = (name, process_set)
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), name=_grad_name(name), op=Average,
                                    process_set=process_set)
        dims = synchronize(allgather_async(torch.tensor([ctx.dims], dtype=torch.int64),
                                           _grad_name(name and f"{name}.dims"), process_set))
        offsets = dims[: process_set.rank()].sum(dim=0)
        return (None, None, *(g.narrow(0, int(o), d)
                              for g, o, d in zip(reduced, offsets, ctx.dims, strict=False)))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather a list of tensors together; differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# broadcast -----------------------------------------------------------------------------------
def _broadcast_async(tensor: Any, root_rank: int, name: str | None, process_set: ProcessSet,
                     inplace: bool) -> TorchHandle:
    arr, t = prepare(tensor, f"broadcast input {name or ''}".rstrip())
    if inplace:
        out, finish = (arr if t is not None else None), _inplace_finish(tensor, t)
    else:
        result, out = _new_output(t)
        finish = lambda _: result  # noqa: E731
    core = _rf.broadcast_async(arr, root_rank, name=_named("broadcast", name),
                               process_set=process_set, out=out)
    return TorchHandle(core, finish)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start copying ``root_rank``'s tensor into a new tensor on every rank.

    ``root_rank`` is a rank *within* ``process_set`` (the same as the global rank for the global
    set).
    """
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """In-place form of :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (root_rank, name, process_set)
        return synchronize(_broadcast_async(tensor, root_rank, name, process_set, False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        root_rank, name, process_set = ctx.args
        reduced = allreduce(grad, name=_grad_name(name), op=Average, process_set=process_set)
        if process_set.rank() != root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank gets ``root_rank``'s ``tensor`` as a new tensor; differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# alltoall ------------------------------------------------------------------------------------
def _splits_list(tensor: Any, splits: Any, process_set: ProcessSet) -> list[int] | None:
    if splits is not None:
        return [int(s) for s in np.asarray(
            splits.detach().cpu().numpy() if isinstance(splits, torch.Tensor) else splits
        ).reshape(-1)]
    if isinstance(tensor, torch.Tensor) and tensor.dim():
        n, rows = process_set.size(), int(tensor.shape[0])
        return [rows // n + (1 if d < rows % n else 0) for d in range(n)]
    return None


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start sending ``splits[d]`` rows of ``tensor`` to rank ``d`` of ``process_set``.

    Without ``splits`` the first dimension is divided as evenly as possible, lower ranks first.
    :func:`synchronize` returns ``(received rows, received splits as an int32 tensor)``.
    """
    arr, _ = prepare(tensor, f"alltoall input {name or ''}".rstrip())
    split_list = _splits_list(tensor, splits, process_set)
    core = _rf.alltoall_async(arr, splits=split_list, name=_named("alltoall", name),
                              process_set=process_set)

    def finish(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, received = result
        return _wrap(rows), torch.tensor([int(s) for s in received], dtype=torch.int32)

    return TorchHandle(core, finish)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.args = (received, name, process_set)
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *dead: Any) -> tuple[Any, ...]:
        received, name, process_set = ctx.args
        out, _ = synchronize(alltoall_async(grad, received, _grad_name(name), process_set))
        return out, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows of ``tensor`` to every rank and gather theirs; differentiable.

    Returns the received rows, and also the received splits when ``splits`` was given (Horovod).
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# reducescatter -------------------------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Start reducing ``tensor``; each rank receives its share of rows (lower ranks the rest)."""
    arr, _ = prepare(tensor, f"reducescatter input {name or ''}".rstrip())
    core = _rf.reducescatter_async(arr, name=_named("reducescatter", name), op=_op(op, None),
                                   process_set=process_set, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor)
    return TorchHandle(core, _wrap)


def _scatter_grad(grad: torch.Tensor, name: str | None, op: ReduceOp, scale: float,
                  process_set: ProcessSet) -> torch.Tensor:
    out = allgather(grad, name=_grad_name(name), process_set=process_set)
    if op == Average:
        scale /= process_set.size()
    return out * scale if scale != 1.0 else out


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                process_set: ProcessSet, prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (name, op, process_set, prescale * postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, op, process_set, scale = ctx.args
        return _scatter_grad(grad, name, op, scale, process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` and keep this rank's share of rows; differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    arrays = [prepare(x, f"grouped_reducescatter input {i}")[0] for i, x in enumerate(tensors)]
    core = _rf.grouped_reducescatter_async(
        arrays, name=_named("reducescatter", name), op=_op(op, None), process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return TorchHandle(core, lambda res: [_wrap(r) for r in res])


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, process_set: ProcessSet,
                prescale: float, postscale: float, *tensors: torch.Tensor) -> Any:
        ctx.args = (name, op, process_set, prescale * postscale)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set,
                                                             prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name, op, process_set, scale = ctx.args
        outs = grouped_allgather(list(grads), name=_grad_name(name), process_set=process_set)
        if op == Average:
            scale /= process_set.size()
        return (None, None, None, None, None, *(o * scale for o in outs))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter a list of tensors together; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *(p for p, _ in pairs))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs, strict=False)]


# synchronization -----------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Stop contributing data until every rank joined; returns the last rank to join.

    ``device`` is accepted for Horovod compatibility (ringflow's zeros live on the CPU).
    """
    return _rf.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has called barrier()."""
    _rf.barrier(process_set=process_set)
