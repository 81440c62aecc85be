"""ringflow under Slurm, simulated on network-namespace hosts: ``srun`` tasks with exactly the
SLURM_* variables a real step sets and no RINGFLOW_* variable (tests/engines/fake_slurm.py), the
two sbatch examples in examples/slurm, and the batch script that forgets srun. workers/job.py
checks exact collectives and the key-value client on every rank; the two-node srun step also
trains (``--train``: the hierarchical path across hosts; test_torch_launchers.py says why not
everywhere).

Each namespace host resolves the others' names (``h1``, ``h2``) and reaches them only over the
test's own bridge; task 0 serves the rendezvous on ``h1``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("hostlist", reason="python-hostlist is not installed (ringflow[slurm])")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multihost"))
import netns_cluster
from engine_harness import JOB, ROOT, clean_env, passes, run_all

pytestmark = pytest.mark.timeout(300)

BIN = Path(__file__).resolve().parent / "bin"


@pytest.fixture(scope="module")
def hosts():
    why = netns_cluster.unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netns_cluster.cluster(2) as c:
        yield c


def allocation(c: netns_cluster.Cluster, job_id: str = "731", **extra: str) -> dict[str, str]:
    """The environment of a batch script of job ``job_id`` on both hosts (the fake srun and
    scontrol first on PATH, python the interpreter running the tests)."""
    return clean_env(
        PATH=os.pathsep.join([str(BIN), os.path.dirname(sys.executable), os.environ["PATH"]]),
        PYTHON=sys.executable, SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="h[1-2]",
        SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="4", SLURM_NPROCS="4",
        SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
        SLURMD_NODENAME="h1", FAKE_SLURM_NAMESPACES=",".join(
            f"{h}={ns}" for h, ns in zip(c.hosts, c.namespaces, strict=True)),
        RINGFLOW_TIMEOUT_S="60", **extra)


def expected_4() -> list[str]:
    return sorted(f"PASS rank {r}/4 local {r % 2}/2 cross {r // 2}/2 via {{via}}"
                  for r in range(4))


def test_srun_two_nodes_two_tasks_each_with_no_extra_variables(hosts) -> None:
    cmd = [str(BIN / "srun"), "-N", "2", "--ntasks-per-node", "2", sys.executable, JOB,
           "--size", "4", "--train"]
    out = passes(run_all([(cmd, allocation(hosts))]))
    assert out == [line.format(via="slurm") for line in expected_4()]


def test_srun_with_a_secret_file_closes_the_rendezvous(hosts, tmp_path) -> None:
    key = tmp_path / "job.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    cmd = [str(BIN / "srun"), "-N", "2", "--ntasks-per-node", "2", sys.executable, JOB,
           "--size", "4"]
    out = passes(run_all([(cmd, allocation(hosts, "732", RINGFLOW_SECRET_FILE=str(key)))]))
    assert out == [line.format(via="slurm") for line in expected_4()]


@pytest.mark.parametrize(("script", "via"), [("srun.sbatch", "slurm"),
                                             ("torchrun.sbatch", "torchrun")])
def test_the_sbatch_examples(hosts, script: str, via: str) -> None:
    """The batch script runs on the first node, as Slurm runs it."""
    cmd = [*netns_cluster.on_host(hosts.namespaces[0], hosts.hosts[0]), "bash",
           str(ROOT / "examples" / "slurm" / script), "--size", "4"]
    env = allocation(hosts, "733" if via == "slurm" else "734", TRAIN_SCRIPT=JOB)
    out = passes(run_all([(cmd, env)]))
    assert out == [line.format(via=via) for line in expected_4()]


def test_python_in_the_batch_script_without_srun_is_an_error_not_a_job_of_one(hosts) -> None:
    cmd = [*netns_cluster.on_host(hosts.namespaces[0], hosts.hosts[0]), sys.executable, JOB]
    (result,) = run_all([(cmd, allocation(hosts, "735"))], timeout=60)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "SLURM_NTASKS=4 says this job has 4 processes" in result.stdout, result.stdout[-3000:]
    assert "srun python" in result.stdout


def test_the_fake_srun_sets_what_srun_sets() -> None:
    import fake_slurm

    env = fake_slurm.step_env("9", 1, ["n1", "n2", "n3"], 2, 2, 1)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"]) == ("5", "1", "2")
    assert (env["SLURM_STEP_NUM_TASKS"], env["SLURM_STEP_TASKS_PER_NODE"]) == ("6", "2(x3)")
    assert env["SLURM_STEP_NODELIST"] == "n[1-3]" and env["SLURMD_NODENAME"] == "n3"
