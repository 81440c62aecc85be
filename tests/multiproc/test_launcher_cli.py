"""ringflow-run's horovodrun flags with real processes on this host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import CommandResult, run_commands

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH}
ENV.pop("RINGFLOW_CYCLE_TIME_MS", None)


def launch(*args: str, env=None, timeout: float = 60) -> CommandResult:
    """ringflow-run with ``args``; its exit code is the test's to check."""
    (result,) = run_commands([[sys.executable, "-m", "ringflow.runner", *args]], env=env or ENV,
                             timeout=timeout, check=False, merge_stderr=False)
    return result


SHOW = (
    "import os; print(os.environ.get('RINGFLOW_CYCLE_TIME_MS'), "
    "os.environ.get('RINGFLOW_FUSION_THRESHOLD_BYTES'))"
)


def test_flags_and_config_file_win_over_the_environment(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("fusion-threshold-mb: 1\ncycle-time-ms: 3\n")
    env = {**ENV, "RINGFLOW_CYCLE_TIME_MS": "9", "RINGFLOW_FUSION_THRESHOLD_BYTES": "5"}
    base = launch("-np", "2", sys.executable, "-c", SHOW, env=env)
    assert sorted(base.stdout.splitlines()) == ["[0]:9 5", "[1]:9 5"], base.stderr
    proc = launch("-np", "2", "--config-file", str(config), "--cycle-time-ms", "2",
                  sys.executable, "-c", SHOW, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]:2.0 1048576", "[1]:2.0 1048576"]


def test_output_filename_writes_per_rank_files(tmp_path):
    body = r"""
        import os, sys
        r = os.environ["RINGFLOW_RANK"]
        sys.stdout.buffer.write(b"out " + r.encode() + b"\n\xffraw")
        sys.stderr.write(f"err {r}\n")
        sys.exit(3 if r == "1" else 0)
    """
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(body))
    out = tmp_path / "logs"
    proc = launch("-np", "2", "--output-filename", str(out), sys.executable, str(script))
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert "rank 1 on host localhost exited with code 3" in proc.stderr
    assert "  err 1" in proc.stderr  # the report keeps the tail
    for rank in range(2):
        expected = f"out {rank}\n".encode() + b"\xffraw"
        assert (out / f"rank.{rank}" / "stdout").read_bytes() == expected
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"


def test_prefix_timestamp():
    proc = launch("-np", "2", "--prefix-timestamp", sys.executable, "-c", "print('hi')")
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[[01]\]:hi", line), line


def test_hostfile_on_this_host(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# one host\nlocalhost slots=3\n")
    proc = launch("-np", "3", "--hostfile", str(hostfile), sys.executable, "-c",
                  "import os; print(os.environ['RINGFLOW_LOCAL_SIZE'])")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]:3", "[1]:3", "[2]:3"]
    four = launch("-np", "4", "--hostfile", str(hostfile), "true")
    assert four.returncode == 2 and "-np 4 asks for more processes than the 3 slots" in four.stderr


def test_network_interface_sets_the_bind_address():
    proc = launch("-np", "1", "--network-interface", "lo", sys.executable, "-c",
                  "import os; print(os.environ['RINGFLOW_BIND_ADDR'])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[0]:127.0.0.1\n"
    bad = launch("-np", "1", "--network-interface", "nosuchif0", "true")
    assert bad.returncode == 2 and "--network-interface 'nosuchif0'" in bad.stderr


def test_check_build_lists_frameworks_transports_and_gpus():
    proc = launch("--check-build")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith(f"ringflow v{ringflow.__version__}:")
    for heading in ("Available Frameworks:", "Available Tensor Operations:", "GPUs:"):
        assert heading in text
    assert "    [X] TCP" in text
    assert re.search(r"    \[[X ]\] PyTorch", text) and re.search(r"\[[X ]\] NCCL", text)


def test_remote_bootstrap_passes_the_secret_on_a_pipe_and_stops_at_eof(tmp_path):
    """The ssh side of a remote start, run locally: stdin carries the secret, then liveness."""
    body = f"""
        import os, time
        from ringflow.rendezvous import read_secret
        with open({str(tmp_path / "seen")!r}, "w") as f:
            f.write(read_secret().hex() + " " + os.environ["RINGFLOW_LAUNCHER_PID"])
        time.sleep(60)
    """
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in ENV.items() if not k.startswith("RINGFLOW_SECRET")}
    boot = subprocess.Popen(
        [sys.executable, "-m", "ringflow.runner.remote", "--grace", "1", "--",
         sys.executable, str(script)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    boot.stdin.write(b"ab" * 32 + b"\n")
    boot.stdin.flush()
    seen = tmp_path / "seen"
    end = time.monotonic() + 30
    while not (seen.exists() and seen.read_text().count(" ") == 1):
        assert boot.poll() is None and time.monotonic() < end, boot.communicate()
        time.sleep(0.02)
    assert seen.read_text() == f"{'ab' * 32} {boot.pid}"
    boot.stdin.close()  # what the launcher's death looks like from the remote host
    assert boot.wait(timeout=20) == 128 + signal.SIGTERM


def test_remote_bootstrap_without_a_secret_refuses():
    boot = subprocess.run(
        [sys.executable, "-m", "ringflow.runner.remote", "--", "true"], env=ENV, input=b"",
        capture_output=True, timeout=30,
    )
    assert boot.returncode == 1 and b"no job secret on stdin" in boot.stderr


def test_after_a_failure_the_others_may_finish_their_output(tmp_path):
    """Issue 18: the other ranks used to be killed at once, losing all they had yet to print."""
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["RINGFLOW_RANK"] == "1":
            sys.exit(3)
        time.sleep(1.0)
        for i in range(60):
            print(f"line {i}")
    """))
    proc = launch("-np", "2", sys.executable, str(script))
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 on host localhost exited with code 3" in proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("[0]:line")] == [
        f"[0]:line {i}" for i in range(60)], proc.stdout


def test_sigterm_lets_a_ringflow_worker_run_its_finally_blocks(tmp_path):
    """Issue 18: a rank still busy after the settling time gets SIGTERM, which ringflow.init()
    turns into SystemExit: its finally blocks run and its buffered output arrives."""
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import ringflow
        ringflow.init()
        if ringflow.rank() == 1:
            sys.exit(3)
        print("buffered before the signal")  # stdout is a pipe: block-buffered
        try:
            time.sleep(60)
        finally:
            print("finally ran")
    """))
    start = time.monotonic()
    proc = launch("-np", "2", sys.executable, str(script))
    assert proc.returncode == 3, proc.stderr
    assert "[0]:buffered before the signal" in proc.stdout, proc.stdout + proc.stderr
    assert "[0]:finally ran" in proc.stdout, proc.stdout + proc.stderr
    assert time.monotonic() - start < 30
