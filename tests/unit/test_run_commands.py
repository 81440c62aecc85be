"""ringflow.testing.run_commands: outputs returned in order, failures shown with every output,
one deadline that kills each command's whole process group, nothing left behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ringflow.errors import ConfigError
from ringflow.testing import CommandFailure, run_commands

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

PY = sys.executable


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: its parent alone can reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_outputs_in_order_with_env_and_cwd(tmp_path: Path) -> None:
    results = run_commands(
        [[PY, "-c", "import os; print('one', os.environ['WHO'], os.getcwd())"],
         [PY, "-c", "import sys; print('two'); print('err', file=sys.stderr)"]],
        env={**os.environ, "WHO": "me"}, cwd=tmp_path, timeout=30)
    assert [r.returncode for r in results] == [0, 0]
    assert results[0].stdout == f"one me {tmp_path}\n"
    assert sorted(results[1].output.split()) == ["err", "two"]  # merged into stdout
    assert results[1].stderr == "" and not results[1].killed


def test_stderr_apart_and_one_env_per_command() -> None:
    code = "import os, sys; print(os.environ['X']); print('bad \\xff', file=sys.stderr)"
    a, b = run_commands([[PY, "-c", code]] * 2, env=[{**os.environ, "X": str(i)} for i in (1, 2)],
                        merge_stderr=False, timeout=30)
    assert (a.stdout, b.stdout) == ("1\n", "2\n")
    assert a.stderr.startswith("bad ")


def test_failure_shows_every_output_and_stops_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(CommandFailure) as info:
        run_commands([[PY, "-c", "print('peer waits'); import time; time.sleep(60)"],
                      [PY, "-c", "import sys; print('boom'); sys.exit(3)"]], timeout=50)
    assert time.monotonic() - start < 20  # the waiting peer was killed, not waited for
    text = str(info.value)
    assert "command 1 of 2 failed" in text and "exit code 3" in text and "boom" in text
    assert "killed when another command failed" in text and "peer waits" in text
    waiting, failed = info.value.results
    assert (waiting.killed, failed.returncode, failed.killed) == ("failure", 3, "")


def test_without_check_every_command_runs_to_its_end() -> None:
    results = run_commands([[PY, "-c", "import sys; sys.exit(2)"],
                            [PY, "-c", "import time; time.sleep(1); print('done')"]],
                           check=False, timeout=30)
    assert [r.returncode for r in results] == [2, 0] and results[1].stdout == "done\n"


def test_deadline_kills_the_whole_group_and_leaves_nothing(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # A shell that starts a child and a grandchild and waits on them: all in its group.
    hang = ["sh", "-c", f"sleep 300 & echo $! >> {pids}; "
                        f"sh -c 'sleep 300 & echo $! >> {pids}; wait' & wait"]
    start = time.monotonic()
    with pytest.raises(CommandFailure) as info:
        run_commands([hang, [PY, "-c", "print('quick')"]], timeout=2)
    assert time.monotonic() - start < 15
    assert "killed at the 2 s deadline" in str(info.value) and "quick" in str(info.value)
    hung, quick = info.value.results
    assert hung.timed_out and hung.returncode == -9 and not quick.killed
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    end = time.monotonic() + 5
    while not all(gone(p) for p in started) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(gone(p) for p in started), started


def test_deadline_fails_even_without_check() -> None:
    with pytest.raises(CommandFailure) as info:
        run_commands([[PY, "-c", "print('started', flush=True); import time; time.sleep(60)"]],
                     timeout=1, check=False)
    (r,) = info.value.results
    assert r.timed_out and r.stdout == "started\n"


def test_bad_calls() -> None:
    with pytest.raises(ConfigError, match="at least one command"):
        run_commands([])
    with pytest.raises(ConfigError, match="2 commands and 1 environments"):
        run_commands([["true"], ["true"]], env=[{}])
    with pytest.raises(FileNotFoundError):
        run_commands([["sleep", "30"], ["/nonexistent/program"]])
