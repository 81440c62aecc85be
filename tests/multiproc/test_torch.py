"""ringflow.torch through ringflow-run with real processes (2 and 3 ranks) and alone (1 rank).

Each worker script in ``torch_workers/`` batches many checks (every collective in sync, async and
in-place forms and dtypes; autograd of each collective in closed form; DistributedOptimizer
against single-process training on the concatenated batch; broadcast helpers; SyncBatchNorm
against nn.BatchNorm on the global batch; the sampler), because starting a rank with torch costs
seconds; the scripts run in the framework jobs, one per world size (framework_jobs.py: the same
processes as other files' scripts). A script prints ``PASS <script>: <n> checks rank r/n`` on
every rank; a failure names its rank.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from framework_jobs import TEST_TIMEOUT_S, passed

pytest.importorskip("torch")

import ringflow
from ringflow.testing import CommandFailure, CommandResult, run_commands

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}


def run(script: str | Path, np: int, *args: str, timeout: float = 60) -> CommandResult:
    cmd = [sys.executable, str(script), *args]
    if np > 1:
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np), *cmd]
    try:
        (result,) = run_commands([cmd], env=ENV, timeout=timeout, check=False, merge_stderr=False)
    except CommandFailure as exc:  # the deadline
        printed = exc.results[0].output.count("PASS ")
        pytest.fail(f"{printed} of {np} ranks had printed PASS (all of them: the hang is at "
                    f"shutdown)\n{exc}")
    return result


@pytest.mark.parametrize("np", [1, 2, 3])
def test_collectives(np: int) -> None:
    passed(np, r"PASS collectives: \d+ checks rank {r}/{n}\b")


@pytest.mark.parametrize("np", [1, 2, 3])
def test_autograd_optimizer_broadcast_syncbn_sampler(np: int) -> None:
    passed(np, r"PASS autograd_and_training: \d+ checks rank {r}/{n}\b")


@pytest.mark.parametrize("np", [1, 2, 3])
def test_join_every_rank_first_with_cached_new_and_unnamed_names(np: int) -> None:
    passed(np, r"PASS join: \d+ checks rank {r}/{n}\b")


def test_local_error_fails_every_rank_without_hang(tmp_path: Path) -> None:
    """A tensor only one rank cannot send (here: a complex dtype, then a non-tensor) fails the
    operation on every rank with the same text, and the job goes on."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import torch
        import ringflow.torch as hvd
        hvd.init()
        r = hvd.rank()
        for bad in (torch.zeros(2, dtype=torch.complex64), "not a tensor"):
            try:
                hvd.allreduce(bad if r == 1 else torch.zeros(2), name="x")
            except Exception as e:
                print("ERR", type(e).__name__, str(e).split(";")[0])
        print("OK", hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item())
    """))
    proc = run(script, 2, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = sorted(line.split(":", 1)[1] for line in proc.stdout.splitlines() if "ERR" in line)
    assert len(errs) == 4, proc.stdout
    assert errs[0] == errs[1] and errs[2] == errs[3], errs  # same text on both ranks
    assert any("complex64" in e for e in errs) and any("torch.Tensor" in e for e in errs)
    assert proc.stdout.count("OK 2.0") == 2, proc.stdout


def test_optimizer_misuse_raises_horovods_error_types(tmp_path) -> None:
    """Single process: the module imports, builds flags are truthful, and bad arguments raise."""
    import torch

    import ringflow.torch as hvd

    hvd.init()
    try:
        model = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        assert isinstance(opt, torch.optim.SGD)
        from ringflow.algorithms import nccl

        assert hvd.gloo_built() is False and hvd.nccl_built() is not bool(nccl.unusable_reason())
        assert hvd.mpi_enabled() is False and hvd.mpi_threads_supported() is False
        assert not (hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
        assert hvd.cuda_built() is torch.cuda.is_available() or hvd.nccl_built()
        assert hvd.mpi_built() in (True, False)
        hvd.start_timeline(str(tmp_path / "timeline.json"))  # the core's; its test is elsewhere
        hvd.stop_timeline()
        with pytest.raises(ValueError, match="named_parameters should be a sequence of tuples"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=[model.weight, model.bias])
        with pytest.raises(ValueError, match="must be unique"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=[("a", model.weight), ("a", model.bias)])
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)  # Horovod raises
        with pytest.raises(hvd.OptimizerMisuseError):
            raise hvd.OptimizerMisuseError("x")
        assert issubclass(hvd.OptimizerMisuseError, AssertionError)
    finally:
        hvd.shutdown()
