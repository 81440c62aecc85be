"""reduce, gather and scatter through the engine in numpy, torch and TensorFlow (eager and
``tf.function``), at 1 to 4 ranks through ringflow-run (TensorFlow at 1 to 3:
conformance/launch.py says why): every dtype, lengths 0, 1, odd and
large, every root, closed forms on every rank, and each error case on every rank followed by an
operation that succeeds (rooted/worker.py). One job per world size runs every installed
framework, one after the other, and at 2 and 3 ranks the conformance checks after them in the
same processes (conformance/launch.py: a job per framework started TensorFlow's and torch's
processes three times as often for the same checks)."""

from __future__ import annotations

import pytest
from conformance.launch import frameworks_at, rooted_frameworks

pytestmark = pytest.mark.timeout(420)


@pytest.mark.parametrize(("np_", "framework"), [
    (np_, framework) for np_ in (1, 2, 3, 4) for framework in ("numpy", "torch", "tensorflow")
    if np_ <= 3 or framework != "tensorflow"])  # conformance/launch.py: rooted_frameworks
def test_reduce_gather_scatter(framework: str, np_: int) -> None:
    pytest.importorskip(framework)
    assert framework in rooted_frameworks(np_)
    out = frameworks_at(np_)
    assert out.count(f"PASS {framework} rank") == np_, out[-6000:]
