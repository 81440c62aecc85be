"""No orphans whatever the worker command is (issue 18, defect 2): a launcher killed with SIGKILL
takes every process of its job with it, through shell wrappers, grandchildren and processes that
left the worker's session; and what a worker leaves behind when it exits does not outlive the
job. Real processes through ringflow-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc"),
]

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}
LAUNCHER = [sys.executable, "-m", "ringflow.runner"]

# Started by each worker (through a shell): a grandchild in its process group and one that
# leaves the session (as a daemon would); records the three pids, then sleeps.
SLEEPER = """
    import os, subprocess, sys, time
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    child = subprocess.Popen(sleep)
    escaped = subprocess.Popen(sleep, start_new_session=True)
    path = os.path.join({out!r}, "pids-" + os.environ["RINGFLOW_RANK"])
    with open(path + ".tmp", "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}} {{escaped.pid}}")
    os.replace(path + ".tmp", path)
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    for pid in pids:  # never leave the test's own processes behind, pass or fail
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def wrappers(tmp_path: Path, sleeper: str) -> dict[str, list[str]]:
    script = tmp_path / "train.sh"
    script.write_text(f"echo starting\n{sys.executable} {sleeper}\necho done\n")
    return {
        "sh -c": ["sh", "-c", f"{sys.executable} {sleeper} > {tmp_path}/log; true"],
        "bash script": ["bash", str(script)],
        "python": [sys.executable, sleeper],
    }


@pytest.mark.parametrize("wrapper", ["sh -c", "bash script", "python"])
def test_sigkill_to_launcher_leaves_no_process_of_the_job(tmp_path, wrapper):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(textwrap.dedent(SLEEPER.format(out=str(tmp_path))))
    command = wrappers(tmp_path, str(sleeper))[wrapper]
    launcher = subprocess.Popen([*LAUNCHER, "-np", "2", *command], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [tmp_path / f"pids-{r}" for r in range(2)]
    pids: list[int] = []
    try:
        wait_for(lambda: all(f.exists() for f in files), 60, "the workers did not start")
        pids = [int(p) for f in files for p in f.read_text().split()]
        assert all(alive(pid) for pid in pids)
        launcher.kill()
        launcher.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in pids), 20,
                 f"orphans left: {[pid for pid in pids if alive(pid)]}")
    finally:
        launcher.kill()
        kill_all(pids)


def test_what_a_worker_leaves_behind_does_not_outlive_the_job(tmp_path):
    """A worker that exits 0 while a background process it started holds the output pipes."""
    body = f"""
        sleep 300 &
        echo $! > {tmp_path}/bg-$RINGFLOW_RANK
        echo started
    """
    script = tmp_path / "train.sh"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    (proc,) = run_commands([[*LAUNCHER, "-np", "2", "bash", str(script)]], env=ENV, timeout=60,
                           check=False, merge_stderr=False)
    took = time.monotonic() - start
    pids = [int((tmp_path / f"bg-{r}").read_text()) for r in range(2)]
    try:
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.splitlines()) == ["[0]:started", "[1]:started"]
        wait_for(lambda: not any(alive(pid) for pid in pids), 10,
                 f"left behind: {[pid for pid in pids if alive(pid)]}")
        assert took < 30, took
    finally:
        kill_all(pids)


def test_exit_code_and_signal_of_the_worker_come_through_the_supervisor(tmp_path):
    (proc,) = run_commands([[*LAUNCHER, "-np", "2", "sh", "-c",
                             'if [ "$RINGFLOW_RANK" = 1 ]; then kill -SEGV $$; fi; sleep 30']],
                           env=ENV, timeout=60, check=False, merge_stderr=False)
    assert proc.returncode == 128 + signal.SIGSEGV, proc.stderr
    assert "rank 1 on host localhost was killed by signal SIGSEGV" in proc.stderr
    (proc,) = run_commands([[*LAUNCHER, "-np", "1", "sh", "-c", "exit 130"]], env=ENV,
                           timeout=60, check=False, merge_stderr=False)
    assert proc.returncode == 130, proc.stderr  # an exit code above 128 is no signal here
    assert "rank 0 on host localhost exited with code 130" in proc.stderr


# A rank under a shell, blocked: rank 1 in an allreduce that rank 0 never calls, rank 0 in a
# sleep (after init(); before it with "import"); with "ignore", both ignore SIGTERM.
BLOCKED = """
    import os, signal, sys, time
    import numpy as np
    import ringflow
    mode, r = {mode!r}, int(os.environ["RINGFLOW_RANK"])
    if mode != "import":
        ringflow.init()
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = os.path.join({out!r}, "rank-" + str(r))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    if r == 1 and mode != "import":
        ringflow.allreduce(np.ones(3), name="never")
    time.sleep(300)
"""


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.parametrize(("mode", "within"), [("collective", 8.0), ("import", 8.0),
                                              ("ignore", 15.0)])
def test_a_rank_whose_launcher_supervisor_and_shell_are_killed_leaves(tmp_path, mode, within):
    # PR_SET_PDEATHSIG reaches the shell only: the ranks used to live on, blocked for good.
    # They watch their supervisor (ringflow.lifeline): SIGTERM at once, exit 5 s later at most.
    worker = tmp_path / "blocked.py"
    worker.write_text(textwrap.dedent(BLOCKED.format(mode=mode, out=str(tmp_path))))
    launcher = subprocess.Popen([*LAUNCHER, "-np", "2", "sh", "-c",
                                 f"{sys.executable} {worker}; true"], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = [tmp_path / f"rank-{r}" for r in range(2)]
    ranks: list[int] = []
    try:
        wait_for(lambda: all(f.exists() for f in files), 60, "the ranks did not start")
        ranks = [int(f.read_text()) for f in files]
        time.sleep(0.5)  # rank 1 is in its allreduce
        supervisors = children(launcher.pid)
        shells = [pid for s in supervisors for pid in children(s)]
        assert len(supervisors) == 2 and len(shells) == 2 and not set(shells) & set(ranks), \
            (supervisors, shells, ranks)
        for pid in [launcher.pid, *supervisors, *shells]:
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in ranks), within,
                 f"ranks alive {within} s after their launcher, supervisors and shells were "
                 f"killed: {[pid for pid in ranks if alive(pid)]}")
    finally:
        launcher.kill()
        kill_all(ranks)
