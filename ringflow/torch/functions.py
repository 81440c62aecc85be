"""Broadcasting model and optimizer state, and moving arbitrary Python objects.

``broadcast_parameters`` and ``broadcast_optimizer_state`` start every broadcast at once and then
wait, so the engine fuses them. ``broadcast_object`` / ``allgather_object`` are the adapter kit's
(:mod:`ringflow._adapter`), shared with ``ringflow.tensorflow``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import ProcessSet, global_process_set, rank
from .._adapter import allgather_object, broadcast_object
from .mpi_ops import broadcast_async_, synchronize

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
]


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params``: a ``state_dict()`` or any mapping of names to tensors (broadcast in sorted-key
    order), or any iterable of tensors or of ``(name, tensor)`` pairs, taken in its order:
    ``model.parameters()`` and ``model.named_parameters()`` (generators), a list or tuple, an
    ``nn.ParameterList``; ``None`` entries are skipped. This is MegEngine's
    ``dist.bcast_list_(net.parameters())`` (root 0) as well as Horovod's call; Horovod takes only
    a dict or a list. ``root_rank`` is a global rank (default 0, MegEngine's root).

    Raises:
        ValueError: ``params`` is a single tensor (iterating it would broadcast its rows one by
            one), not iterable, or holds something other than a tensor.
    """
    items = _named_tensors(params)
    handles = [broadcast_async_(p, root_rank, name, process_set=process_set)
               for name, p in items if p is not None]
    for handle in handles:
        synchronize(handle)


def _named_tensors(params: Any) -> list[tuple[str | None, torch.Tensor | None]]:
    if isinstance(params, torch.Tensor):
        raise ValueError("broadcast_parameters got a single tensor; pass [tensor], "
                         "model.parameters() or model.state_dict()")
    if isinstance(params, (Mapping, torch.nn.ParameterDict)):
        items = sorted(params.items())
    else:
        try:
            entries = list(params)
        except TypeError:
            raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict(), "
                             "model.parameters() or model.named_parameters()") from None
        items = [p if isinstance(p, tuple) else (None, p) for p in entries]
    for i, entry in enumerate(items):
        if len(entry) != 2:
            raise ValueError(f"broadcast_parameters: entry {i} of params is a {len(entry)}-tuple, "
                             "not a tensor or a (name, tensor) pair")
        name, tensor = entry
        if not (name is None or isinstance(name, str)):
            raise ValueError(f"broadcast_parameters: entry {i} of params is named {name!r}; "
                             "names must be str")
        if not (tensor is None or isinstance(tensor, torch.Tensor)):
            raise ValueError(f"broadcast_parameters: entry {i} of params is a "
                             f"{type(tensor).__name__}, not a tensor")
    return items


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state with one zero-gradient step, as Horovod does.

    Horovod's trick, made harmless: the parameters (which the step may move through weight decay)
    are restored afterwards, and so are gradients that existed. A parameter that had none keeps
    the zero gradient, as under Horovod, whose users read it (Horovod's own
    test_broadcast_state_no_grad broadcasts it). ``DistributedOptimizer.step`` would
    synchronize, so the base class's ``step`` is called. Optimizers whose step needs more than a
    gradient (LBFGS needs a closure) keep their empty state.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for p in params:
        p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    step = getattr(type(optimizer), "_ringflow_base_step", None) or type(optimizer).step
    try:
        with torch.no_grad():
            step(optimizer)
    finally:
        with torch.no_grad():
            for p, data, grad in saved:
                p.copy_(data)
                if grad is not None:
                    p.grad = grad


def _state_items(optimizer: torch.optim.Optimizer) -> dict[tuple[int, int], dict[str, Any]]:
    """The state of each parameter, keyed by (group index, index in the group)."""
    return {(g, i): optimizer.state[p]
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"]) if p in optimizer.state}


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and param-group options equal ``root_rank``'s.

    Works for every optimizer of ``torch.optim``. An optimizer whose state is still empty first
    takes one zero-gradient step (Horovod's way to create the state; see
    :func:`_initialize_state`). Then the root describes its state -- per parameter and key, a
    tensor's shape and dtype, or any other value (a Python number, ``None``, a list) -- and sends
    that description with the param-group options (lr, betas, ...) as one pickled object; every
    rank makes its state match it (creating, replacing or dropping entries, so state present on
    some ranks only is handled), and the tensors are broadcast in place, fused. ``root_rank`` is
    a global rank. ``model`` is accepted as in Horovod (which uses it to find sparse embeddings
    for the initial step); the state the step creates does not depend on it.
    """
    del model
    if not optimizer.state:
        _initialize_state(optimizer)
    root = rank() == root_rank
    state = _state_items(optimizer)
    layout = None
    if root:
        layout = {key: {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v)
                        for k, v in entries.items()}
                  for key, entries in state.items()}
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    options, layout = broadcast_object((options, layout), root_rank,
                                       name="optimizer_state.layout", process_set=process_set)
    for group, opts in zip(optimizer.param_groups, options, strict=True):
        group.update(opts)
    tensors: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            want = layout.get((g, i))
            if want is None:
                optimizer.state.pop(p, None)
                continue
            entries = optimizer.state[p]
            for k in [k for k in entries if k not in want]:
                del entries[k]
            for k, (shape, kind) in sorted(want.items()):
                if shape == "value":
                    entries[k] = kind
                    continue
                have = entries.get(k)
                if not (torch.is_tensor(have) and tuple(have.shape) == shape
                        and have.dtype == kind):
                    entries[k] = have = torch.zeros(shape, dtype=kind)
                tensors.append((f"optimizer_state.{g}.{i}.{k}", have))
    broadcast_parameters(tensors, root_rank, process_set=process_set)
