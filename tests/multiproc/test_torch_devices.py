"""ringflow.torch on a non-CPU device, on CPU: the stand-in tensors through real processes.

The tensors are :class:`~ringflow.torch.fake_device.FakeDeviceTensor`: they report a non-CPU
device (``lazy:0``), refuse ``.numpy()``, and count every copy to and from the host. They take
the path a CUDA tensor takes where NCCL is not usable: handed to the core as tensors, fused on
their device by the torch namespace (``new_empty``, ``copy_`` casts and scaling), staged to the
host with ``Tensor.copy_`` once per fused item, results returned on the device; autograd and
DistributedOptimizer included. Closed forms: rank r contributes r + 1.

The checks live in ``torch_workers/devices.py``, which runs in the framework jobs, one per world
size (framework_jobs.py: a rank that imports torch costs seconds of CPU to start).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from framework_jobs import TEST_TIMEOUT_S, installed, passed

pytestmark = [pytest.mark.timeout(TEST_TIMEOUT_S),
              pytest.mark.skipif(not installed("torch"), reason="needs torch")]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_collectives_and_autograd_on_the_stand_in(n: int) -> None:
    passed(n, r"PASS devices: 9 checks \(rank {r}\)$")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_distributed_optimizer_on_the_stand_in_matches_cpu_training(n: int) -> None:
    """Each rank checked that the stand-in model equals the same training on the CPU; every rank
    holds the same model."""
    results = [json.loads(m.group(1))
               for m in passed(n, r"PASS devices training \(rank {r}\): (\[.*\])$")]
    for res in results[1:]:
        np.testing.assert_array_equal(res, results[0])
