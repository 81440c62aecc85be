"""Horovod 0.28 conformance of ringflow.torch (issue 14), at 2 and 3 ranks through ringflow-run.

The checks live in ``conformance/worker.py`` (shared with the TensorFlow module): errors are
``HorovodInternalError``s on every rank and the next operation succeeds; duplicate names raise at
the call; broadcast roots are global; sparse allreduce and ``sparse_as_dense``; reducescatter
gradients and scale arithmetic; Adasum; join with allreduce, allgather and broadcast;
``broadcast_optimizer_state`` for every ``torch.optim`` optimizer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conformance.launch import run_script
from framework_jobs import TEST_TIMEOUT_S, passed

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_conformance(np_: int) -> None:
    """In the framework jobs (framework_jobs.py)."""
    passed(np_, r"PASS torch: \d+ checks \(rank {r}\)")


@pytest.mark.parametrize("np_", [2, 3])
def test_fifty_operations_with_a_dozen_failures_in_one_process(np_: int) -> None:
    """One process per rank survives its errors: 50 operations, 12 failing on purpose, within the
    issue's minute (about 0.1 s of collectives at 2 ranks). In the framework jobs."""
    for match in passed(np_, r"PASS 50 ops 12 failures in ([0-9.]+) s \(rank {r}\)$"):
        assert float(match.group(1)) < 60, match.group(0)


def test_stall_shutdown_then_shutdown_and_init_under_ringflow_run() -> None:
    out = run_script("reinit.py", 2, env={"RINGFLOW_STALL_SHUTDOWN_S": "2"})
    assert out.count("PASS rank") == 2 and "stall: tensor 'stall." in out, out[-4000:]
