"""The mpi transport under ``mpirun``: the collective suite, init(comm=...), errors and failures.

Each test runs one scenario of ``mpi_workers/mpi_worker.py`` under ``mpirun -np N``; every rank
checks its results in closed form and writes what it saw to ``<rank>.json``; the test checks that
the transport was MPI and that results are bitwise identical across ranks (sha256 of every
result). Skipped, with the reason, where mpirun or mpi4py is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(120)

MPIRUN = shutil.which("mpirun")
if MPIRUN is None:
    pytest.skip("mpirun is not installed (pip install 'ringflow[mpi]')", allow_module_level=True)
pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'ringflow[mpi]')")

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = str(Path(__file__).resolve().parent / "mpi_workers" / "mpi_worker.py")


def mpirun_flags() -> list[str]:
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" in version.stdout + version.stderr:
        flags = ["--oversubscribe"]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        return flags
    return []  # MPICH / Hydra


def mpirun(scenario: str, n: int, out: Path, env: dict[str, str] | None = None,
           timeout: float = 100, ok: bool = True) -> tuple[dict[int, dict[str, Any]], Any]:
    """Run ``scenario`` on ``n`` ranks (with ``ok``, mpirun must exit 0); return (each reporting
    rank's JSON by rank, how mpirun ended)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, base.get("PYTHONPATH")]))
    base.update(env or {})
    exports = [f for k in (env or {}) for f in ("-x", k)] if "Open MPI" in _version() else []
    (proc,) = run_commands(
        [[MPIRUN, *mpirun_flags(), *exports, "-np", str(n), sys.executable, WORKER, scenario,
          str(out)]], cwd=out, env=base, timeout=timeout, check=ok, merge_stderr=False)
    results = {}
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return results, proc


def _version() -> str:
    proc = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    return proc.stdout + proc.stderr


def same_bits(results: dict[int, dict[str, Any]], key: str, ranks: list[int]) -> None:
    first = results[ranks[0]][key]
    assert first, key
    for r in ranks[1:]:
        differ = sorted(k for k in first if results[r][key][k] != first[k])
        assert not differ, f"{key}: rank {r} differs from rank {ranks[0]} in {differ}"


@pytest.mark.parametrize("n", [2, 3])
def test_collective_suite_over_mpi(tmp_path: Path, n: int) -> None:
    # n=2 through the auto choice (mpirun + mpi4py -> mpi), n=3 named explicitly.
    env = {"RINGFLOW_TRANSPORT": "mpi"} if n == 3 else {}
    results, _ = mpirun("suite", n, tmp_path, env)
    assert sorted(results) == list(range(n))
    for r in range(n):
        assert results[r]["transport"] == "MpiTransport", results[r]
        assert results[r]["after"] == n * (n + 1) / 2
    # Native MPI_Iallreduce (global set) and the ring over MPI messages (subset): same bits
    # on every rank.
    same_bits(results, "global", list(range(n)))
    members = results[0]["subset_ranks"]
    assert members == ([0, 1] if n == 2 else [0, 2])
    same_bits(results, "subset", members)


def test_init_with_a_sub_communicator_makes_a_job_of_its_ranks(tmp_path: Path) -> None:
    results, _ = mpirun("comm", 3, tmp_path)
    assert sorted(results) == [0, 1, 2]
    # World ranks 0 and 2 (even) form one job of 2 ranks; world rank 1 a job of its own.
    for world, (size, sub_rank) in {0: (2, 0), 1: (1, 0), 2: (2, 1)}.items():
        res = results[world]
        assert (res["size"], res["sub_rank"]) == (size, sub_rank), res
        assert res["local_size"] == size and res["cross_size"] == 1, res
        assert res["sum"] == size * (size + 1) // 2, res
        # The application's MPI traffic on COMM_WORLD is untouched by ringflow's.
        assert res["world_sum"] == 6 and res["world_max"] == 2, res
    assert results[0]["transport"] == results[2]["transport"] == "MpiTransport"
    same_bits(results, "global", [0, 2])


def test_rank_0_in_a_pickled_mpi_collective_right_after_init_does_not_deadlock(
        tmp_path: Path) -> None:
    # Rank 0 serves the store from a thread; mpi4py's comm.allreduce(obj) holds the GIL while
    # it waits. Before init() ended with a barrier, this waited on the store for 2 x the timeout.
    n = 3
    results, _ = mpirun("gil", n, tmp_path, {"RINGFLOW_TIMEOUT_S": "10"}, timeout=60)
    assert sorted(results) == list(range(n))
    for r in range(n):
        assert results[r]["world_sum"] == n * (n + 1) // 2
        assert results[r]["sum"] == n * (n + 1) / 2


def test_errors_reach_every_rank_with_one_text(tmp_path: Path) -> None:
    n = 3
    results, _ = mpirun("errors", n, tmp_path)
    assert sorted(results) == list(range(n))
    seen = {(results[r]["mismatch"]["type"], results[r]["mismatch"]["text"]) for r in range(n)}
    assert len(seen) == 1, seen
    kind, text = seen.pop()
    assert kind == "MismatchError" and "'bad'" in text and "shape" in text, text
    assert all(results[r]["after"] == 6 for r in range(n))
    # The last rank said goodbye: the others' op that needs it fails (ShutdownError), no hang.
    for r in range(n - 1):
        assert results[r]["departed"]["type"] == "ShutdownError", results[r]


def test_without_thread_multiple_mpi_is_refused_and_auto_falls_back(tmp_path: Path) -> None:
    (tmp_path / "named").mkdir()
    named, _ = mpirun("thread_serialized", 2, tmp_path / "named", {"RINGFLOW_TRANSPORT": "mpi"})
    for r in range(2):
        assert named[r]["thread_level"] < 3, named[r]  # below MPI_THREAD_MULTIPLE
        err = named[r]["init"]
        assert err["type"] == "ConfigError" and "MPI_THREAD_MULTIPLE" in err["text"], err
        assert "RINGFLOW_TRANSPORT=tcp" in err["text"], err
    (tmp_path / "auto").mkdir()
    auto, _ = mpirun("thread_serialized", 2, tmp_path / "auto")
    for r in range(2):
        assert auto[r]["init"]["type"] == "none", auto[r]
        assert auto[r]["transport"] != "MpiTransport" and auto[r]["sum"] == 3, auto[r]


def test_a_dying_rank_ends_the_job_without_a_hang(tmp_path: Path) -> None:
    """What MPI gives: Open MPI's runtime kills the other ranks when one exits without
    MPI_Finalize; mpirun exits non-zero. No rank reports success, and nothing hangs."""
    start = time.monotonic()
    results, proc = mpirun("die", 3, tmp_path, ok=False, timeout=60)
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.glob("*.started")) == [f"{r}.started" for r in range(3)]
    assert results == {}, results  # nobody finished its loop
    assert time.monotonic() - start < 60


