"""The device path on a real GPU, through the engine: torch CUDA tensors and cupy arrays over
NCCL (either provider: cupy's binding, or torch's ProcessGroupNCCL when cupy is hidden), and
staged through host memory where NCCL cannot run (two ranks on one GPU, or NCCL turned off).

Real processes (``ringflow.run``). A lent machine has one GPU: one rank runs NCCL (a
communicator of one); two ranks share the GPU, which the engine detects and stages, with one
warning. Where two GPUs are present, two ranks run NCCL.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import numpy as np
import pytest

from ringflow.testing import spawn_ranks

pytestmark = [pytest.mark.timeout(120), pytest.mark.gpu]


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
needs_nccl = pytest.mark.skipif(bool(_reason("torch")), reason=_reason("torch"))
needs_torch_cuda = pytest.mark.skipif(bool(_reason("torch")), reason=_reason("torch"))


def _provider(choice: str) -> None:
    """Make this rank see only ``choice`` ("cupy", "torch" or "none"; "any": all it has) as an
    NCCL provider."""
    from ringflow import backends

    if choice == "any":
        return
    real = backends.nccl_providers

    def only() -> dict[str, str]:
        return {p: (w if p == choice else "hidden by the test") for p, w in real().items()}

    backends.nccl_providers = only


def torch_cuda_allreduce(choice: str, share: bool) -> tuple[str, list[float]]:
    import torch

    import ringflow
    import ringflow.torch as hvd

    _provider(choice)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.cuda.set_device(0 if share else hvd.local_rank())
    total = n * (n + 1) / 2
    x = torch.full((1000,), float(r + 1), device="cuda")
    y = hvd.allreduce(x, name="sum", op=hvd.Sum)
    assert y.is_cuda and y.device == x.device
    assert torch.equal(y.cpu(), torch.full((1000,), total))
    y = hvd.allreduce(x, name="avg", prescale_factor=2.0)
    torch.testing.assert_close(y.cpu(), torch.full((1000,), 2.0 * total / n))
    xs = [torch.full((7,), float(r + 1), device="cuda"),
          torch.full((3, 3), float(r + 1), device="cuda", dtype=torch.float64),
          torch.full((5,), float(r + 1), device="cuda", dtype=torch.bfloat16)]
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
    b = hvd.broadcast(torch.full((3,), float(r), device="cuda"), n - 1, name="bcast")
    assert b.is_cuda and b.tolist() == [float(n - 1)] * 3
    a2a = hvd.alltoall(torch.arange(n, device="cuda", dtype=torch.int32) + 10 * r, name="a2a")
    assert a2a.is_cuda and a2a.tolist() == [10 * s + r for s in range(n)]
    rs = hvd.reducescatter(torch.full((n, 2), float(r + 1), device="cuda"), name="rs",
                           op=hvd.Sum)
    assert rs.is_cuda and rs.tolist() == [[total, total]]
    p = torch.ones(4, device="cuda", requires_grad=True)
    hvd.allreduce(p, name="grad", op=hvd.Sum).sum().backward()
    assert torch.equal(p.grad.cpu(), torch.full((4,), float(n)))
    nccl = ringflow.runtime.running().backends.nccl
    comms = {} if nccl is None else nccl._comms
    used = "staged" if not comms or None in comms.values() else nccl.provider
    out = [float(v) for v in y.cpu().reshape(-1)]
    hvd.shutdown()
    return used, out


@needs_nccl
@pytest.mark.parametrize("choice", ["cupy", "torch"])
def test_torch_cuda_tensors_over_nccl_at_one_rank(choice: str) -> None:
    if choice == "cupy" and _reason("cupy"):
        pytest.skip(_reason("cupy"))
    results = spawn_ranks(1, torch_cuda_allreduce, args=(choice, False), deadline=240)
    assert [used for used, _ in results] == [choice]


@needs_torch_cuda
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_sharing_the_gpu_are_staged(n: int) -> None:
    results = spawn_ranks(n, torch_cuda_allreduce, args=("any", True), deadline=240)
    assert {used for used, _ in results} == {"staged"}


@needs_torch_cuda
@pytest.mark.parametrize("n", [1, 2])
def test_torch_cuda_tensors_are_staged_without_nccl(n: int) -> None:
    results = spawn_ranks(n, torch_cuda_allreduce, args=("none", True), deadline=240)
    assert {used for used, _ in results} == {"staged"}


@pytest.mark.skipif(GPUS < 2 or bool(_reason("torch")), reason="needs two GPUs")
def test_two_ranks_on_two_gpus_run_nccl() -> None:
    results = spawn_ranks(2, torch_cuda_allreduce, args=("torch", False), deadline=240)
    assert {used for used, _ in results} == {"torch"}


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
    provider = rf.runtime.running().backends.nccl.provider
    rf.shutdown()
    return provider


@pytest.mark.skipif(bool(_reason("cupy")), reason=_reason("cupy"))
def test_cupy_arrays_through_the_numpy_api() -> None:
    assert spawn_ranks(1, cupy_allreduce, deadline=240) == ["cupy"]
