"""Horovod 0.28 conformance of ringflow.tensorflow (issue 14), eager and inside ``tf.function``,
at 2 and 3 ranks; and the cross-framework check: forward and gradients of every differentiable
collective are equal in torch and TensorFlow (both apply the adapter kit's rules).

The checks live in ``conformance/worker.py``, shared with test_conformance_torch.py. The three
modes run one after the other in one job per world size (a TensorFlow process costs several
CPU-seconds to start); each test reads its mode's lines.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

pytest.importorskip("tensorflow")

from conformance.launch import conform_modes

pytestmark = pytest.mark.timeout(420)

MODES = ["tf-eager", "tf-function"] + (["cross"] if importlib.util.find_spec("torch") else [])


@functools.cache
def output_at(np_: int) -> str:
    """The output of the job of every mode on ``np_`` ranks (run once)."""
    return conform_modes(MODES, np_)


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("mode", ["tf-eager", "tf-function"])
def test_tf_conformance(mode: str, np_: int) -> None:
    out = output_at(np_)
    assert out.count(f"PASS {mode}: ") == np_, out[-8000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_and_tensorflow_agree(np_: int) -> None:
    pytest.importorskip("torch")
    out = output_at(np_)
    assert out.count("PASS cross: ") == np_, out[-8000:]