def test_a_frozen_rank_fails_the_job_on_every_other_rank(tmp_path: Path) -> None:
    n = 3
    results, proc = mpirun("frozen", n, tmp_path, {"RINGFLOW_TIMEOUT_S": "3"}, ok=False,
                           timeout=60)
    assert sorted(results) == list(range(n - 1)), proc.stdout + proc.stderr
    seen = {(results[r]["frozen"]["type"], results[r]["frozen"]["text"]) for r in range(n - 1)}
    assert len(seen) == 1, seen
    kind, text = seen.pop()
    assert kind == "PeerError" and f"rank {n - 1} has not responded" in text, text
    assert all(results[r]["seconds"] < 20 for r in range(n - 1))


def test_available_reports_the_library_without_initializing_mpi_here() -> None:
    code = ("import sys, ringflow, ringflow.transport.mpi as m; v = m.available(); "
            "print(v); print('mpi4py.MPI' in sys.modules)")
    (proc,) = run_commands([[sys.executable, "-c", code]], env={**os.environ, "PYTHONPATH": ROOT},
                           timeout=60, merge_stderr=False)
    version, imported = proc.stdout.splitlines()
    assert "MPI" in version and "\0" not in version, version
    assert imported == "False"  # import ringflow / available() never initialize MPI


def test_check_build_shows_the_mpi_library() -> None:
    from ringflow.runner.check_build import check_build
    from ringflow.transport import mpi

    text = check_build(ringflow.__version__)
    assert f"    [X] MPI  ({mpi.available()})" in text, text
