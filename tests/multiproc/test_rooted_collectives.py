"""reduce, gather and scatter through the engine in numpy, torch and TensorFlow (eager and
``tf.function``), at 1 rank alone and 2 to 4 through ringflow-run (TensorFlow at 1 to 3:
framework_jobs.py says why): every dtype, lengths 0, 1, odd and large, every root, closed forms
on every rank, and each error case on every rank followed by an operation that succeeds
(rooted/worker.py). The script runs in the framework jobs, one per world size, with every
installed framework (framework_jobs.py: the same processes as other files' scripts; a job per
framework started TensorFlow's and torch's processes three times as often)."""

from __future__ import annotations

import pytest
from framework_jobs import TEST_TIMEOUT_S, passed, rooted_frameworks

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


@pytest.mark.parametrize(("np_", "framework"), [
    (np_, framework) for np_ in (1, 2, 3, 4) for framework in ("numpy", "torch", "tensorflow")
    if np_ <= 3 or framework != "tensorflow"])  # framework_jobs.py: rooted_frameworks
def test_reduce_gather_scatter(framework: str, np_: int) -> None:
    pytest.importorskip(framework)
    assert framework in rooted_frameworks(np_)
    passed(np_, rf"PASS {framework} rank {{r}}/{{n}}: \d+ operations")
