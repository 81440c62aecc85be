"""ringflow-run with other launchers' conventions, real processes on this host: torchrun's
environment (torch.distributed's env:// inside a ringflow job), mpirun's -x NAME=VALUE, and
Horovod's variables."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(180)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("RINGFLOW_", "HOROVOD_"))}
ENV["PYTHONPATH"] = PYTHONPATH
for stale in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(stale, None)


def launch(*args: str, env=None, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    (result,) = run_commands([[sys.executable, "-m", "ringflow.runner", *args]], env=env or ENV,
                             timeout=timeout, check=False, merge_stderr=False)
    return result


def script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


TORCH_AND_RINGFLOW = """
    import os
    import numpy as np
    import torch
    import torch.distributed as dist
    import ringflow

    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (rank, size) == (int(os.environ["RINGFLOW_RANK"]), int(os.environ["RINGFLOW_SIZE"]))
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    ok_torch = torch.equal(t, torch.arange(5, dtype=torch.float32) * (size * (size + 1) // 2))

    ringflow.init()
    assert (ringflow.rank(), ringflow.size()) == (rank, size)
    x = np.arange(1001, dtype=np.float64) * (rank + 1)
    y = ringflow.allreduce(x, name="x", op=ringflow.Sum)
    ok_ringflow = np.array_equal(y, np.arange(1001, dtype=np.float64) * (size * (size + 1) // 2))
    # torch's store listens on MASTER_PORT; ringflow's own rendezvous is elsewhere.
    assert os.environ["MASTER_PORT"] != os.environ["RINGFLOW_RENDEZVOUS_PORT"]
    print(f"rank {rank} torch {ok_torch} ringflow {ok_ringflow}", flush=True)
    ringflow.shutdown()
    dist.barrier()
    dist.destroy_process_group()
"""


def test_torch_distributed_env_init_and_ringflow_in_one_job(tmp_path):
    pytest.importorskip("torch")
    proc = launch("-np", "2", sys.executable, script(tmp_path, TORCH_AND_RINGFLOW))
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        assert f"[{rank}]:rank {rank} torch True ringflow True" in proc.stdout.splitlines(), (
            proc.stdout, proc.stderr)


CONTRACT = """
    import os
    e = os.environ
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "FOO", "KEPT", "EMPTY")
    print(" ".join(f"{n}={e.get(n)}" for n in names), int(e["MASTER_PORT"]) > 0)
"""


def test_torchrun_variables_and_x_assignments_reach_every_worker(tmp_path):
    env = {**ENV, "KEPT": "from the launcher", "FOO": "overridden"}
    # torchrun's spelling, and a .py file run with this Python as torchrun would run it.
    proc = launch("--nproc-per-node", "3", "-x", "FOO=bar baz", "-x", "KEPT", "-x", "EMPTY=",
                  script(tmp_path, CONTRACT), env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"[{r}]:RANK={r} LOCAL_RANK={r} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 "
        f"GROUP_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 FOO=bar baz KEPT=from the launcher EMPTY= "
        "True" for r in range(3)
    ]
    assert len({line.split()[-1] for line in proc.stdout.splitlines()}) == 1


HOROVOD = """
    import os, ringflow
    from ringflow.config import Config
    c = Config.from_env()
    print(c.cycle_time_ms, c.fusion_threshold_bytes, c.stall_shutdown_s, c.autotune)
"""


def test_horovod_variables_are_read_once_by_the_launcher(tmp_path):
    env = {**ENV, "HOROVOD_CYCLE_TIME": "5", "HOROVOD_FUSION_THRESHOLD": "1048576",
           "HOROVOD_AUTOTUNE": "1"}
    proc = launch("-np", "2", "--stall-check-shutdown-time-seconds", "9", "--autotune",
                  sys.executable, script(tmp_path, HOROVOD), env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]:5.0 1048576 9.0 True",
                                                "[1]:5.0 1048576 9.0 True"]
    err = proc.stderr.splitlines()
    assert "ringflow-run: warning: HOROVOD_CYCLE_TIME=5 read as RINGFLOW_CYCLE_TIME_MS=5.0" in err
    assert not [line for line in err if "AUTOTUNE" in line], err  # --autotune says the same
    # The workers do not repeat what the launcher said.
    assert not [line for line in err if line.startswith("[")], err


def test_refused_flag_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    proc = launch("-np", "2", "--rdzv-id", "1", sys.executable, "-c",
                  f"open({str(marker)!r}, 'w').close()")
    assert proc.returncode == 2
    assert proc.stderr.startswith("ringflow-run: --rdzv-id: ringflow-run runs the job's "
                                  "rendezvous itself")
    assert not marker.exists()
