"""ringflow.run, @ringflow.launcher, and jobs that other launchers start (Slurm, torchrun)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import ringflow
from ringflow.errors import ConfigError, RankFailure
from ringflow.testing import free_port, run_commands

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)


def allreduce_rank_plus_one(scale, *, offset=0):
    ringflow.init()
    try:
        total = ringflow.allreduce(np.full(7, ringflow.rank() + 1.0), name="t", op=ringflow.Sum)
        return ringflow.rank(), ringflow.size(), float(total[0]) * scale + offset
    finally:
        ringflow.shutdown()


@ringflow.launcher(np=3, timeout=60)
def decorated(word):
    return f"{word} from {os.environ['RINGFLOW_RANK']}"


@pytest.mark.parametrize("np_", [1, 3])
def test_run_returns_each_ranks_result(np_):
    results = ringflow.run(allreduce_rank_plus_one, args=(2,), kwargs={"offset": 1}, np=np_,
                           timeout=60)
    total = np_ * (np_ + 1) / 2
    assert results == [(r, np_, total * 2 + 1) for r in range(np_)]


def test_run_takes_lambdas_through_cloudpickle():
    pytest.importorskip("cloudpickle")
    results = ringflow.run(lambda: int(os.environ["RINGFLOW_RANK"]) ** 2, np=3, timeout=60)
    assert results == [0, 1, 4]


def test_launcher_decorator():
    assert decorated("hi") == ["hi from 0", "hi from 1", "hi from 2"]


def raise_on_rank_one():
    if os.environ["RINGFLOW_RANK"] == "1":
        raise KeyError("no such thing")
    return "ok"


def test_run_names_the_failing_rank():
    with pytest.raises(RankFailure) as info:
        ringflow.run(raise_on_rank_one, np=2, timeout=60)
    assert info.value.rank == 1 and "KeyError: 'no such thing'" in str(info.value)


def test_run_errors():
    with pytest.raises(ConfigError, match="np=0"):
        ringflow.run(print, np=0)
    with pytest.raises(ringflow.errors.LaunchError, match="more processes than"):
        ringflow.run(print, np=3, hosts="localhost:2")


# Other launchers: two processes started by the test with the environment srun / torchrun give.

JOB = f"""
import sys
sys.path.insert(0, {ROOT!r})
import numpy as np
import ringflow as rf
rf.init()
total = rf.allreduce(np.full(5, rf.rank() + 1.0), name="x", op=rf.Sum)
print(rf.rank(), rf.size(), rf.local_rank(), int(total[0]), flush=True)
rf.shutdown()
"""


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RINGFLOW_", "SLURM_", "OMPI_", "PMI_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def start_two(tmp_path, env_of) -> list[str]:
    key = tmp_path / "job.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    port = free_port()
    results = run_commands(
        [[sys.executable, "-c", JOB]] * 2,
        env=[{**clean_env(), **env_of(rank), "RINGFLOW_RENDEZVOUS_PORT": str(port),
              "RINGFLOW_SECRET_FILE": str(key)} for rank in range(2)],
        timeout=60, merge_stderr=False)
    return [r.stdout.strip() for r in results]


def test_simulated_slurm_job_with_the_documented_variables(tmp_path):
    def env_of(rank):
        return {
            "SLURM_PROCID": str(rank), "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NNODES": "1",
            "SLURM_TASKS_PER_NODE": "2",
            "SLURM_JOB_ID": "42", "RINGFLOW_RENDEZVOUS_ADDR": "127.0.0.1",
        }

    assert start_two(tmp_path, env_of) == ["0 2 0 3", "1 2 1 3"]


def test_simulated_torchrun_job_uses_master_addr(tmp_path):
    def env_of(rank):
        return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

    assert start_two(tmp_path, env_of) == ["0 2 0 3", "1 2 1 3"]


def test_foreign_launcher_without_rendezvous_says_what_to_set():
    from ringflow.bootstrap import connect_store
    from ringflow.topology import RankInfo

    info = RankInfo(1, 2, 1, 2, 0, 1, "h", "slurm")
    with pytest.raises(ConfigError, match="set MASTER_ADDR to the host of task 0"):
        connect_store(info, 1.0, environ={})
    with pytest.raises(ConfigError, match="RINGFLOW_SECRET_FILE to it on every rank"):
        connect_store(info, 1.0, environ={"RINGFLOW_RENDEZVOUS_ADDR": "127.0.0.1",
                                          "RINGFLOW_RENDEZVOUS_PORT": "5"})
    with pytest.raises(ConfigError, match="RINGFLOW_RENDEZVOUS_PORT='' is not a port number"):
        connect_store(info, 1.0, environ={"RINGFLOW_RENDEZVOUS_ADDR": "127.0.0.1"})
    with pytest.raises(ConfigError, match="no ringflow rendezvous is configured"):
        connect_store(RankInfo(1, 2, 1, 2, 0, 1, "h", "single"), 1.0, environ={})
