"""Casts between float32 and the 16-bit wire dtypes in host memory, by a framework's kernels.

The engine compresses a CPU tensor by casting it to float16 or bfloat16 while it packs the fusion
buffer, and decompresses by casting back while it unpacks (:mod:`ringflow.executor`). numpy's
float32 -> float16 cast is a scalar loop: 100 MB took 65-154 ms here, where torch's kernel took
6-9 ms into the same buffer (``benchmarks/cast_cost.py``, RESULTS.md section 14). So a cast
between these pairs:

    float32 -> float16, float32 -> bfloat16, float16 -> float32 (torch), and
    float32 -> float16, float16 -> float32 (TensorFlow)

of at least :data:`MIN_ELEMENTS` elements runs on the kernel of the first registered framework
that is already imported (torch, then TensorFlow), on views of the same host memory: torch's
``Tensor.copy_`` into the buffer itself; TensorFlow's ``tf.cast`` chunk by chunk, copied into
place (TensorFlow writes no existing array). Any other cast (bfloat16 -> float32 is a shift that
ml_dtypes does as fast; float64 would be rounded twice by torch), a smaller one, or a process
with neither framework imported, is numpy's, as before. ``import ringflow`` imports no framework: a
kernel is built the first time it is needed, and only once its module is in ``sys.modules``.

**The same bits.** numpy (float16) and ml_dtypes (bfloat16) round to nearest even; so do torch's
and TensorFlow's kernels, and every non-NaN value gives the same bits (tested exhaustively for
the 65,536 16-bit patterns, and on 2^24 random float32 patterns plus the rounding boundaries).
NaNs differ: numpy keeps a float16 NaN's payload and ml_dtypes a bfloat16 NaN's sign, while the
kernels quiet or canonicalise them (torch writes every bfloat16 NaN as 0xFFFF). So the float32
side is checked for NaNs with one ``max`` (3.6 ms for 100 MB here): where it has one, the chunks
of :data:`CHUNK` elements that hold a NaN are cast by numpy, so the result is numpy's bit for
bit, whatever the kernel. Without NaNs (the rule) the kernel runs once over the whole array:
one parallel region of the framework's thread pool, not one per chunk, whose every barrier can
wait a time slice for a preempted thread on a loaded host (interleaving chunked casts with numpy
checks took 270 ms instead of 7 under load, at 2 threads on 2 busy cores).

Prescale (Horovod's ``ScaleBuffer``, :func:`ringflow.ops.scale_into`: float32 times the factor
rounded to float32, rounded once to 16 bits) is a float32 multiply per chunk into scratch
memory, then the cast of the chunk: the same two roundings.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..ops import BFLOAT16, scale_into

__all__ = ["CHUNK", "MIN_ELEMENTS", "PAIRS", "HostCast", "astype", "cast_into", "kernel_for",
           "register"]

_F32, _F16 = np.dtype(np.float32), np.dtype(np.float16)
#: (source dtype, destination dtype) a framework kernel may cast.
PAIRS = frozenset({(_F32, _F16), (_F32, BFLOAT16), (_F16, _F32), (BFLOAT16, _F32)})
#: Elements per chunk where a cast goes chunk by chunk (TensorFlow's kernel; NaNs; a prescale):
#: 4 MiB of float32, large enough that TensorFlow's ~25 us per eager op is ~5% of a chunk (64 Ki
#: elements: 32 ms for 100 MB, 1 Mi: 12 ms), small enough to stay in cache between two passes.
CHUNK = 1 << 20
#: Below this many elements numpy casts: a kernel call costs ~5-10 us (views, dispatch), what
#: numpy's float16 loop spends on ~2,000 elements.
MIN_ELEMENTS = 4096


class HostCast(Protocol):
    """A framework's cast of one chunk: ``dst[...] = src`` cast to ``dst``'s dtype, for flat,
    contiguous host arrays of one length whose dtypes are one of :data:`PAIRS`."""

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Kernel:
    name: str
    module: str
    factory: Callable[[], HostCast]
    pairs: frozenset[tuple[np.dtype, np.dtype]]


_KERNELS: list[_Kernel] = []
_BUILT: dict[str, HostCast] = {}
_lock = threading.Lock()


def register(name: str, module: str, factory: Callable[[], HostCast],
             pairs: frozenset[tuple[np.dtype, np.dtype]] = PAIRS) -> None:
    """Cast ``pairs`` (a subset of :data:`PAIRS`) with ``factory()`` once ``module`` is imported;
    kernels are tried in the order registered. A later registration of ``name`` replaces it."""
    with _lock:
        _KERNELS[:] = [k for k in _KERNELS if k.name != name]
        _KERNELS.append(_Kernel(name, module, factory, frozenset(pairs) & PAIRS))
        _BUILT.pop(name, None)


def kernel_for(src: np.dtype, dst: np.dtype) -> tuple[str, HostCast] | None:
    """The first kernel whose framework is imported and that casts ``src`` to ``dst``: (name,
    kernel), or None (numpy casts)."""
    pair = (src, dst)
    if pair not in PAIRS:
        return None
    for k in _KERNELS:
        if pair in k.pairs and k.module in sys.modules:
            built = _BUILT.get(k.name)
            if built is None:
                try:
                    built = _BUILT[k.name] = k.factory()
                except ImportError:  # a broken installation: numpy still casts
                    continue
            return k.name, built
    return None


def cast_into(dst: np.ndarray, src: np.ndarray, prescale: float = 1.0) -> None:
    """``dst[...] = src * prescale`` cast to ``dst``'s dtype (flat, contiguous, one length), with
    numpy's bits (:func:`ringflow.ops.scale_into`'s arithmetic for a prescale)."""
    n = src.shape[0]
    found = kernel_for(src.dtype, dst.dtype) if n >= MIN_ELEMENTS else None
    if found is None or (prescale != 1.0 and src.dtype != _F32):
        _numpy(dst, src, prescale)
        return
    kernel = found[1]
    if prescale != 1.0:
        _chunks(kernel, dst, src, prescale)
    elif src.dtype == _F32:  # narrowing: numpy's bits for NaNs (module doc)
        if np.isnan(src.max()):
            _chunks(kernel, dst, src, 1.0)
        else:
            kernel(dst, src)
    else:
        kernel(dst, src)
        if np.isnan(dst.max()):
            for lo in range(0, n, CHUNK):
                d = dst[lo:lo + CHUNK]
                if np.isnan(d.max()):
                    np.copyto(d, src[lo:lo + CHUNK], casting="unsafe")


def _numpy(dst: np.ndarray, src: np.ndarray, prescale: float) -> None:
    if prescale != 1.0:
        scale_into(src, prescale, dst)
    else:
        np.copyto(dst, src, casting="unsafe")


def _chunks(kernel: HostCast, dst: np.ndarray, src: np.ndarray, prescale: float) -> None:
    """Narrow float32 ``src * prescale`` chunk by chunk: numpy casts the chunks with a NaN."""
    n = src.shape[0]
    scratch = np.empty(min(n, CHUNK), _F32) if prescale != 1.0 else None
    factor = np.float32(prescale)
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        s, d = src[lo:hi], dst[lo:hi]
        if scratch is not None:
            s = np.multiply(s, factor, out=scratch[:hi - lo])
        if np.isnan(s.max()):
            np.copyto(d, s, casting="unsafe")
        else:
            kernel(d, s)


def astype(a: np.ndarray, dtype: np.dtype, prescale: float = 1.0) -> np.ndarray:
    """``a * prescale`` as a new array of ``dtype`` through :func:`cast_into`; ``a`` itself when
    there is nothing to do."""
    if a.dtype == dtype and prescale == 1.0:
        return a
    out = np.empty(a.shape, dtype)
    cast_into(out.reshape(-1), np.ascontiguousarray(a).reshape(-1), prescale)
    return out


# the kernels ------------------------------------------------------------------------------------
def _torch() -> HostCast:
    from .torch_tensors import host_view

    def cast(dst: np.ndarray, src: np.ndarray) -> None:
        if not src.flags.writeable:  # torch warns about a view it could write through
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                source = host_view(src)
        else:
            source = host_view(src)
        host_view(dst).copy_(source)

    return cast


def _tensorflow() -> HostCast:
    import tensorflow as tf

    def cast(dst: np.ndarray, src: np.ndarray) -> None:
        for lo in range(0, src.shape[0], CHUNK):  # in cache: tf.cast copies in, then out
            np.copyto(dst[lo:lo + CHUNK], tf.cast(src[lo:lo + CHUNK], dst.dtype).numpy())

    return cast


# Widening bfloat16 is a shift, which ml_dtypes does as fast as torch (100 MB into a new array:
# 13-15 ms, torch's kernel and the NaN check 16-18 ms): torch does the other three.
register("torch", "torch", _torch, PAIRS - {(BFLOAT16, _F32)})
# TensorFlow's bfloat16 casts are no faster than ml_dtypes' (a chunked ``tf.cast`` copies in and
# out: ~20 ms for 100 MB against 11-15 ms): only float16, where numpy's loop is slow.
register("tensorflow", "tensorflow", _tensorflow, frozenset({(_F32, _F16), (_F16, _F32)}))
