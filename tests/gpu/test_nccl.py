"""ringflow.algorithms.nccl and .device on a real GPU, one rank (a communicator of one): both
providers (cupy's binding, torch's ProcessGroupNCCL), every primitive and every composed
collective, against closed forms. Skipped without a GPU; the same code runs on CPU in CI through
the stand-ins (tests/inproc/test_nccl_providers.py, tests/multiproc/test_nccl_standin.py).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest

from ringflow.algorithms import device, nccl
from ringflow.ops import ReduceOp, scale_into
from ringflow.rendezvous import MemoryStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.gpu]


def _gpu_reason() -> str:
    if shutil.which("nvidia-smi") is None:
        return "no GPU: nvidia-smi is not on PATH"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    if "GPU" not in listed.stdout:
        return "no GPU: nvidia-smi -L lists no device"
    return ""


def _cupy_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'ringflow[gpu]')"
    return _gpu_reason() or nccl.unusable_reason()


def _torch_reason() -> str:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if _gpu_reason():
        return _gpu_reason()
    from ringflow.algorithms import nccl_torch

    return nccl_torch.unusable_reason()


needs_cupy = pytest.mark.skipif(bool(_cupy_reason()), reason=_cupy_reason())
needs_torch = pytest.mark.skipif(bool(_torch_reason()), reason=_torch_reason())


@pytest.fixture(params=["cupy", "torch"])
def provider(request: pytest.FixtureRequest) -> Any:
    """(communicator of one, array namespace, a function making an array from numpy)."""
    reason = _cupy_reason() if request.param == "cupy" else _torch_reason()
    if reason:
        pytest.skip(reason)
    if request.param == "cupy":
        import cupy as cp

        from ringflow.devices.cupy_cuda import CupyNamespace

        comm = nccl.CupyNccl(0, 1, MemoryStore(), "t/", 0, 30.0)
        yield comm, CupyNamespace(), cp.asarray
    else:
        import torch

        from ringflow.algorithms.nccl_torch import TorchNccl
        from ringflow.devices.torch_tensors import TorchNamespace

        comm = TorchNccl(0, 1, MemoryStore(), "t/", 0, 30.0)
        yield comm, TorchNamespace(), lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()
    comm.close()


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else a.cpu().numpy()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
@pytest.mark.parametrize("length", [0, 1, 100_003])
def test_allreduce_and_average_follow_the_host_rules(provider: Any, dtype: str,
                                                     length: int) -> None:
    comm, ns, make = provider
    want = np.arange(length).astype(dtype)
    x = make(want)
    device.allreduce(comm, ns, x, ReduceOp.SUM, 1.0, "sum")
    np.testing.assert_array_equal(_host(x), want)
    device.allreduce(comm, ns, x, ReduceOp.AVERAGE, 2.0, "average")
    scaled = np.empty_like(want)
    scale_into(want, 2.0, scaled)  # integers: truncated and wrapped, as on the host
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(_host(x), scaled)
    else:
        np.testing.assert_allclose(_host(x).astype(np.float64), scaled, rtol=2e-3)


def test_every_composed_collective(provider: Any) -> None:
    comm, ns, make = provider
    x = make(np.arange(12, dtype=np.float32).reshape(4, 3))
    np.testing.assert_array_equal(_host(device.allgather(comm, ns, x, [4], "ag")), _host(x))
    out = make(np.arange(12, dtype=np.float32))
    device.broadcast(comm, ns, out, 0, "b")
    np.testing.assert_array_equal(_host(out), np.arange(12))
    rs = device.reducescatter(comm, ns, x, ReduceOp.SUM, 1.0, 1.0, np.dtype(np.float16), "rs")
    np.testing.assert_array_equal(_host(rs), _host(x))
    np.testing.assert_array_equal(_host(device.alltoall(comm, ns, x, [4], [4], "a2a")), _host(x))
    np.testing.assert_array_equal(_host(device.gather(comm, ns, x, [4], 0, "g")), _host(x))


def test_bool_reduces_as_or_and_and(provider: Any) -> None:
    comm, ns, make = provider
    x = make(np.array([True, False]))
    device.allreduce(comm, ns, x, ReduceOp.MIN, 1.0, "and")
    np.testing.assert_array_equal(_host(x), [True, False])


@needs_cupy
def test_cupy_versions_unique_id_is_what_its_binding_takes() -> None:
    import cupy
    from cupy.cuda import nccl as binding

    uid = binding.get_unique_id()
    text = nccl.encode_unique_id(uid)
    assert nccl.decode_unique_id(text, int(cupy.__version__.split(".")[0])) == uid
