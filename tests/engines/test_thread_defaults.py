"""Thread counts that match the cores a rank has (ringflow/threads.py), under ringflow-run,
torchrun, mpirun and srun (the fake of tests/engines/bin), 2 ranks on this host.

Each rank reports, after ``ringflow.init()`` (workers/threads_check.py): ``torch.get_num_threads()``
(in the main thread and in a thread started after init), ``omp_get_max_threads()`` as torch's
``parallel_info()`` reads it and as the OpenMP runtime itself answers through ctypes, and the
``OMP_NUM_THREADS`` ... variables of its environment. (An OpenMP runtime that another library
loaded before ``init()`` keeps its size under a launcher that is not ringflow's: TensorFlow
brings scikit-learn's libgomp.) The expected count is the rule computed
here for the same host; the user's settings (a variable, ``torch.set_num_threads`` before init)
must be kept, with the note when they oversubscribe the cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from engine_harness import clean_env, loopback_namespace, python, run_all

from ringflow import threads
from ringflow.testing import CommandResult, free_port

pytestmark = pytest.mark.timeout(300)

WORKER = str(Path(__file__).resolve().parent / "workers" / "threads_check.py")
BIN = Path(__file__).resolve().parent / "bin"
RINGFLOW_RUN = python("-m", "ringflow.runner")
TORCHRUN = python("-m", "torch.distributed.run")
CORES = threads.physical_cores(threads.affinity())
#: The rule for 2 ranks that may run anywhere on this host (torchrun, srun: nothing binds them).
UNBOUND = threads.for_launcher({}, 0, 2, "none").threads


def env(**extra: str) -> dict[str, str]:
    """A clean environment without any thread variable (engine_harness sets OMP_NUM_THREADS=1)."""
    e = clean_env(**extra)
    for name in (*threads.VARIABLES, threads.MARK):
        if name not in extra:
            e.pop(name, None)
    return e


def reports(results: list[CommandResult], n: int = 2) -> list[dict[str, Any]]:
    out = "\n".join(r.stdout for r in results)
    assert all(r.returncode == 0 for r in results), out[-6000:]
    decoder = json.JSONDecoder()  # processes that share a pipe may run their lines together
    found = sorted((decoder.raw_decode(out, m.end())[0]
                    for m in re.finditer(r"THREADS (?=\{)", out)), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == list(range(n)), out[-6000:]
    return found


def assert_follow(found: list[dict[str, Any]], want: int) -> None:
    """torch, OpenMP and the environment all at ``want``."""
    for r in found:
        seen = (r["torch"], r["torch_new_thread"], r["omp"], r["omp_ctypes"], r["plan"]["threads"])
        assert seen == (want,) * 5, r
        assert r["env"]["OMP_NUM_THREADS"] == str(want), r


def oversubscribed(count: int) -> bool:
    return count * 2 > CORES


# ringflow-run ------------------------------------------------------------------------------------
def test_ringflow_run_sets_the_count_before_the_workers_start() -> None:
    want = threads.for_launcher({}, 0, 2, "auto").threads
    (result,) = run_all([([*RINGFLOW_RUN, "-np", "2", "--verbose", sys.executable, WORKER],
                          env())])
    found = reports([result])
    assert_follow(found, want)
    assert all(r["before"] == want for r in found)  # OpenMP read it when it loaded
    assert all(r["env"][k] == str(want) for r in found for k in threads.VARIABLES)
    assert all(r["plan"]["user"] == {} for r in found)
    line = f"threads on localhost: {want} thread{'s' * (want != 1)} per rank"
    assert result.stdout.count(line) == 1, result.stdout  # --verbose, once


def test_ringflow_run_keeps_the_users_omp_num_threads_with_a_note() -> None:
    (result,) = run_all([([*RINGFLOW_RUN, "-np", "2", "-x", "OMP_NUM_THREADS=2",
                           sys.executable, WORKER], env())])
    found = reports([result])
    assert_follow(found, 2)
    assert all(r["plan"]["user"] == {"OMP_NUM_THREADS": "2"} for r in found)
    assert all(r["env"]["MKL_NUM_THREADS"] == "2" for r in found)  # the rest follow it
    note = "OMP_NUM_THREADS=2 (yours) with 2 ranks on"
    assert result.stdout.count(note) == (1 if oversubscribed(2) else 0), result.stdout


# torchrun ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def isolated():
    """torchrun's agent store listens on every interface: a namespace with only loopback."""
    with loopback_namespace() as prefix:
        yield prefix


