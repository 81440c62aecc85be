"""ringflow.algorithms.nccl: pure helpers anywhere; GPU collectives where cupy and a GPU are.

The GPU half is UNVERIFIED: it was written without a GPU, and these tests have only ever been
seen to skip. Single-rank jobs only (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import numpy as np
import pytest

from ringflow.algorithms import nccl
from ringflow.ops import ReduceOp, scale_into
from ringflow.rendezvous import MemoryStore

pytestmark = pytest.mark.timeout(120)


def _gpu_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "no GPU stack: cupy is not installed (pip install 'ringflow[gpu]')"
    if shutil.which("nvidia-smi") is None:
        return "no GPU: nvidia-smi is not on PATH"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    if "GPU" not in listed.stdout:
        return "no GPU: nvidia-smi -L lists no device"
    if nccl.available() is None:
        return "cupy is installed but its NCCL does not load"
    return ""


GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(bool(GPU_REASON), reason=GPU_REASON)


# --- pure helpers (run everywhere) ------------------------------------------------------------


def test_unique_id_survives_the_store_as_signed_chars() -> None:
    uid = tuple(((i * 37) % 256) - 128 for i in range(128))
    assert nccl.decode_unique_id(nccl.encode_unique_id(uid)) == uid
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.encode_unique_id(uid[:5])


def test_dtype_and_op_tables_match_nccl_h() -> None:
    assert nccl.NCCL_DTYPES["float32"] == 7 and nccl.NCCL_DTYPES["bfloat16"] == 9
    assert "int16" not in nccl.NCCL_DTYPES and "uint16" not in nccl.NCCL_DTYPES
    assert nccl.NCCL_OPS[ReduceOp.AVERAGE] == nccl.NCCL_OPS[ReduceOp.SUM] == 0
    assert ReduceOp.ADASUM not in nccl.NCCL_OPS


def test_rows_split_like_the_ring() -> None:
    assert nccl.row_splits(5, 3) == [(0, 2), (2, 4), (4, 5)]


def test_available_is_none_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert nccl.available() is None


# --- on a GPU (single rank) -------------------------------------------------------------------


@pytest.fixture
def comm():
    c = nccl.NcclComm(0, 1, MemoryStore(), prefix="t/", device=0, timeout=30.0)
    yield c
    c.close()


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
@pytest.mark.parametrize("length", [0, 1, 100_003])
def test_single_rank_allreduce_and_average(comm, dtype: str, length: int) -> None:
    import cupy as cp

    x = cp.arange(length).astype(dtype)
    want = cp.asnumpy(x).copy()
    got = comm.allreduce(x, ReduceOp.SUM).wait()
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    got = comm.allreduce(x, ReduceOp.AVERAGE, postscale=2.0).wait()
    if np.dtype(dtype).kind in "iu":  # the one integer rule: truncate, wrap (as the host does)
        scaled = np.empty_like(want)
        scale_into(want, 2.0, scaled)
        np.testing.assert_array_equal(cp.asnumpy(got), scaled)
    else:
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want * 2.0, rtol=2e-3)


@needs_gpu
def test_single_rank_gather_broadcast_scatter_alltoall(comm) -> None:
    import cupy as cp

    x = cp.arange(12, dtype=cp.float32).reshape(4, 3)
    np.testing.assert_array_equal(cp.asnumpy(comm.allgather(x, [4]).wait()), cp.asnumpy(x))
    np.testing.assert_array_equal(cp.asnumpy(comm.broadcast(x.copy(), 0).wait()), cp.asnumpy(x))
    np.testing.assert_array_equal(cp.asnumpy(comm.reducescatter(x).wait()), cp.asnumpy(x))
    np.testing.assert_array_equal(cp.asnumpy(comm.alltoall(x, [4], [4]).wait()), cp.asnumpy(x))


@needs_gpu
def test_device_side_fusion_and_fp16_compression_round_trip(comm) -> None:
    import cupy as cp

    xs = [cp.full((3, 5), 1.5, cp.float32), cp.arange(7, dtype=cp.float32), cp.ones(0, cp.float32)]
    buf = nccl.pack(xs, cp.float16)
    assert buf.dtype == cp.float16 and buf.size == 22
    work = comm.allreduce(buf, ReduceOp.SUM)
    assert isinstance(work.poll(), bool)
    outs = nccl.unpack(work.wait(), xs)
    for a, b in zip(xs, outs, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(cp.asnumpy(b), cp.asnumpy(a))


@needs_gpu
def test_staging_through_pinned_host_memory(caplog: pytest.LogCaptureFixture) -> None:
    import cupy as cp

    x = cp.arange(10, dtype=cp.int16)
    with caplog.at_level("WARNING", logger="ringflow.algorithms.nccl"):
        host = nccl.stage_to_host(x, "int16 has no NCCL type")
    np.testing.assert_array_equal(host, np.arange(10, dtype=np.int16))


@needs_gpu
def test_int16_is_refused_with_the_fix(comm) -> None:
    import cupy as cp

    from ringflow.errors import TensorError

    with pytest.raises(TensorError, match="stage it through host memory"):
        comm.allreduce(cp.ones(4, cp.int16))
