"""Compression of floating-point tensors to 16 bits on the wire, framework-neutral.

A compressor only chooses the *wire dtype* of a floating tensor: the engine casts while packing
the fusion buffer (compress) and casts back while unpacking it (decompress), so compression costs
no extra pass over memory. Non-floating tensors travel unchanged. Sums of 16-bit values accumulate
in float32 inside the ring (see :mod:`ringflow.algorithms`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .errors import ConfigError
from .ops import BFLOAT16

__all__ = ["Auto", "Compression", "Compressor", "GradientCompression", "OneBit", "PowerSGD",
           "RandomK", "parse"]


@dataclasses.dataclass(frozen=True)
class Compressor:
    name: str
    wire: np.dtype | None  # None: no compression

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype a tensor of ``dtype`` travels as."""
        dtype = np.dtype(dtype)
        if self.wire is None or dtype.kind != "f" or dtype.itemsize <= self.wire.itemsize:
            return dtype
        return self.wire

    def compress(self, array: np.ndarray) -> tuple[np.ndarray, np.dtype]:
        """Horovod's interface: (compressed array, context to decompress with)."""
        return array.astype(self.wire_dtype(array.dtype), copy=False), array.dtype

    def decompress(self, array: np.ndarray, ctx: np.dtype) -> np.ndarray:
        return array.astype(ctx, copy=False)


class Compression:
    """Horovod's ``Compression`` namespace: ``none``, ``fp16``, and ringflow's ``bf16``; and the
    gradient compressors with state (issue 27): ``powersgd``, ``randomk``, ``onebit``, ``auto``.
    """

    none = Compressor("none", None)
    fp16 = Compressor("fp16", np.dtype(np.float16))
    bf16 = Compressor("bf16", BFLOAT16)

    @classmethod
    def by_name(cls, name: str) -> Compressor:
        return {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}[name]

    @staticmethod
    def powersgd(rank: int = 4, min_elements: int = 1024, seed: int = 0) -> PowerSGD:
        """PowerSGD of rank ``rank`` with error feedback and warm start (:class:`PowerSGD`)."""
        return PowerSGD(min_elements=min_elements, rank=rank, seed=seed)

    @staticmethod
    def randomk(fraction: float = 0.01, min_elements: int = 1024, seed: int = 0) -> RandomK:
        """Random-k with a shared seed and error feedback (:class:`RandomK`)."""
        return RandomK(min_elements=min_elements, fraction=fraction, seed=seed)

    @staticmethod
    def onebit(min_elements: int = 1024) -> OneBit:
        """Signs with a scale, error feedback, a two-phase allreduce (:class:`OneBit`)."""
        return OneBit(min_elements=min_elements)

    @staticmethod
    def auto(inner: GradientCompression | None = None, below_gbit: float = 2.0) -> Auto:
        """``inner`` (PowerSGD by default) on slow links between hosts only (:class:`Auto`)."""
        return Auto(inner=PowerSGD() if inner is None else inner, below_gbit=below_gbit)


# gradient compressors with state (ringflow.compressed runs them) ---------------------------------
@dataclasses.dataclass(frozen=True)
class GradientCompression:
    """Options of a compressor with state: an optimizer (torch's ``DistributedOptimizer``, a
    TensorFlow tape or Keras optimizer) runs it with :class:`ringflow.compressed.Exchange`, which
    holds its error feedback and warm start. Tensors smaller than ``min_elements`` (biases,
    norms) and non-float32/float64 tensors are reduced exactly: they cost latency, not
    bandwidth."""

    min_elements: int = 1024

    name = "gradient"  # overridden by each kind (a class attribute, not a field)

    def __post_init__(self) -> None:
        if int(self.min_elements) < 1:
            raise ConfigError(f"{self.name}: min_elements must be at least 1, got "
                              f"{self.min_elements!r}")

    def spec(self) -> str:
        """The text ``RINGFLOW_COMPRESSION`` / ``ringflow-run --compression`` takes for it."""
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return ":".join([self.name, *fields])


@dataclasses.dataclass(frozen=True)
class PowerSGD(GradientCompression):
    """PowerSGD (Vogels et al., NeurIPS 2019): each gradient seen as a matrix (first dimension x
    the rest) is sent as two rank-``rank`` factors, one power iteration warm-started from the
    last step's, with error feedback. Matrices for which the factors are not smaller go exactly.
    ``seed`` makes the first step's random factor (the same on every rank)."""

    rank: int = 4
    seed: int = 0

    name = "powersgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"powersgd: rank must be an integer >= 1, got {self.rank!r} "
                              "(Compression.powersgd(rank=4), or --compression powersgd:rank=4)")


@dataclasses.dataclass(frozen=True)
class RandomK(GradientCompression):
    """Random-k sparsification: each step, the same ``ceil(fraction * n)`` random elements of
    every tensor on every rank (a seed shared by the ranks, drawn anew per step and tensor) are
    summed; what was not sent waits in the error feedback."""

    fraction: float = 0.01
    seed: int = 0

    name = "randomk"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < float(self.fraction) <= 1.0:
            raise ConfigError(f"randomk: fraction must be in (0, 1], got {self.fraction!r} "
                              "(Compression.randomk(fraction=0.01), or --compression "
                              "randomk:fraction=0.01)")


@dataclasses.dataclass(frozen=True)
class OneBit(GradientCompression):
    """1-bit (sign) compression with a scale per chunk and error feedback on both sides of a
    two-phase allreduce: every rank sends each rank its chunk as signs (alltoall), each rank
    averages its chunk and sends it back as signs (allgather)."""

    name = "onebit"


@dataclasses.dataclass(frozen=True)
class Auto(GradientCompression):
    """``inner`` where the link makes it pay, measured once when the exchange starts: off when
    every rank is on one host (shared memory), else on when the bus bandwidth of a 2 MiB
    allreduce is below ``below_gbit`` Gbit/s (every rank sees the slowest rank's measure)."""

    inner: GradientCompression = PowerSGD()
    below_gbit: float = 2.0

    name = "auto"


_KINDS: dict[str, type[GradientCompression]] = {
    k.name: k for k in (PowerSGD, RandomK, OneBit, Auto)}


def parse(text: str) -> Compressor | GradientCompression:
    """A compressor from its text: ``none``, ``fp16``, ``bf16``, ``powersgd[:rank=R]``,
    ``randomk[:fraction=F]``, ``onebit``, ``auto[:below_gbit=G]`` (optional ``:min_elements=N``,
    ``:seed=S``); ``auto`` compresses with PowerSGD's defaults.

    Raises:
        ConfigError: an unknown kind or option, or a value out of range.
    """
    kind, *options = (part.strip() for part in text.strip().split(":"))
    if kind in ("none", "fp16", "bf16") and not options:
        return Compression.by_name(kind)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ConfigError(f"unknown compression {text!r}; expected one of none, fp16, bf16, "
                          "powersgd[:rank=R], randomk[:fraction=F], onebit, auto")
    types = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "inner"}
    values: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in types:
            raise ConfigError(f"compression {text!r}: {kind} has no option {key!r}; it has "
                              f"{', '.join(sorted(types))}")
        try:
            values[key] = float(value) if types[key] in ("float", float) else int(value)
        except ValueError as exc:
            raise ConfigError(f"compression {text!r}: {key}={value!r} is not a number") from exc
    return cls(**values)