def test_torchrun_its_omp_num_threads_is_not_the_users(isolated) -> None:
    cmd = isolated + TORCHRUN + ["--standalone", "--nproc-per-node", "2", WORKER]
    found = reports(run_all([(cmd, env())]))
    assert_follow(found, UNBOUND)
    assert all(r["before"] == 1 for r in found)  # torchrun's OMP_NUM_THREADS=1
    assert all(r["plan"]["user"] == {} for r in found)  # replaced by the rule, not kept


def test_torchrun_keeps_the_users_omp_num_threads(isolated) -> None:
    cmd = isolated + TORCHRUN + ["--standalone", "--nproc-per-node", "2", WORKER]
    found = reports(run_all([(cmd, env(OMP_NUM_THREADS="2"))]))
    assert_follow(found, 2)
    assert all(r["plan"]["user"] == {"OMP_NUM_THREADS": "2"} for r in found)


# mpirun ------------------------------------------------------------------------------------------
MPIRUN = shutil.which("mpirun")


def mpirun(*args: str) -> list[str]:
    if MPIRUN is None:
        pytest.skip("mpirun is not installed")
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    flags = ["--oversubscribe", "--allow-run-as-root"] if "Open MPI" in version.stdout else []
    return [MPIRUN, *flags, "-np", "2", *args, sys.executable, WORKER]


def test_mpirun_binding_or_not() -> None:
    """Open MPI binds each of 2 ranks to a core of its own by default: the ranks compare their
    CPUs at init() and find them apart (one thread each); with ``--bind-to none`` they share
    the host."""
    bound = reports(run_all([(mpirun(), env())]))
    for r in bound:
        assert r["before"] == r["torch"], r  # OpenMP sized itself to the one core
    assert_follow(bound, bound[0]["plan"]["threads"])
    assert bound[0]["plan"]["why"] in ("1 core of its own", f"{CORES} cores / 2 ranks")
    assert_follow(reports(run_all([(mpirun("--bind-to", "none"), env())])), UNBOUND)


def test_mpirun_keeps_the_users_omp_num_threads() -> None:
    found = reports(run_all([(mpirun("--bind-to", "none", "-x", "OMP_NUM_THREADS=2"), env())]))
    assert_follow(found, 2)
    assert all(r["plan"]["user"] == {"OMP_NUM_THREADS": "2"} for r in found)


# srun --------------------------------------------------------------------------------------------
def srun(*worker_args: str, **extra: str) -> tuple[list[str], dict[str, str]]:
    pytest.importorskip("hostlist", reason="python-hostlist is not installed (ringflow[slurm])")
    e = env(PATH=os.pathsep.join([str(BIN), os.path.dirname(sys.executable),
                                  os.environ["PATH"]]),
            PYTHON=sys.executable, SLURM_JOB_ID="881", SLURM_JOB_NODELIST="localhost",
            SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="2", SLURM_NPROCS="2",
            MASTER_PORT=str(free_port()), **extra)
    return [str(BIN / "srun"), "-N", "1", "--ntasks-per-node", "2", sys.executable, WORKER,
            *worker_args], e


def test_srun_sets_torch_at_init() -> None:
    found = reports(run_all([srun()]))
    assert_follow(found, UNBOUND)
    for r in found:
        done = r["plan"]["frameworks"]["torch"]
        if r["before"] != UNBOUND:  # torch's default (this host's cores) was changed at init()
            assert done == f"torch.set_num_threads({UNBOUND}) (was {r['before']})", r


def test_srun_keeps_the_users_torch_set_num_threads_with_a_note() -> None:
    (result,) = run_all([srun("--torch-threads", "3")])
    found = reports([result])
    for r in found:
        assert (r["torch"], r["omp"], r["omp_ctypes"]) == (3, 3, 3), r
        assert r["plan"]["frameworks"]["torch"] == "torch.set_num_threads(3) kept (yours)"
        assert r["env"]["OMP_NUM_THREADS"] == str(UNBOUND)  # for what loads later
    note = "WARNING ringflow.threads: torch.set_num_threads=3 (yours) with 2 ranks on"
    assert result.stdout.count(note) == (1 if oversubscribed(3) else 0), result.stdout


def test_srun_tensorflow_imported_before_init_follows() -> None:
    if find_spec("tensorflow") is None:  # found, not imported here: the ranks import it
        pytest.skip("tensorflow is not installed")
    found = reports(run_all([srun("--tensorflow")], timeout=240))
    assert_follow(found, UNBOUND)
    assert all(r["tf"] == [UNBOUND, UNBOUND] for r in found), found
