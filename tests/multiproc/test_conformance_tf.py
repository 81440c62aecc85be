"""Horovod 0.28 conformance of ringflow.tensorflow (issue 14), eager and inside ``tf.function``,
at 2 and 3 ranks; and the cross-framework check: forward and gradients of every differentiable
collective are equal in torch and TensorFlow (both apply the adapter kit's rules).

The checks live in ``conformance/worker.py``, shared with test_conformance_torch.py; every mode
runs in the framework jobs, one per world size (framework_jobs.py: a TensorFlow process costs
several CPU-seconds to start); each test reads its mode's lines.
"""

from __future__ import annotations

import pytest
from framework_jobs import TEST_TIMEOUT_S, installed, passed

pytestmark = [pytest.mark.timeout(TEST_TIMEOUT_S),
              pytest.mark.skipif(not installed("tensorflow"), reason="needs tensorflow")]


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("mode", ["tf-eager", "tf-function"])
def test_tf_conformance(mode: str, np_: int) -> None:
    passed(np_, rf"PASS {mode}: \d+ checks \(rank {{r}}\)")


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_and_tensorflow_agree(np_: int) -> None:
    if not installed("torch"):
        pytest.skip("needs torch")
    passed(np_, r"PASS cross: \d+ checks \(rank {r}\)")
