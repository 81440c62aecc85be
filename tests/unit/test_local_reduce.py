"""reduce_parts: rank-order reduction in this process's memory (shared-memory and eager paths)."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow.algorithms import buffers, local
from ringflow.algorithms.local import reduce_parts
from ringflow.ops import BFLOAT16, ReduceOp

pytestmark = pytest.mark.timeout(30)


def reference(parts: list[np.ndarray], op: ReduceOp, postscale: float) -> np.ndarray:
    """Left to right in rank order, in the accumulator dtype (float32 for 16-bit floats, else
    the dtype: integers wrap), scaled once (integers in float64, truncated toward zero)."""
    dtype = parts[0].dtype
    acc_dtype = np.float32 if dtype in (np.float16, BFLOAT16) else dtype
    acc = parts[0].astype(acc_dtype)
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
    for p in parts[1:]:
        acc = fn(acc, p.astype(acc_dtype), dtype=acc_dtype)
    factor = postscale / len(parts) if op == ReduceOp.AVERAGE else postscale
    if factor != 1.0:
        if dtype.kind in "iu":
            acc = np.trunc(acc.astype(np.float64) * factor)
        else:
            acc = (acc * factor).astype(acc_dtype)
    return acc.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16, np.int32])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX])
@pytest.mark.parametrize("into", ["fresh", "part0", "part2", "mirror"])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("stream", [False, True], ids=["in-place", "streamed"])
def test_reduce_parts_matches_rank_order_reference_whatever_the_destination(
    monkeypatch, dtype, op, into, n, stream
) -> None:
    monkeypatch.setattr(buffers, "CHUNK_BYTES", 4096)  # several blocks
    monkeypatch.setattr(local, "STREAM_BYTES", 0 if stream else 1 << 40)
    rng = np.random.default_rng(5)
    length, lo, hi = 3001, 17, 2950
    parts = [(rng.standard_normal(length) * 100).astype(dtype) for _ in range(n)]
    want = reference([p[lo:hi] for p in parts], op, 0.5)
    mirror = np.zeros(length, dtype) if into == "mirror" else None
    # The destination may be one of the parts (a rank reducing into its own input).
    dst = {"part0": parts[0], "part2": parts[min(2, n - 1)]}.get(into, np.zeros(length, dtype))
    reduce_parts(parts, lo, hi, dst, op, 0.5, mirror)
    assert dst[lo:hi].tobytes() == want.tobytes()
    if mirror is not None:
        assert mirror[lo:hi].tobytes() == want.tobytes()
        assert not mirror[:lo].any() and not mirror[hi:].any()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
@pytest.mark.parametrize("stream", [False, True], ids=["in-place", "streamed"])
def test_scaled_integer_sum_wraps_as_on_the_ring(monkeypatch, dtype, stream) -> None:
    """An integer AVERAGE whose sum overflows: the wrapped sum, scaled in float64 and truncated,
    as the ring's Reduction computes it, so that every path gives the same bits (the shared-
    memory and coordinator paths used to sum in float64 and give the true mean instead)."""
    from ringflow.algorithms.reduction import Reduction

    monkeypatch.setattr(buffers, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(local, "STREAM_BYTES", 0 if stream else 1 << 40)
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    n, length = 4, 3001
    parts = [rng.integers(info.min, info.max, length, dtype=dtype, endpoint=True)
             for _ in range(n)]
    dst = np.zeros(length, dtype)
    reduce_parts(parts, 0, length, dst, ReduceOp.AVERAGE, 1.0)
    # The ring's arithmetic: combine in the dtype, the owner's finish() scales.
    red = Reduction(np.dtype(dtype), ReduceOp.AVERAGE, 1.0, n, "t")
    acc = parts[0].copy()
    for p in parts[1:-1]:
        red.combine(acc, p, red.scratch(length))
    red.finish(acc, parts[-1], red.scratch(length))
    assert dst.tobytes() == acc.tobytes()
    wrapped = np.add.reduce(np.stack(parts), axis=0, dtype=dtype)
    assert dst.tobytes() == np.trunc(wrapped.astype(np.float64) / n).astype(dtype).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.PRODUCT])
@pytest.mark.parametrize("into", ["fresh", "part1", "mirror"])
def test_16_bit_reductions_through_a_framework_kernel_keep_numpys_bits(monkeypatch, dtype, op,
                                                                       into) -> None:
    """With torch imported the 16-bit blocks are widened and narrowed by its kernel
    (ringflow.devices.casts): the bits must be numpy's, NaNs, infinities and subnormals too."""
    pytest.importorskip("torch")
    monkeypatch.setattr(local, "WIDE_BLOCK", 5000)  # several blocks, each above MIN_ELEMENTS
    rng = np.random.default_rng(11)
    length, lo, hi = 23_001, 7, 22_990
    parts = []
    for k in range(3):
        bits = rng.integers(0, 1 << 16, length, dtype=np.uint16)  # every pattern, NaNs included
        part = bits.view(np.float16) if dtype == np.float16 else bits.view(BFLOAT16)
        parts.append(np.where(rng.random(length) < 0.5,
                              (rng.standard_normal(length) * 10 ** k).astype(dtype), part))
    want = reference([p[lo:hi] for p in parts], op, 0.75)
    mirror = np.zeros(length, dtype) if into == "mirror" else None
    dst = parts[1] if into == "part1" else np.zeros(length, dtype)
    reduce_parts(parts, lo, hi, dst, op, 0.75, mirror)
    assert dst[lo:hi].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    if mirror is not None:
        assert mirror[lo:hi].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_the_rings_16_bit_combine_keeps_numpys_bits(dtype) -> None:
    pytest.importorskip("torch")
    from ringflow.algorithms.reduction import Reduction

    rng = np.random.default_rng(3)
    n = 20_000
    acc0 = np.where(rng.random(n) < 0.3, rng.integers(0, 1 << 16, n, dtype=np.uint16).view(
        np.float16).astype(dtype), (rng.standard_normal(n) * 1e3).astype(dtype))
    got = (rng.standard_normal(n) * 1e3).astype(dtype)
    red = Reduction(np.dtype(dtype), ReduceOp.AVERAGE, 1.0, 3, "t")
    scratch = red.scratch(n)
    acc = acc0.copy()
    red.combine(acc, got, scratch)
    want = np.add(acc0, got, dtype=np.float32).astype(dtype)
    assert acc.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    acc = acc0.copy()
    red.finish(acc, got, scratch)
    want = (np.add(acc0, got, dtype=np.float32) * np.float32(red.factor)).astype(dtype)
    assert acc.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_the_rings_16_bit_prescale_keeps_numpys_bits(dtype) -> None:
    pytest.importorskip("torch")
    from ringflow.algorithms.reduction import Reduction

    rng = np.random.default_rng(4)
    n = 3 * 4096 + 17
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # every kind of value, subnormals too
    flat = bits.view(np.float16).astype(dtype) if dtype == np.float16 else bits.view(BFLOAT16)
    red = Reduction(np.dtype(dtype), ReduceOp.SUM, 1.0, 3, "t")
    red.prescale = 1 / 3  # not exact in 16 bits: numpy rounds the factor first
    want = flat.copy()
    np.multiply(want, red.prescale, out=want)
    got = flat.copy()
    red.prescale_inplace(got)
    assert got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
