"""One rule for scaled integers on every path (issue 33): sum in the dtype (wrapping), scale
once in float64, truncate toward zero, wrap into the dtype (:func:`ringflow.ops.wrap_integers`).

Each path is compared with the rule computed on Python integers, with values chosen to leave the
dtype's range (where C's conversion is undefined and x86 and CUDA disagree)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringflow.algorithms.local import reduce_parts
from ringflow.algorithms.reduction import Reduction, scale_only
from ringflow.devices.fake import FakeNamespace, asnumpy, to_fake
from ringflow.ops import ReduceOp, scale_into, wrap_integers

INTS = ["uint8", "int8", "uint16", "int16", "int32", "int64"]
FACTORS = [2.0, 1 / 3, -1.5, 1e6, 0.5]


def _wrap(value: int, dtype: np.dtype) -> int:
    bits = 8 * dtype.itemsize
    value %= 1 << bits
    return value - (1 << bits) if dtype.kind == "i" and value >= 1 << (bits - 1) else value


def _rule(parts: list[np.ndarray], factor: float) -> np.ndarray:
    dtype = parts[0].dtype
    sums = [_wrap(sum(int(p[i]) for p in parts), dtype) for i in range(parts[0].size)]
    return np.array([_wrap(math.trunc(float(s) * factor), dtype) for s in sums], dtype)


def _inputs(dtype: str, n: int) -> list[np.ndarray]:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(n)
    edge = np.array([info.max, info.min, info.max // 2 + 1, 0, 1, -1 if info.min else 7],
                    dtype=object)
    return [np.concatenate([edge, rng.integers(info.min, info.max, 9, dtype=dtype, endpoint=True)]
                           ).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", INTS)
def test_wrap_integers_matches_python_integers(dtype: str) -> None:
    dt = np.dtype(dtype)
    whole = np.array([0.0, 1.0, -1.0, 2.0**8 + 3, -(2.0**8) - 3, 2.0**40, -(2.0**63), 2.0**64,
                      3 * 2.0**64 + 2**20, 1e30], np.float64)
    got = wrap_integers(whole.copy(), dt).astype(dt)
    want = np.array([_wrap(int(w), dt) for w in whole], dt)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("factor", FACTORS)
def test_every_host_path_follows_the_rule(dtype: str, factor: float) -> None:
    for n in (1, 2, 3):
        parts = _inputs(dtype, n)
        want = _rule(parts, factor)
        # shared memory, the lane and the coordinator's small tensors
        out = np.empty_like(parts[0])
        reduce_parts(parts, 0, out.size, out, ReduceOp.SUM, factor)
        np.testing.assert_array_equal(out, want, err_msg=f"reduce_parts, {n} parts")
        # AVERAGE is SUM times postscale / n
        reduce_parts(parts, 0, out.size, out, ReduceOp.AVERAGE, factor * n)
        np.testing.assert_array_equal(out, _rule(parts, factor * n / n),
                                      err_msg=f"reduce_parts average, {n} parts")
    # the ring, MPI's native allreduce and the hierarchical ring scale with Reduction
    part = _inputs(dtype, 1)[0]
    flat = part.copy()
    scale_only(flat, Reduction(flat.dtype, ReduceOp.SUM, factor, 1, "t"))
    np.testing.assert_array_equal(flat, _rule([part], factor), err_msg="Reduction")
    # prescale while packing: numpy and the device stand-in
    out = np.empty_like(part)
    scale_into(part, factor, out)
    np.testing.assert_array_equal(out, _rule([part], factor), err_msg="scale_into")
    dst = to_fake(np.empty_like(part))
    FakeNamespace().copy(dst, to_fake(part), factor)
    np.testing.assert_array_equal(asnumpy(dst), _rule([part], factor), err_msg="fake device")


@pytest.mark.parametrize("dtype", INTS)
def test_torch_tensors_follow_the_rule(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from ringflow.devices.torch_tensors import TorchNamespace

    part = _inputs(dtype, 1)[0]
    for factor in FACTORS:
        dst = torch.empty(part.size, dtype=getattr(torch, dtype))
        TorchNamespace().copy(dst, torch.from_numpy(part.copy()), factor)
        np.testing.assert_array_equal(dst.numpy(), _rule([part], factor), err_msg=str(factor))
