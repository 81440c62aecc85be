"""Devices: where a tensor lives, and the array namespace the core moves it with.

A tensor handed to the core is either a host array (anything ``np.asarray`` reads) or a *device
array*: an array of a registered library on a device other than the CPU (a cupy array, a torch
CUDA tensor, the CPU stand-in's :class:`~ringflow.devices.fake.FakeArray`). The core never calls
``np.asarray`` on a device array; it keeps it where it is and moves it only through the
:class:`ArrayNamespace` of its library: allocate (fusion buffers and outputs live on the
tensors' device), flatten, cast while copying (the cast *is* the fp16/bf16 compression; prescale
uses Horovod's ``ScaleBuffer`` arithmetic, :func:`ringflow.ops.scale_into`), zero, and copy to
and from host memory (staging, with the library's own copies).

Registry. :func:`register` names a library by the module and type of its arrays, a lazy factory
for its namespace, and the device kinds it can allocate on without an array at hand (a joined
rank has none). A library is looked at only when that module is already imported (an array of
it implies it is), so ``import ringflow`` imports none of them. Registered here: ``cupy``
(``cuda``), ``torch`` (any non-CPU torch device: ``cuda``, or the torch stand-in) and ``fake``
(the CPU stand-in, ``fake``). A third party adds one with :func:`register`.

Requests. The device *kind* (``"cuda"``, ``"fake"``, ``"cpu"``) travels in
:attr:`~ringflow.negotiation.Request.device` and is what ranks must agree on; the index is
local (rank r usually drives ``cuda:<local_rank>``). A process uses one device of each kind:
the first one a tensor of that kind was submitted on (:func:`claim`); a tensor on another device
of the same kind fails its request on every rank, naming both (Horovod has the same rule).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError, RingflowTimeoutError
from ..polling import SLEEP_0, polls

__all__ = ["ArrayNamespace", "Meta", "claim", "forget", "joined_like", "kind_of",
           "namespace_of", "poll", "register"]


class ArrayNamespace(Protocol):
    """What the core needs from one library's arrays, on any of its devices.

    Arrays are C-contiguous where the core creates them; ``flat``/slicing/``reshape`` are views.
    Every method runs on the engine thread except :meth:`ready`, which runs in the submitting
    thread, and what a job of one rank does in it (:func:`ringflow.executor.solo_allreduce`).
    """

    name: str

    def device(self, a: Any) -> str:
        """``"kind:index"`` (``"cuda:0"``), or ``"cpu"`` for a host array of this library."""

    def dtype(self, a: Any) -> np.dtype:
        """The numpy dtype of ``a`` (raises TensorError for a dtype ringflow does not move)."""

    def is_contiguous(self, a: Any) -> bool: ...

    def contiguous(self, a: Any) -> Any:
        """``a``, or a C-contiguous copy of it on its device."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        """A new array on ``like``'s device."""

    def flat(self, a: Any) -> Any:
        """The 1-D view of a contiguous ``a`` (no copy)."""

    def copy(self, dst: Any, src: Any, prescale: float = 1.0) -> None:
        """``dst[...] = src * prescale`` (flat, same size), cast to ``dst``'s dtype, with the
        arithmetic of :func:`ringflow.ops.scale_into`."""

    def zero(self, dst: Any) -> None: ...

    def host_empty(self, n: int, dtype: np.dtype, like: Any) -> np.ndarray:
        """Host memory to stage ``n`` elements through (pinned where that speeds copies)."""

    def to_host(self, src: Any, out: np.ndarray) -> None:
        """Copy the device array ``src`` into the host array ``out`` (same size, dtype)."""

    def from_host(self, src: np.ndarray, dst: Any) -> None:
        """Copy the host array ``src`` into the device array ``dst`` (same size, dtype)."""

    def ready(self, a: Any) -> None:
        """In the caller's thread: order ``a``'s pending writes before the engine's work on
        the device (CUDA: the default stream waits for the current one). At submission, and
        after a one-rank job's work queued in the caller."""

    def fence(self, like: Any, timeout: float) -> None:
        """Return once the device work this thread queued is done: by polling, never inside a
        blocking device call (RingflowTimeoutError after ``timeout`` s)."""


