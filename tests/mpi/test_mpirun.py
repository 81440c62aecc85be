"""Jobs started by ``mpirun`` (Open MPI / MPICH): ringflow's rendezvous goes over mpi4py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(120)

MPIRUN = shutil.which("mpirun")
if MPIRUN is None:
    pytest.skip("mpirun is not installed (pip install 'ringflow[mpi]')", allow_module_level=True)
pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'ringflow[mpi]')")

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)

JOB = """
import numpy as np
import ringflow as rf
rf.init()
n = rf.size()
total = rf.allreduce(np.full(100_003, rf.rank() + 1.0), name="x", op=rf.Sum)
assert np.all(total == n * (n + 1) / 2), total[:3]
print(f"rank {rf.rank()} of {n} local {rf.local_rank()} sum {total[0]:g}", flush=True)
rf.shutdown()
"""


def mpirun_flags() -> list[str]:
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" in version.stdout + version.stderr:
        flags = ["--oversubscribe"]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        return flags
    return []  # MPICH / Hydra


def test_mpirun_np_2_allreduce(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    (proc,) = run_commands([[MPIRUN, *mpirun_flags(), "-np", "2", sys.executable, str(script)]],
                           cwd=tmp_path, env=env, timeout=100, merge_stderr=False)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 local 0 sum 3", "rank 1 of 2 local 1 sum 3"], proc.stdout


def test_stall_shutdown_then_shutdown_and_init_under_mpirun(tmp_path):
    """The mpirun path of a re-init: the rendezvous over mpi4py runs again on the same ranks."""
    script = Path(ROOT) / "tests" / "multiproc" / "conformance" / "reinit.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["RINGFLOW_STALL_SHUTDOWN_S"] = "2"  # local ranks inherit mpirun's environment
    (proc,) = run_commands([[MPIRUN, *mpirun_flags(), "-np", "2", sys.executable, str(script)]],
                           cwd=tmp_path, env=env, timeout=100)
    out = proc.output
    assert out.count("PASS rank") == 2, out[-4000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_everything_under_mpirun_including_the_key_value_client(tmp_path, np_):
    """The engine tests' worker (collectives, get_client(), training equal to one process on
    the global batch) under mpirun with no RINGFLOW_* variable: the client used to fail with
    "no job secret"."""
    pytest.importorskip("torch")
    job = Path(ROOT) / "tests" / "engines" / "workers" / "job.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    (proc,) = run_commands(
        [[MPIRUN, *mpirun_flags(), "-np", str(np_), sys.executable, str(job), "--size",
          str(np_), "--train"]], cwd=tmp_path, env=env, timeout=100, merge_stderr=False)
    out = proc.output
    passes = re.findall(r"PASS rank [^\n]*?(?=PASS rank|\n|$)", proc.stdout)  # lines may join
    # Open MPI numbers local ranks in its own order (3 ranks on 2 cores: 0, 2, 1).
    got = sorted(re.sub(r"local \d+/", "local ?/", p.strip()) for p in passes)
    assert got == [f"PASS rank {r}/{np_} local ?/{np_} cross 0/1 via openmpi"
                   for r in range(np_)], out
    assert sorted(int(re.search(r"local (\d+)/", p).group(1)) for p in passes) == list(
        range(np_)), out
