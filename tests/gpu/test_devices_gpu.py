"""The device path on a real GPU: NCCL allreduce through the engine from torch CUDA tensors and
cupy arrays, and host staging of CUDA tensors with torch's own copies.

UNVERIFIED: written without a GPU; these tests have only ever been seen to skip. They run through
real processes (``ringflow.run``), one rank per GPU (NCCL refuses two ranks on one device), so
on a machine with one GPU they run at one rank (a communicator of one), and at two ranks where
two GPUs are present.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import numpy as np
import pytest

from ringflow.testing import spawn_ranks

pytestmark = pytest.mark.timeout(300)


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return sum(line.startswith("GPU") for line in listed.stdout.splitlines())


def _reason(*modules: str) -> str:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if _gpu_count() == 0:
        return "no GPU: nvidia-smi lists none"
    if "cupy" in modules:
        from ringflow.algorithms import nccl

        why = nccl.unusable_reason()
        if why:
            return why
    return ""


GPUS = _gpu_count()
SIZES = [n for n in (1, 2) if n <= max(GPUS, 1)]
needs_nccl = pytest.mark.skipif(bool(_reason("torch", "cupy")), reason=_reason("torch", "cupy"))
needs_torch_cuda = pytest.mark.skipif(bool(_reason("torch")), reason=_reason("torch"))


def torch_cuda_allreduce(force_staging: bool) -> tuple[str, list[float]]:
    import torch

    import ringflow
    import ringflow.torch as hvd
    from ringflow.algorithms import nccl

    if force_staging:  # every rank alike: CUDA tensors go through host memory
        nccl.unusable_reason = lambda: "forced by the test"
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank())
    impl = ringflow.runtime.running().backends.allreduce[0].name
    total = n * (n + 1) / 2
    x = torch.full((1000,), float(r + 1), device="cuda")
    y = hvd.allreduce(x, name="sum", op=hvd.Sum)
    assert y.is_cuda and y.device == x.device
    assert torch.equal(y.cpu(), torch.full((1000,), total))
    y = hvd.allreduce(x, name="avg", prescale_factor=2.0)
    torch.testing.assert_close(y.cpu(), torch.full((1000,), 2.0 * total / n))
    xs = [torch.full((7,), float(r + 1), device="cuda"),
          torch.full((3, 3), float(r + 1), device="cuda", dtype=torch.float64)]
    ys = hvd.grouped_allreduce(xs, name="group", op=hvd.Sum, compression=hvd.Compression.fp16)
    for x, y in zip(xs, ys, strict=True):
        assert y.is_cuda and y.dtype == x.dtype
        assert torch.equal(y.cpu(), torch.full(x.shape, total, dtype=x.dtype))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # written on a side stream: ready() orders it first
        z = torch.full((1 << 20,), float(r + 1), device="cuda")
        hvd.allreduce_(z, name="side", op=hvd.Sum)
    assert torch.equal(z.cpu(), torch.full((1 << 20,), total))
    g = hvd.allgather(torch.full((r + 1, 2), float(r), device="cuda"), name="gather")
    assert g.is_cuda and g.shape[0] == total
    p = torch.ones(4, device="cuda", requires_grad=True)
    hvd.allreduce(p, name="grad", op=hvd.Sum).sum().backward()
    assert torch.equal(p.grad.cpu(), torch.full((4,), float(n)))
    out = [float(v) for v in y.cpu().reshape(-1)]
    hvd.shutdown()
    return impl, out


@needs_nccl
@pytest.mark.parametrize("n", SIZES)
def test_torch_cuda_tensors_are_reduced_with_nccl(n: int) -> None:
    results = spawn_ranks(n, torch_cuda_allreduce, args=(False,), deadline=240)
    assert {impl for impl, _ in results} == {"nccl"}


@needs_torch_cuda
@pytest.mark.parametrize("n", SIZES)
def test_torch_cuda_tensors_are_staged_without_nccl(n: int) -> None:
    results = spawn_ranks(n, torch_cuda_allreduce, args=(True,), deadline=240)
    assert {impl for impl, _ in results} == {"ring"}  # staging wraps the CPU implementation


def cupy_allreduce() -> str:
    import cupy as cp

    import ringflow as rf

    rf.init()
    r, n = rf.rank(), rf.size()
    cp.cuda.Device(rf.local_rank()).use()
    x = cp.full(100_003, r + 1, cp.float32)
    y = rf.allreduce(x, name="cupy", op=rf.Sum)
    assert isinstance(y, cp.ndarray) and y.device.id == x.device.id
    np.testing.assert_array_equal(cp.asnumpy(y), np.full(100_003, n * (n + 1) / 2, np.float32))
    got, _ = rf.alltoall(cp.arange(n, dtype=cp.int32) + 10 * r, name="a2a")
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), np.arange(n) * 10 + r)
    impl = rf.runtime.running().backends.allreduce[0].name
    rf.shutdown()
    return impl


@needs_nccl
@pytest.mark.parametrize("n", SIZES)
def test_cupy_arrays_through_the_numpy_api(n: int) -> None:
    assert set(spawn_ranks(n, cupy_allreduce, deadline=240)) == {"nccl"}
