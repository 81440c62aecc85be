"""reduce_parts: rank-order reduction in this process's memory (shared-memory and eager paths)."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow.algorithms import buffers, local
from ringflow.algorithms.local import reduce_parts
from ringflow.ops import BFLOAT16, ReduceOp

pytestmark = pytest.mark.timeout(30)


def reference(parts: list[np.ndarray], op: ReduceOp, postscale: float) -> np.ndarray:
    """Left to right in rank order, in the accumulator dtype, scaled once."""
    dtype = parts[0].dtype
    wide = dtype in (np.float16, BFLOAT16) or (dtype.kind in "iu" and (
        postscale != 1.0 or op == ReduceOp.AVERAGE))
    acc_dtype = (np.float32 if dtype.kind == "f" or dtype == BFLOAT16 else np.float64) \
        if wide else dtype
    acc = parts[0].astype(acc_dtype)
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
    for p in parts[1:]:
        acc = fn(acc, p.astype(acc_dtype)).astype(acc_dtype)
    factor = postscale / len(parts) if op == ReduceOp.AVERAGE else postscale
    if factor != 1.0:
        acc = (acc * factor).astype(acc_dtype)
        if dtype.kind in "iu":
            acc = np.trunc(acc)
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
