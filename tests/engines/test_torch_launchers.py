"""ringflow under torch's launch contracts, with no RINGFLOW_* variable (issue 15).

Real torchrun (1 node x 2; 2 nodes x 1 on this host; inside an sbatch step's environment),
``python -m torch.distributed.launch``, torch's ``env://`` contract without LOCAL_RANK, a
process that initialised torch.distributed first (and one that initialises it after ringflow,
on the same MASTER_PORT), ``mp.spawn``-style workers setting RANK/WORLD_SIZE inside an srun
step, and ``ringflow.init(rank=, size=, init_method=)`` with tcp://, file:// and env:// (also
without torch). Each process checks exact collectives and the key-value client (workers/job.py);
under torchrun on one node and where torch.distributed was initialised first, also a short
training run against one process on the global batch (``--train``). A launcher decides the ranks
and the rendezvous, which the collectives check; training adds torch and its optimizer, the same
under every launcher, at 4 CPU-s a process. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from engine_harness import JOB, clean_env, loopback_namespace, passes, python, run_all

from ringflow.testing import free_port

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def isolated():
    """torchrun's agent store listens on every interface: run torchrun in a namespace that has
    only a loopback interface."""
    with loopback_namespace() as prefix:
        yield prefix


TORCHRUN = python("-m", "torch.distributed.run")
#: What an sbatch batch step leaves in the environment of what it starts (no SLURM_STEP_*).
BATCH_STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_NTASKS": "4",
              "SLURM_NPROCS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1",
              "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "4",
              "SLURMD_NODENAME": "localhost"}


def expected(n: int, local: list[tuple[int, int, int, int]], via: str) -> list[str]:
    return sorted(f"PASS rank {r}/{n} local {lr}/{ls} cross {cr}/{cs} via {via}"
                  for r, (lr, ls, cr, cs) in enumerate(local))


def test_torchrun_one_node_two_processes(isolated) -> None:
    out = passes(run_all([(isolated + TORCHRUN + ["--standalone", "--nproc-per-node", "2", JOB,
                                       "--size", "2", "--train"], clean_env())]))
    assert out == expected(2, [(0, 2, 0, 1), (1, 2, 0, 1)], "torchrun")


def test_torchrun_two_nodes_of_one_process_with_c10d_rendezvous(isolated) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node = isolated + TORCHRUN + [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        endpoint, "--rdzv-id", "two-nodes", JOB, "--size", "2"]
    out = passes(run_all([(node, clean_env()), (node, clean_env())]))
    # torchrun numbers the nodes (GROUP_RANK): two hosts of one rank each, for ringflow too.
    assert out == expected(2, [(0, 1, 0, 2), (0, 1, 1, 2)], "torchrun")


def test_torchrun_two_nodes_restart_after_a_death_with_a_store_per_round(isolated, tmp_path):
    """Rank 1 dies (SIGKILL) before init(); its agent restarts it and counts a restart, the
    other agent restarts its worker for the new rendezvous round without counting one. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (which torch's own gloo needs here: with one shared
    store its restarted workers may read the dead ones' addresses) each round has a store of
    its own. ringflow's keys used to carry the restart count, which then differed between the
    two workers: they never met, and the job timed out."""
    endpoint = f"127.0.0.1:{free_port()}"
    node = isolated + TORCHRUN + [
        "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend",
        "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "restarts", JOB, "--size", "2",
        "--die-once", str(tmp_path / "died")]
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", RINGFLOW_TIMEOUT_S="15")
    out = passes(run_all([(node, env), (node, env)]))
    assert (tmp_path / "died").exists()
    assert out == expected(2, [(0, 1, 0, 2), (0, 1, 1, 2)], "torchrun")


def test_torchrun_inside_an_sbatch_step_uses_torchruns_world(isolated) -> None:
    """Used to be silently wrong: the batch step's SLURM_* variables won over torchrun's."""
    out = passes(run_all([(isolated + TORCHRUN + ["--standalone", "--nproc-per-node", "3", JOB,
                                       "--size", "3"], clean_env(**BATCH_STEP))]))
    assert out == expected(3, [(0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)], "torchrun")


def test_torch_distributed_launch(isolated) -> None:
    cmd = isolated + python("-m", "torch.distributed.launch", "--use-env", "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()), JOB,
                 "--size", "2")
    assert passes(run_all([(cmd, clean_env())])) == expected(2, [(0, 2, 0, 1), (1, 2, 0, 1)],
                                                             "torchrun")


def env_contract(n: int, **extra: str) -> list[dict[str, str]]:
    port = str(free_port())
    return [clean_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, **extra) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_env_contract_without_local_rank(n: int) -> None:
    """Kubeflow PyTorchJob / SageMaker style: used to be n jobs of one rank each."""
    out = passes(run_all([(python(JOB, "--size", str(n)), env)
                          for env in env_contract(n)]))
    assert out == expected(n, [(r, n, 0, 1) for r in range(n)], "env")


def test_mp_spawn_style_workers_inside_an_srun_step() -> None:
    """Workers that set RANK/WORLD_SIZE themselves win over the srun step they run in."""
    step = {**BATCH_STEP, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}
    out = passes(run_all([(python(JOB, "--size", "2"), {**env, **step})
                          for env in env_contract(2)]))
    assert out == expected(2, [(0, 2, 0, 1), (1, 2, 0, 1)], "env")


def test_torch_distributed_initialised_first_carries_the_rendezvous() -> None:
    out = passes(run_all([(python(JOB, "--init", "torch-first", "--size", "2", "--train"), env)
                          for env in env_contract(2)]))
    assert out == expected(2, [(0, 2, 0, 1), (1, 2, 0, 1)], "torch")


AFTER = """
import numpy as np, torch, torch.distributed as dist
import ringflow as rf
rf.init()
dist.init_process_group("gloo")   # env://, the MASTER_PORT that ringflow's rank 0 serves
r, n = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), r + 1.0)
dist.all_reduce(t)
assert t.tolist() == [n * (n + 1) / 2] * 3, t
assert rf.allreduce(np.full(3, r + 1.0), name="x", op=rf.Sum).tolist() == t.tolist()
rf.shutdown()
dist.destroy_process_group()
print(f"PASS rank {r}/{n}", flush=True)
"""


def test_torch_distributed_initialised_after_ringflow_shares_the_port() -> None:
    out = passes(run_all([(python("-c", AFTER), env) for env in env_contract(2)]))
    assert out == ["PASS rank 0/2", "PASS rank 1/2"]


@pytest.mark.parametrize("scheme", ["tcp", "file", "env"])
def test_explicit_init_with_rank_size_and_init_method(scheme: str, tmp_path) -> None:
    port = free_port()
    url = {"tcp": f"tcp://127.0.0.1:{port}", "file": f"file://{tmp_path}/store",
           "env": "env://"}[scheme]
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if scheme == "env" else {}
    out = passes(run_all([(python(JOB, "--init", "explicit", "--init-method", url, "--size",
                                  "3"), clean_env(JOB_RANK=str(r), JOB_SIZE="3", **extra))
                          for r in range(3)]))
    assert out == expected(3, [(r, 3, 0, 1) for r in range(3)], "init")


WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; sys.argv[1:] = ['--size', '2']; " \
    "import runpy; runpy.run_path({job!r}, run_name='__main__')"


def test_env_contract_without_torch_uses_ringflows_own_store() -> None:
    code = WITHOUT_TORCH.format(job=JOB)
    out = passes(run_all([(python("-c", code), env) for env in env_contract(2)]))
    assert out == expected(2, [(0, 2, 0, 1), (1, 2, 0, 1)], "env")


@pytest.mark.parametrize(("env", "fragment"), [
    (BATCH_STEP, "SLURM_NTASKS=4 says this job has 4 processes"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 says this job has 2 processes, but RANK is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT not set"),
])
def test_a_world_that_cannot_be_joined_is_a_clear_error_never_a_job_of_one(env, fragment):
    (result,) = run_all([(python(JOB), clean_env(**env))], timeout=60)
    assert result.returncode != 0 and fragment in result.stdout, result.stdout[-3000:]
    assert "PASS" not in result.stdout
