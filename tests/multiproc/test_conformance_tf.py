"""Horovod 0.28 conformance of ringflow.tensorflow (issue 14), eager and inside ``tf.function``,
at 2 and 3 ranks; and the cross-framework check: forward and gradients of every differentiable
collective are equal in torch and TensorFlow (both apply the adapter kit's rules).

The checks live in ``conformance/worker.py``, shared with test_conformance_torch.py. Every
mode runs in one job per world size, after the rooted collectives (conformance/launch.py: a
TensorFlow process costs several CPU-seconds to start); each test reads its mode's lines.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from conformance.launch import frameworks_at

pytestmark = pytest.mark.timeout(420)


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("mode", ["tf-eager", "tf-function"])
def test_tf_conformance(mode: str, np_: int) -> None:
    out = frameworks_at(np_)
    assert out.count(f"PASS {mode}: ") == np_, out[-8000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_and_tensorflow_agree(np_: int) -> None:
    pytest.importorskip("torch")
    out = frameworks_at(np_)
    assert out.count("PASS cross: ") == np_, out[-8000:]
