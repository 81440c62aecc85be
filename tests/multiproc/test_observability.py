"""What a user sees of a job (issue 18): logs at every level with the rank, progress bars live
through ringflow-run, stall reports that name the call sites."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}
for _var in ("RINGFLOW_LOG_LEVEL", "HOROVOD_LOG_LEVEL", "RINGFLOW_TIMELINE_PATH"):
    ENV.pop(_var, None)
LAUNCHER = [sys.executable, "-m", "ringflow.runner"]


def script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


JOB = """
    import numpy as np, ringflow as rf
    rf.init()
    rf.allreduce(np.ones(3), name="x")
    rf.shutdown()
"""


# --- logging --------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["--log-level", "HOROVOD_LOG_LEVEL"])
def test_debug_logs_reach_stderr_with_the_rank_in_workers_and_launcher(tmp_path, how) -> None:
    flags = ["--log-level", "debug"] if how == "--log-level" else []
    env = ENV if flags else {**ENV, "HOROVOD_LOG_LEVEL": "trace"}
    (proc,) = run_commands([[*LAUNCHER, "-np", "2", *flags, sys.executable, script(tmp_path, JOB)]],
                           env=env, timeout=90, merge_stderr=False)
    for rank in (0, 1):
        stamp = r"\d\d:\d\d:\d\d\.\d\d\d"
        for level, text in (("INFO", "ringflow.runtime: joined the job"),
                            ("DEBUG", "ringflow.runtime: shutting down")):
            pattern = rf"^\[{rank}\]:\[ringflow rank {rank}/2 {stamp}\] {level} {text}"
            assert len(re.findall(pattern, proc.stderr, re.M)) == 1, (pattern, proc.stderr)
    if flags:  # the launcher's own records follow its --log-level too
        assert re.search(r"^\[ringflow-run [\d:.]+\] INFO ringflow.runner.launch: starting "
                         r"rank 1", proc.stderr, re.M), proc.stderr


LOGGING_CONFIGURED = """
    import logging, sys
    how = sys.argv[1]
    if how == "basicConfig":
        logging.basicConfig(format="USER %(levelname)s %(name)s: %(message)s")
    elif how == "own handler":  # on ringflow's logger, not propagating: still once
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("USER %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("ringflow").addHandler(handler)
        logging.getLogger("ringflow").propagate = False
    import numpy as np, ringflow as rf
    rf.init()
    rf.allreduce(np.ones(3), name="x")
    rf.shutdown()
"""


@pytest.mark.parametrize("how", ["nothing", "basicConfig", "own handler"])
def test_each_record_is_written_once_whoever_configured_logging(tmp_path, how) -> None:
    (proc,) = run_commands([[sys.executable, script(tmp_path, LOGGING_CONFIGURED), how]],
                           env={**ENV, "RINGFLOW_LOG_LEVEL": "debug"}, timeout=60,
                           merge_stderr=False)
    lines = [line for line in proc.stderr.splitlines() if "shutting down" in line]
    assert len(lines) == 1, proc.stderr
    if how == "nothing":
        assert re.match(r"\[ringflow rank 0/1 [\d:.]+\] DEBUG ringflow.runtime: shutting down$",
                        lines[0]), lines
    else:  # the program's handler and format, not ringflow's
        assert lines[0] == "USER DEBUG ringflow.runtime: shutting down", lines


# --- live \r output -------------------------------------------------------------------------------
PROGRESS = """
    import os, sys, time
    stream = sys.stdout if sys.argv[2] == "stdout" else sys.stderr
    go = sys.argv[1]
    if os.environ["RINGFLOW_RANK"] == "0":
        for step in (1, 2):
            stream.write(f"\\rstep {step}/2")  # as tqdm does: \\r, the bar, nothing more
            stream.flush()
            while not os.path.exists(f"{go}{step}"):
                time.sleep(0.01)
        stream.write("\\n")
        stream.flush()
"""


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_a_progress_bar_is_relayed_before_its_newline(tmp_path, stream) -> None:
    go = str(tmp_path / "go")
    proc = subprocess.Popen(
        [*LAUNCHER, "-np", "2", sys.executable, script(tmp_path, PROGRESS), go, stream],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    other = proc.stderr if stream == "stdout" else proc.stdout
    got = bytearray()
    rest: list[bytes] = []

    def read() -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            got.extend(chunk)

    readers = [threading.Thread(target=read, daemon=True),
               threading.Thread(target=lambda: rest.append(other.read()), daemon=True)]
    for t in readers:
        t.start()
    try:
        for step in (1, 2):
            start = time.monotonic()
            while f"[0]:step {step}/2".encode() not in got:
                assert proc.poll() is None and time.monotonic() - start < 30, (
                    f"step {step} never arrived before the newline: {bytes(got)!r}")
                time.sleep(0.01)
            print(f"\nstep {step}: relayed {time.monotonic() - start:.3f} s after the test "
                  "started waiting (the worker waits for the test)")
            Path(f"{go}{step}").touch()
        assert proc.wait(60) == 0, rest
    finally:
        for step in (1, 2):
            Path(f"{go}{step}").touch()
        proc.wait(60)
        for t in readers:
            t.join(10)
    assert bytes(got).endswith(b"[0]:step 1/2\r[0]:step 2/2\n"), bytes(got)


# --- stall reports --------------------------------------------------------------------------------
STALL = """
    import time, numpy as np, ringflow as rf
    rf.init()
    if rf.rank() == 0:
        rf.allreduce(np.ones(3), name="s")  # line 5
        rf.allreduce(np.ones(3), name="b")
    else:
        h = rf.allreduce_async(np.ones(3), name="b")  # line 8
        time.sleep(3.5)
        rf.allreduce(np.ones(3), name="s")
        h.wait()
    rf.shutdown()
"""


def test_a_stall_warning_names_the_call_sites(tmp_path) -> None:
    path = script(tmp_path, STALL)
    (proc,) = run_commands([[*LAUNCHER, "-np", "2", sys.executable, path]],
                           env={**ENV, "RINGFLOW_STALL_WARNING_S": "1"}, timeout=90,
                           merge_stderr=False)
    warnings = [line for line in proc.stderr.splitlines() if "ringflow stall" in line]
    print("\n" + "\n".join(warnings))
    s = next(w for w in warnings if "tensor 's'" in w)
    assert f"submitted by ranks [0], missing ranks [1] (rank 0 called at {path}:5; rank 1 " \
           f"waits in 'b' submitted at {path}:8)" in s, s
    b = next(w for w in warnings if "tensor 'b'" in w)
    assert f"submitted by ranks [1], missing ranks [0] (rank 1 called at {path}:8; rank 0 " \
           f"waits in 's' submitted at {path}:5)" in b, b
