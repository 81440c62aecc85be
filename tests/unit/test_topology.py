"""ringflow.topology.detect: every launcher environment, and inconsistent values."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from ringflow import topology
from ringflow.errors import ConfigError
from ringflow.topology import RankInfo, detect, place

pytestmark = pytest.mark.timeout(120)


def ringflow_env(rank: int = 1, size: int = 4, local_rank: int = 1, local_size: int = 2,
                 cross_rank: int = 0, cross_size: int = 2) -> dict[str, str]:
    return {
        "RINGFLOW_RANK": str(rank), "RINGFLOW_SIZE": str(size),
        "RINGFLOW_LOCAL_RANK": str(local_rank), "RINGFLOW_LOCAL_SIZE": str(local_size),
        "RINGFLOW_CROSS_RANK": str(cross_rank), "RINGFLOW_CROSS_SIZE": str(cross_size),
        "RINGFLOW_HOSTNAME": "node-a",
    }


def test_single_process_without_launcher():
    assert detect({}) == RankInfo(0, 1, 0, 1, 0, 1, socket.gethostname(), "single")


def test_ringflow_run():
    info = detect(ringflow_env())
    assert info == RankInfo(1, 4, 1, 2, 0, 2, "node-a", "ringflow")


def test_ringflow_wins_over_other_launchers():
    env = {**ringflow_env(), "OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "2", "RANK": "0"}
    assert detect(env).detector == "ringflow"


@pytest.mark.parametrize(
    ("rank", "size", "local_rank", "local_size", "cross"),
    [(0, 1, 0, 1, (0, 1)), (5, 8, 1, 4, (1, 2)), (4, 6, 0, 4, (1, 2)), (2, 3, 2, 3, (0, 1))],
)
def test_open_mpi_derives_hosts_assuming_homogeneous_block_mapping(
    rank, size, local_rank, local_size, cross
):
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }
    info = detect(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (
        rank, size, local_rank, local_size
    )
    assert (info.cross_rank, info.cross_size) == cross
    assert info.detector == "openmpi"


def test_mpich_pmi_with_local_ids():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = detect(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (3, 4, 1, 2)
    assert (info.cross_rank, info.cross_size, info.detector) == (1, 2, "pmi")


def test_mpich_pmi_without_local_ids_assumes_one_rank_per_host():
    info = detect({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (info.local_rank, info.local_size, info.cross_rank, info.cross_size) == (0, 1, 2, 3)


def test_slurm_heterogeneous_tasks_per_node():
    # 3 nodes with 2, 2, 1 tasks: rank 4 is the only task of node 2.
    env = {
        "SLURM_PROCID": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURMD_NODENAME": "cn07",
    }
    assert detect(env) == RankInfo(4, 5, 0, 1, 2, 3, "cn07", "slurm")


def test_slurm_step_variables_win():
    env = {
        "SLURM_PROCID": "1", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_STEP_TASKS_PER_NODE": "2",
    }
    info = detect(env)
    assert (info.size, info.local_size, info.cross_size) == (2, 2, 1)


def test_slurm_bad_task_list_names_the_variable():
    env = {
        "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "two",
    }
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE='two'"):
        detect(env)


def test_torchrun_with_group_variables():
    env = {
        "TORCHELASTIC_RUN_ID": "none", "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    }
    info = detect(env)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (5, 6, 2, 3)
    assert (info.cross_rank, info.cross_size, info.detector) == (1, 2, "torchrun")


def test_torchrun_without_group_variables_derives_hosts():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    info = detect(env)
    assert (info.cross_rank, info.cross_size) == (1, 2)


def test_a_lone_rank_variable_is_not_torchrun():
    assert detect({"RANK": "3"}).detector == "single"


def test_env_contract_without_local_rank_is_placed_later_from_hostnames():
    # Kubeflow PyTorchJob / SageMaker style: RANK, WORLD_SIZE, MASTER_* only.
    info = detect({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    assert (info.rank, info.size, info.detector, info.placed) == (2, 4, "env", False)
    placed = place(info, ["n1", "n1", "n2", "n2"])
    assert placed == RankInfo(2, 4, 0, 2, 1, 2, "n2", "env")


def test_env_contract_with_only_local_rank_is_placed_from_hostnames_too():
    # Without LOCAL_WORLD_SIZE nothing says how many ranks share the host.
    info = detect({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"})
    assert not info.placed


@pytest.mark.parametrize(("hosts", "expected"), [
    (["a"], [(0, 1, 0, 1)]),
    (["a", "b", "a", "b"], [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]),
    (["b", "a", "a"], [(0, 1, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]),
])
def test_place_numbers_hosts_by_their_lowest_rank(hosts, expected):
    got = [place(RankInfo(r, len(hosts), 0, 0, 0, 0, "x", "env"), hosts) for r in range(len(hosts))]
    assert [(i.local_rank, i.local_size, i.cross_rank, i.cross_size) for i in got] == expected


def test_innermost_launcher_wins():
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
             "SLURM_TASKS_PER_NODE": "2"}
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job"}
    # torchrun inside an sbatch step: torchrun's variables, not the step's.
    assert detect({**slurm, **torchrun}) == RankInfo(3, 4, 1, 2, 1, 2, socket.gethostname(),
                                                      "torchrun")
    # mp.spawn workers that set RANK/WORLD_SIZE themselves inside srun.
    spawned = detect({**slurm, "RANK": "1", "WORLD_SIZE": "4"})
    assert (spawned.rank, spawned.size, spawned.detector) == (1, 4, "env")
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert detect({**slurm, **ompi}).detector == "openmpi"


@pytest.mark.parametrize(("env", "fragments"), [
    # python train.py in an sbatch script with --ntasks=4 and no srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"},
     ["SLURM_NTASKS=4 says this job has 4 processes", "srun python", "RANK=0 WORLD_SIZE=1"]),
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 says this job has 2 processes", "RANK is not set"]),
    ({"RINGFLOW_SIZE": "3"}, ["RINGFLOW_SIZE=3", "RINGFLOW_RANK is not set"]),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_SIZE=2", "through the launcher"]),
    ({"PMI_SIZE": "8"}, ["PMI_SIZE=8"]),
])
def test_a_visible_world_larger_than_one_is_never_run_alone(env, fragments):
    with pytest.raises(ConfigError) as err:
        detect(env)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_world_of_one_may_be_asked_for_explicitly_inside_an_allocation():
    info = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "RANK": "0", "WORLD_SIZE": "1"})
    assert (info.rank, info.size) == (0, 1)
    assert detect({"SLURM_NTASKS": "1", "WORLD_SIZE": "1"}).size == 1


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RINGFLOW_RANK": "4", "RINGFLOW_SIZE": "4"}, "RINGFLOW_RANK=4"),
        ({"RINGFLOW_RANK": "-1"}, "RINGFLOW_RANK='-1' is negative"),
        ({"RINGFLOW_SIZE": "two"}, "RINGFLOW_SIZE='two' is not an integer"),
        ({"RINGFLOW_SIZE": "0", "RINGFLOW_RANK": "0"}, "RINGFLOW_SIZE=0"),
        ({"RINGFLOW_LOCAL_RANK": "2"}, "RINGFLOW_LOCAL_RANK=2"),
        ({"RINGFLOW_CROSS_SIZE": "9"}, "RINGFLOW_CROSS_SIZE=9"),
        ({"RINGFLOW_CROSS_RANK": "2"}, "RINGFLOW_CROSS_RANK=2"),
        ({"RINGFLOW_LOCAL_SIZE": "5"}, "RINGFLOW_LOCAL_SIZE=5"),
    ],
)
def test_inconsistent_ringflow_values_name_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        detect({**ringflow_env(), **env})


def test_missing_sibling_variable_is_named():
    env = ringflow_env()
    del env["RINGFLOW_LOCAL_SIZE"]
    with pytest.raises(ConfigError, match="RINGFLOW_LOCAL_SIZE is not set"):
        detect(env)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
         "OMPI_COMM_WORLD_RANK=2"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "0"},
         "OMPI_COMM_WORLD_LOCAL_SIZE=0"),
        ({"PMI_RANK": "1.5", "PMI_SIZE": "2"}, "PMI_RANK='1.5' is not an integer"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "2"},
         "MPI_LOCALRANKID=3"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
          "SLURM_NODEID": "3", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)"},
         "SLURM_NODEID=3"),
        ({"RANK": "7", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK=7"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"},
         "LOCAL_RANK='x'"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"},
         "LOCAL_WORLD_SIZE=0"),
    ],
)
def test_inconsistent_foreign_values_name_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        detect(env)


def test_rank_info_is_frozen():
    info = detect({})
    with pytest.raises(AttributeError):
        info.rank = 3  # type: ignore[misc]


@pytest.mark.parametrize(("local_size", "cpus", "shares"), [
    (2, [0, 1], [[0], [1]]),
    (2, [3, 1, 2, 0], [[0, 1], [2, 3]]),  # sorted, then sliced
    (3, range(8), [[0, 1], [2, 3], [4, 5]]),  # the remainder stays unused
    (4, [0, 1], [[0], [1], [0], [1]]),  # more ranks than CPUs: one each, round-robin
    (1, [5], [[5]]),
])
def test_cpu_share_slices_the_cpus_among_local_ranks(local_size, cpus, shares) -> None:
    from ringflow.topology import cpu_share

    assert [cpu_share(r, local_size, cpus) for r in range(local_size)] == shares


def test_auto_binding_only_where_every_rank_gets_cpus_nobody_placed(monkeypatch):
    info = RankInfo(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                    hostname="a")
    monkeypatch.setattr(topology.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert topology.auto_binding(info) == ""
    assert topology.auto_binding(dataclasses.replace(info, local_size=5, size=5)) == (
        "5 ranks on this host share its 4 CPUs")
    assert topology.auto_binding(dataclasses.replace(info, local_size=1, size=1)) == (
        "the only rank on its host")
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: {2, 3})
    assert topology.auto_binding(info) == "already placed on 2 of the 4 CPUs"
