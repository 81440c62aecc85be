"""A CPU stand-in for a torch GPU: tensors that report a non-CPU device, for tests without one.

:class:`FakeDeviceTensor` is a wrapper tensor subclass (``_make_wrapper_subclass``, as torch's
own FakeTensor): its values live in a hidden CPU tensor, every torch operation on it runs on
that tensor and is wrapped again, and it reports ``device.type == DEVICE_TYPE``. To ringflow it
is a tensor on a non-CPU device like a CUDA tensor: ``ringflow.torch`` hands it to the core as
is, where :class:`~ringflow.devices.torch_tensors.TorchNamespace` allocates fusion buffers and
outputs with ``new_empty`` on its device and stages it with ``Tensor.copy_``, the very calls a
CUDA tensor gets (only the kernels behind them differ). ``Tensor.numpy()`` fails on it, as on a
CUDA tensor, so a path that forgot to stage fails loudly. Copies between it and CPU tensors are
counted in :data:`COPIES` (``to_host``/``from_host``, with bytes).

Why ``DEVICE_TYPE = "lazy"``: autograd needs a device guard for the device a tensor reports,
and a CPU build of torch 2.13 has one for ``lazy`` (its LazyTensor core is built in) but none
for the ``privateuse1`` device that ``torch.utils.rename_privateuse1_backend`` names (a
gradient on such a tensor aborts the process: "PyTorch is not linked with support for ...
devices"). Registering a guard needs a C++ extension. Tensors here are not LazyTensors: only
the device type is borrowed.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["COPIES", "DEVICE_TYPE", "FakeDeviceTensor", "reset_copies", "to_cpu", "to_fake"]

DEVICE_TYPE = "lazy"
#: Copies between the stand-in device and the host in this process (see the module doc).
COPIES: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def reset_copies() -> None:
    with _lock:
        COPIES.clear()


def _count(what: str, nbytes: int) -> None:
    with _lock:
        COPIES[what] += 1
        COPIES[f"{what}_bytes"] += nbytes


class FakeDeviceTensor(torch.Tensor):
    """A tensor on the stand-in device (see the module doc)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int = 0) -> FakeDeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=torch.device(DEVICE_TYPE, index),
            requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FakeDeviceTensor({self.inner!r}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        wrappers: dict[int, FakeDeviceTensor] = {}
        plain: set[int] = set()
        index = 0

        def unwrap(x: Any) -> Any:
            nonlocal index
            if isinstance(x, FakeDeviceTensor):
                wrappers[id(x.inner)] = x
                index = x.device.index or 0
                return x.inner
            if isinstance(x, torch.Tensor):
                plain.add(id(x))
            return x

        def device_arg(x: Any) -> Any:  # the stand-in's device means the hidden CPU tensor
            if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
                return torch.device("cpu")
            if isinstance(x, str) and x.startswith(DEVICE_TYPE):
                return "cpu"
            return x

        inner_args = tree_map(unwrap, args)
        inner_kwargs = tree_map(unwrap, kwargs)
        to_cpu = False
        if func is torch.ops.aten._to_copy.default:
            target = kwargs.get("device")
            to_cpu = target is not None and torch.device(target).type == "cpu"
            if to_cpu:
                _count("to_host", args[0].inner.nbytes)
        elif func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, FakeDeviceTensor) and not isinstance(src, FakeDeviceTensor):
                _count("from_host", dst.inner.nbytes)
            elif isinstance(src, FakeDeviceTensor) and not isinstance(dst, FakeDeviceTensor):
                _count("to_host", src.inner.nbytes)
        out = func(*tree_map(device_arg, inner_args), **tree_map(device_arg, inner_kwargs))

        def wrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in wrappers:  # an in-place op or a returned argument: the same object
                return wrappers[id(x)]
            if id(x) in plain or to_cpu:
                return x
            return FakeDeviceTensor(x, index)

        return tree_map(wrap, out)


def to_fake(t: torch.Tensor, index: int = 0) -> FakeDeviceTensor:
    """A stand-in tensor holding a copy of the CPU tensor ``t`` (not counted)."""
    return FakeDeviceTensor(t.detach().clone().contiguous(), index).requires_grad_(
        t.requires_grad)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a stand-in tensor's values (not counted: the test's own look)."""
    return t.inner.detach().clone() if isinstance(t, FakeDeviceTensor) else t.detach().clone()
