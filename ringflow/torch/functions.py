"""Broadcasting model and optimizer state, and moving arbitrary Python objects.

``broadcast_parameters`` and ``broadcast_optimizer_state`` start every broadcast at once and then
wait, so the engine fuses them. Objects travel as pickles (cloudpickle when installed, as Horovod)
in uint8 tensors; they are unpickled only after the job's connections proved the shared secret.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

from .. import ProcessSet, global_process_set
from .mpi_ops import allgather, broadcast_, broadcast_async_, synchronize

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
]

try:  # cloudpickle handles lambdas and local classes, as in Horovod; pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle  # type: ignore[assignment]


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params``: a ``state_dict()`` / dict of tensors (broadcast in sorted-key order) or a list of
    tensors or ``(name, tensor)`` pairs (``list(model.named_parameters())``), as in Horovod.

    Raises:
        ValueError: ``params`` is neither a dict nor a list (a generator must be made a list).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}; pass model.state_dict() or "
                         "list(model.named_parameters())")
    handles = []
    for name, p in items:
        if p is None:
            continue
        handles.append(broadcast_async_(p, root_rank, name, process_set=process_set))
    for handle in handles:
        synchronize(handle)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state with one zero-gradient step of the underlying class.

    Horovod's trick, made harmless: the parameters (which the step may move through weight decay)
    and the gradients are restored afterwards. ``DistributedOptimizer.step`` would synchronize, so
    the base class's ``step`` is called.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    step = getattr(type(optimizer), "_ringflow_base_step", None)
    with torch.no_grad():
        if step is not None:
            step(optimizer)
        else:
            optimizer.step()
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and param-group options equal ``root_rank``'s.

    Tensor state (momentum buffers, Adam moments, step counters) is broadcast in place; scalar
    state and param-group options (lr, betas, weight_decay, ...) travel in one pickled object. An
    optimizer whose state is still empty first takes one zero-gradient step (see
    :func:`_initialize_state`); a stateless one (plain SGD) only has its options broadcast.

    Raises:
        ValueError: ``optimizer`` is an ``LBFGS`` (its state cannot be broadcast, as in Horovod).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _initialize_state(optimizer)
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    for index, group in enumerate(optimizer.param_groups):
        for number, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                name = f"opt.{index}.{number}.{key}"
                if torch.is_tensor(value):
                    tensors.append((name, value))
                else:
                    scalars[name] = value
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    broadcast_parameters(tensors, root_rank, process_set=process_set)
    options, scalars = broadcast_object((options, scalars), root_rank,
                                        name="optimizer_state.options", process_set=process_set)
    for group, opts in zip(optimizer.param_groups, options, strict=False):
        group.update(opts)
    for index, group in enumerate(optimizer.param_groups):
        for number, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            for key in list(state or ()):
                name = f"opt.{index}.{number}.{key}"
                if name in scalars:
                    state[key] = scalars[name]


def _dumps(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return torch.from_numpy(np.frombuffer(buf.getvalue(), dtype=np.uint8).copy())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; cloudpickle when installed).

    ``root_rank`` is a rank within ``process_set``.
    """
    name = name or type(obj).__name__
    if process_set.rank() == root_rank:
        payload = _dumps(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        broadcast_(size, root_rank, f"{name}.sz", process_set)
    else:
        size = torch.zeros(1, dtype=torch.int64)
        broadcast_(size, root_rank, f"{name}.sz", process_set)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    broadcast_(payload, root_rank, f"{name}.t", process_set)
    if process_set.rank() == root_rank:
        return obj
    return _pickler.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj`` (in rank order of ``process_set``)."""
    name = name or type(obj).__name__
    payload = _dumps(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.sz",
                      process_set=process_set).tolist()
    gathered = allgather(payload, name=f"{name}.t", process_set=process_set).numpy()
    offsets = np.cumsum([0, *sizes])
    return [_pickler.loads(gathered[offsets[i]:offsets[i + 1]].tobytes())
            for i in range(len(sizes))]
