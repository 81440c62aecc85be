"""ringflow-run across namespace hosts when things go wrong (issue 18): an unreachable host ends
the job within --start-timeout instead of hanging it, and a launcher killed with SIGKILL leaves no
process of a remote worker behind, whatever the worker command is (see netns_cluster.py)."""

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

pytestmark = pytest.mark.timeout(120)

sys.path.insert(0, os.path.dirname(__file__))
import netns_cluster  # noqa: E402

REASON = netns_cluster.unavailable()
if REASON is not None:
    pytest.skip(f"multi-host tests need network namespaces: {REASON}", allow_module_level=True)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def hosts():
    with netns_cluster.cluster(2) as c:
        yield c


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def ghost(hosts, tmp_path):
    """An address on the cluster's bridge that nobody answers: a permanent neighbour entry to a
    MAC no port has, so the SYNs are flooded to the namespaces and dropped there (nothing leaves
    the machine). And an ssh configuration without ConnectTimeout, as most users have."""
    subnet = hosts.addresses[0].rsplit(".", 1)[0]
    address = f"{subnet}.99"
    subprocess.run(["ip", "neigh", "replace", address, "lladdr", "02:00:00:00:00:99", "dev",
                    hosts.interface, "nud", "permanent"], check=True, timeout=20)
    config = tmp_path / "ssh_config"
    config.write_text(Path(hosts.ssh_config).read_text().replace("  ConnectTimeout 5\n", ""))
    try:
        yield address, str(config)
    finally:
        subprocess.run(["ip", "neigh", "del", address, "dev", hosts.interface], check=False,
                       timeout=20)


@pytest.mark.parametrize("program", [
    "import time; time.sleep(1)",  # not a ringflow program: nothing else bounds the wait
    "import ringflow as rf, numpy as np; rf.init(); rf.allreduce(np.ones(2), name='x')",
])
def test_unreachable_host_fails_the_job_within_the_start_timeout(hosts, ghost, program):
    address, config = ghost
    command = netns_cluster.ringflow_run(hosts, {0: 1, 1: 1}, "--start-timeout", "5",
                                         sys.executable, "-c", program)
    command[command.index("-H") + 1] = f"{hosts.hosts[0]}:1,{address}:1"
    command[command.index("--ssh-config-file") + 1] = config
    start = time.monotonic()
    (proc,) = run_commands([command], env=ENV, timeout=90, check=False, merge_stderr=False)
    took = time.monotonic() - start
    assert proc.returncode == 255, proc.stderr
    assert f"ringflow-run: rank 1 on host {address} exited with code 255" in proc.stderr
    assert "timed out" in proc.stderr  # ssh's own words, in the report's tail
    assert took < 40, took  # 5 s to give up, the grace period, and process start-up


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


def test_remote_workers_behind_a_shell_die_with_a_killed_launcher(hosts, tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(textwrap.dedent(SLEEPER.format(out=str(tmp_path))))
    proc = subprocess.Popen(
        [*netns_cluster.ringflow_run(hosts, {0: 1, 1: 1}),
         "sh", "-c", f"{sys.executable} {sleeper} > /dev/null; true"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    files = [tmp_path / f"pids-{r}" for r in range(2)]
    pids: list[int] = []
    try:
        end = time.monotonic() + 40
        while not all(f.exists() for f in files):
            assert proc.poll() is None and time.monotonic() < end, "workers did not start"
            time.sleep(0.05)
        pids = [int(p) for f in files for p in f.read_text().split()]
        proc.kill()
        proc.wait(timeout=10)
        end = time.monotonic() + 20
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < end, [pid for pid in pids if alive(pid)]
            time.sleep(0.05)
    finally:
        proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