@dataclasses.dataclass(frozen=True)
class Meta:
    """What the local checks of :mod:`ringflow.collectives` read of an array (dtype, shape,
    ndim), for a device array whose own ``dtype`` is not a numpy dtype (torch)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class _Library:
    name: str
    module: str
    type_name: str
    factory: Callable[[], ArrayNamespace]
    kinds: tuple[str, ...]
    install: str


_LIBRARIES: list[_Library] = []
_BY_TYPE: dict[type, ArrayNamespace | None] = {}
_NAMESPACES: dict[str, ArrayNamespace] = {}
_lock = threading.Lock()


def register(name: str, module: str, type_name: str, factory: Callable[[], ArrayNamespace],
             kinds: tuple[str, ...] = (), install: str = "") -> None:
    """Make arrays of type ``module.type_name`` device arrays, moved through ``factory()``.

    ``kinds``: device kinds this namespace can allocate on with no array at hand, in the
    order tried (a joined rank's zeros). ``install``: how to get the library, for the error
    raised when it is needed and missing. A later registration of ``name`` replaces it.
    """
    with _lock:
        _LIBRARIES[:] = [lib for lib in _LIBRARIES if lib.name != name]
        _LIBRARIES.append(_Library(name, module, type_name, factory, kinds, install))
        _BY_TYPE.clear()
        _NAMESPACES.pop(name, None)


def _namespace(lib: _Library) -> ArrayNamespace:
    ns = _NAMESPACES.get(lib.name)
    if ns is None:
        try:
            ns = _NAMESPACES[lib.name] = lib.factory()
        except ImportError as exc:
            raise ConfigError(f"device arrays of {lib.name} need {lib.module} ({exc}); "
                              f"{lib.install or 'install it'}") from exc
    return ns


def namespace_of(array: Any) -> ArrayNamespace | None:
    """The namespace of ``array``'s library, or None for anything else (host arrays, lists)."""
    cls = type(array)
    try:
        return _BY_TYPE[cls]
    except KeyError:
        pass
    found = None
    for lib in _LIBRARIES:
        mod = sys.modules.get(lib.module)  # not imported: ``array`` cannot be one of its arrays
        if mod is not None and isinstance(array, getattr(mod, lib.type_name)):
            found = _namespace(lib)
            break
    _BY_TYPE[cls] = found
    return found


def kind_of(device: str) -> str:
    """``"cuda:1"`` -> ``"cuda"``."""
    return device.partition(":")[0]


# one device per kind and process ----------------------------------------------------------------
_CLAIMED: dict[str, tuple[str, ArrayNamespace, Any]] = {}  # kind -> (device, namespace, like)


def claim(ns: ArrayNamespace, array: Any, device: str, what: str) -> str:
    """Note that this process uses ``device``; why ``array`` cannot take part ("" if it can)."""
    kind = kind_of(device)
    have = _CLAIMED.get(kind)
    if have is None:
        _CLAIMED[kind] = (device, ns, ns.empty((0,), ns.dtype(array), array))
        return ""
    if have[0] != device:
        return (f"{what} is on {device}, but this process already moves tensors on {have[0]}; "
                f"a process uses one device of each kind (pin it, e.g. "
                f"torch.cuda.set_device(local_rank), and move the tensor there)")
    return ""


def forget() -> None:
    """A fresh job: devices are claimed again."""
    _CLAIMED.clear()


def joined_like(kind: str) -> tuple[ArrayNamespace, Any]:
    """Where a rank without a tensor of this item (it joined) builds its zeros: the device it
    claimed; else a namespace registered for ``kind``; else the host (staged implementations
    only read host copies, so zeros on the host are the same zeros).

    Raises:
        ConfigError: ``kind`` needs a library that is not installed (the message says how).
    """
    from .host import HOST

    have = _CLAIMED.get(kind)
    if have is not None:
        return have[1], have[2]
    for lib in _LIBRARIES:
        if kind in lib.kinds:
            try:
                importlib.import_module(lib.module)
            except ImportError:
                continue
            ns = _namespace(lib)
            return ns, ns.empty((0,), np.dtype(np.uint8), None)
    return HOST, np.empty(0, np.uint8)


def poll(done: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for ``done()`` by polling, so that a wait on a device is never a blocking device call
    and always ends (RingflowTimeoutError after ``timeout`` s).

    For the first 50 us the pause between polls is ``time.sleep(0)``, meant to yield only the
    GIL (a small kernel finishes within 50 us, and Linux's shortest sleep is ~60 us); on Linux
    it sleeps for the timer slack too (see :mod:`ringflow.polling`). Then sleeps from 20 us,
    doubling up to 0.5 ms. The old sleeps from 10 us to 1 ms cost a 4 KiB allreduce on a GPU up
    to a millisecond of waking.
    """
    if done():  # the usual case: no clock read, no generator (timeit: issue 29)
        return
    waits = polls(timeout, 2e-5, 5e-4, spin=5e-5, spin_with=SLEEP_0)
    next(waits)  # its first poll, at once: the one above
    for _ in waits:
        if done():
            return
    raise RingflowTimeoutError(f"{what} did not finish on the device within {timeout} s "
                               "(RINGFLOW_TIMEOUT_S sets the limit)")


def _cupy() -> ArrayNamespace:
    from .cupy_cuda import CupyNamespace

    return CupyNamespace()


def _torch() -> ArrayNamespace:
    from .torch_tensors import TorchNamespace

    return TorchNamespace()


def _fake() -> ArrayNamespace:
    from .fake import FakeNamespace

    return FakeNamespace()


register("cupy", "cupy", "ndarray", _cupy, kinds=("cuda",),
         install="pip install 'ringflow[gpu]' (cupy-cuda12x)")
register("torch", "torch", "Tensor", _torch, install="pip install 'ringflow[torch]'")
register("fake", "ringflow.devices.fake", "FakeArray", _fake, kinds=("fake",))
