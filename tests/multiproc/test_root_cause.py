"""The launcher reports the rank whose failure came first, with its own traceback -- not a rank
whose collectives then failed because of it -- and the others learn that it crashed (issue 18,
defect 1). Real processes through ringflow-run and ringflow.run."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ringflow
from ringflow.errors import RankFailure
from ringflow.testing import CommandResult, run_commands

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}

# Rank 1 raises while the others wait in a collective, and then takes a second to exit (an
# atexit handler registered before ringflow's runs after ringflow's shutdown: flushing logs,
# closing files). The others fail because of it and exit first.
CRASH = """
    import atexit, time
    atexit.register(time.sleep, 1.0)
    import numpy as np
    import ringflow as rf

    rf.init()
    rf.allreduce(np.ones(3), name="warm")
    if rf.rank() == 1:
        time.sleep(0.2)
        raise ValueError("the real bug on rank one")
    rf.allreduce(np.ones(3), name="x")
"""


def run_script(tmp_path: Path, body: str, np_: int = 3) -> CommandResult:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(script)]],
        env=ENV, timeout=90, check=False, merge_stderr=False)
    return result


def test_launcher_reports_the_rank_that_raised_not_the_ranks_that_failed_of_it(tmp_path):
    proc = run_script(tmp_path, CRASH)
    assert proc.returncode == 1
    report = proc.stderr[proc.stderr.index("ringflow-run: "):]
    assert report.startswith("ringflow-run: rank 1 on host localhost exited with code 1\n"), report
    assert "rank 1 raised ValueError: the real bug on rank one; its traceback:" in report
    assert 'raise ValueError("the real bug on rank one")' in report
    assert "ringflow-run: ranks 0, 2 then failed because of it" in report
    # The others were told that rank 1 crashed, and with what; not that it called shutdown().
    for rank in (0, 2):
        assert (f"[{rank}]:ringflow.errors.PeerError: rank 1 crashed: ValueError: the real bug "
                "on rank one (its traceback is in rank 1's output)") in proc.stderr.splitlines()
    assert "called shutdown()" not in proc.stderr


def test_a_rank_that_raised_and_then_hung_is_still_the_one_reported(tmp_path):
    """A non-daemon thread keeps the process alive after its exception: no atexit shutdown, no
    goodbye. The others must still fail at once, and the launcher names the hung rank."""
    body = """
        import threading, time
        import numpy as np
        import ringflow as rf

        rf.init()
        rf.allreduce(np.ones(3), name="warm")
        if rf.rank() == 1:
            threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon
            raise KeyError("lost the batch")
        rf.allreduce(np.ones(3), name="x")
    """
    start = time.monotonic()
    proc = run_script(tmp_path, body, np_=2)
    assert time.monotonic() - start < 60
    report = proc.stderr[proc.stderr.index("ringflow-run: "):]
    assert report.startswith("ringflow-run: rank 1 on host localhost "), report
    assert "rank 1 raised KeyError: 'lost the batch'; its traceback:" in report
    assert "[0]:ringflow.errors.PeerError: rank 1 crashed: KeyError: 'lost the batch'" in (
        proc.stderr)


def test_a_rank_killed_by_a_signal_is_reported_before_those_that_lost_it(tmp_path):
    body = """
        import os, signal, time
        import numpy as np
        import ringflow as rf

        rf.init()
        rf.allreduce(np.ones(3), name="warm")
        if rf.rank() == 2:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        rf.allreduce(np.ones(3), name="x")
    """
    proc = run_script(tmp_path, body)
    assert proc.returncode == 128 + 9, proc.stderr
    assert "ringflow-run: rank 2 on host localhost was killed by signal SIGKILL" in proc.stderr
    assert "ringflow-run: ranks 0, 1 then failed because of it" in proc.stderr


def test_ranks_that_catch_the_error_and_exit_first_are_not_taken_for_the_cause(tmp_path):
    """Rank 0 catches the PeerError and calls sys.exit(3) at once; rank 1, which died without a
    word, is seen to exit only seconds later (a helper of its ignores the SIGTERM its supervisor
    sends). The launcher still names rank 1: rank 0 said, shutting down, whose failure it was."""
    body = """
        import os, subprocess, sys, time
        import numpy as np
        import ringflow as rf

        rf.init()
        rf.allreduce(np.ones(3), name="warm")
        if rf.rank() == 1:
            subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
            time.sleep(0.5)
            os._exit(7)  # no goodbye, no status: as if it were killed
        try:
            rf.allreduce(np.ones(3), name="x")
        except rf.errors.PeerError:
            rf.shutdown()
            sys.exit(3)
    """
    proc = run_script(tmp_path, body, np_=2)
    report = proc.stderr[proc.stderr.index("ringflow-run: "):]
    assert report.startswith("ringflow-run: rank 1 on host localhost "), report
    assert "ringflow-run: rank 0 then failed because of it" in report, report
    assert proc.returncode == 7, report


# ringflow.run: module-level functions, so that they pickle by reference.


def crash_on_rank_one():
    import atexit

    import numpy as np

    import ringflow as rf

    rf.init()
    rf.allreduce(np.ones(3), name="warm")
    if rf.rank() == 1:
        atexit.register(time.sleep, 1.0)  # runs before ringflow's shutdown: a slow exit
        time.sleep(0.2)
        raise ValueError("the real bug on rank one")
    rf.allreduce(np.ones(3), name="x")
    return rf.rank()


def test_run_raises_the_root_cause_with_its_own_traceback():
    with pytest.raises(RankFailure) as info:
        ringflow.run(crash_on_rank_one, np=3, timeout=60)
    assert info.value.rank == 1, info.value
    text = str(info.value)
    assert text.startswith("rank 1: ValueError: the real bug on rank one\n"), text
    assert "crash_on_rank_one" in text and "Traceback" in text
