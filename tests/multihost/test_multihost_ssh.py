"""ringflow-run across hosts over ssh: network namespaces running sshd (see netns_cluster.py)."""

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

pytestmark = pytest.mark.timeout(90)

sys.path.insert(0, os.path.dirname(__file__))
import netns_cluster  # noqa: E402

REASON = netns_cluster.unavailable()
if REASON is not None:
    pytest.skip(f"multi-host tests need network namespaces: {REASON}", allow_module_level=True)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH}


@pytest.fixture(scope="module")
def hosts():
    with netns_cluster.cluster(2) as c:
        yield c


def launcher_args(c: netns_cluster.Cluster, *extra: str) -> list[str]:
    return netns_cluster.ringflow_run(c, {0: 2, 1: 2}, *extra)


WORKER = """
    import os, time
    import numpy as np
    import ringflow as rf
    from ringflow.rendezvous import read_secret

    rank = int(os.environ["RINGFLOW_RANK"])
    out = {out!r}
    with open(f"{{out}}/secret-{{rank}}.tmp", "w") as f:
        f.write(f"{{read_secret().hex()}} {{os.getpid()}}")
    os.replace(f"{{out}}/secret-{{rank}}.tmp", f"{{out}}/secret-{{rank}}")
    while not os.path.exists(f"{{out}}/go"):
        time.sleep(0.02)
    rf.init()
    total = rf.allreduce(np.full(1001, rf.rank() + 1.0), name="x", op=rf.Sum)
    n = rf.size()
    assert np.all(total == n * (n + 1) / 2), total[:3]
    print(f"rank {{rf.rank()}} of {{n}} on {{os.environ['RINGFLOW_HOSTNAME']}}",
          f"bind {{os.environ['RINGFLOW_BIND_ADDR']}} cross {{rf.cross_rank()}}",
          f"sum {{total[0]:g}}", flush=True)
    rf.shutdown()
"""


def test_allreduce_across_two_hosts_and_secret_stays_out_of_argv(hosts, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(out=str(tmp_path))))
    proc = subprocess.Popen(
        [*launcher_args(hosts), sys.executable, str(script)], env=ENV, cwd=str(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        files = [tmp_path / f"secret-{r}" for r in range(4)]
        end = time.monotonic() + 40
        while not all(f.exists() for f in files):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end, "workers did not start"
            time.sleep(0.05)
        secrets_seen = {f.read_text().split()[0] for f in files}
        assert len(secrets_seen) == 1
        needle = secrets_seen.pop().encode()
        for entry in os.listdir("/proc"):  # one pid namespace: the remote workers are here too
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        assert needle not in f.read(), f"secret in /proc/{entry}/cmdline"
                except OSError:
                    pass
    finally:
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = sorted(out.splitlines())
    expected = [
        f"[{r}]:rank {r} of 4 on {hosts.hosts[r // 2]} bind {hosts.addresses[r // 2]} "
        f"cross {r // 2} sum 10"
        for r in range(4)
    ]
    assert lines == expected, (out, err)
    assert needle not in (out + err).encode()


def test_unknown_host_key_is_refused(hosts, tmp_path):
    known = Path(hosts.known_hosts)
    saved = known.read_text()
    known.write_text("")
    try:
        (proc,) = run_commands([[*launcher_args(hosts), sys.executable, "-c", "print('ran')"]],
                               env=ENV, timeout=60, check=False, merge_stderr=False)
    finally:
        known.write_text(saved)
    assert proc.returncode == 255, proc.stderr
    assert "ran" not in proc.stdout
    assert "Host key verification failed" in proc.stderr
    assert "ssh's own failure code" in proc.stderr


def test_remote_workers_die_with_a_killed_launcher(hosts, tmp_path):
    body = f"""
        import os, time
        rank = os.environ["RINGFLOW_RANK"]
        with open(os.path.join({str(tmp_path)!r}, "pid-" + rank + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join({str(tmp_path)!r}, "pid-" + rank + ".tmp"),
                   os.path.join({str(tmp_path)!r}, "pid-" + rank))
        time.sleep(120)
    """
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen(
        [*launcher_args(hosts), sys.executable, str(script)], env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    files = [tmp_path / f"pid-{r}" for r in range(4)]
    end = time.monotonic() + 40
    while not all(f.exists() for f in files):
        assert proc.poll() is None and time.monotonic() < end, "workers did not start"
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in files]
    proc.kill()
    proc.wait(timeout=10)
    end = time.monotonic() + 15
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < end, [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sigterm_to_launcher_stops_remote_workers(hosts, tmp_path):
    proc = subprocess.Popen(
        [*launcher_args(hosts), sys.executable, "-c",
         "import time; print('up', flush=True); time.sleep(120)"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen = 0
    end = time.monotonic() + 40
    while seen < 4:
        assert time.monotonic() < end
        if proc.stdout.readline().rstrip().endswith("up"):
            seen += 1
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err


@pytest.mark.parametrize(
    ("line", "code", "report"),
    [
        ("sys.stderr.write('bad rank two\\n'); sys.exit(3)", 3, "exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL,
         "was killed by signal SIGKILL"),
    ],
)
def test_remote_exit_code_and_signal_are_reported(hosts, line, code, report):
    body = ("import os, signal, sys, time\n"
            f"if os.environ['RINGFLOW_RANK'] == '2': {line}\n"
            "time.sleep(60)\n")
    (proc,) = run_commands([[*launcher_args(hosts), sys.executable, "-c", body]], env=ENV,
                           timeout=60, check=False, merge_stderr=False)
    assert proc.returncode == code, proc.stderr
    assert f"rank 2 on host {hosts.hosts[1]} {report}" in proc.stderr


def test_without_network_interface_the_store_listens_on_the_routed_address(hosts):
    """Hosts given as addresses: the store and the workers find their addresses by route."""
    a1, a2 = hosts.addresses
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", "2", "-H", f"{a1}:1,{a2}:1",
          "--ssh-config-file", hosts.ssh_config, sys.executable,
          os.path.join(ROOT, "examples", "numpy_allreduce.py")]],
        env=ENV, timeout=60, merge_stderr=False)
    assert sorted(proc.stdout.splitlines()) == [
        f"[{r}]:rank {r}/2: allreduce sum = 3 (expected 3); allgather rows = 3" for r in range(2)
    ]


THREADS = """
    import os
    import ringflow as rf
    rf.init()
    print(f"rank {rf.rank()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')} "
          f"marked={os.environ.get('RINGFLOW_THREADS', '').split(':')[0]}", flush=True)
    rf.shutdown()
"""


@pytest.mark.parametrize("mine", [None, "3"])
def test_each_remote_host_decides_its_thread_counts(hosts, tmp_path, mine):
    """The remote bootstrap applies the thread rule on its host (ringflow/threads.py): 2 ranks
    per host; the user's OMP_NUM_THREADS (forwarded) is kept and the others follow it."""
    from ringflow import threads

    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent(THREADS))
    extra = ["-x", f"OMP_NUM_THREADS={mine}"] if mine else []
    env = {k: v for k, v in ENV.items() if k not in (*threads.VARIABLES, threads.MARK)}
    (proc,) = run_commands([[*launcher_args(hosts, *extra), sys.executable, str(script)]],
                           cwd=tmp_path, env=env, timeout=90, merge_stderr=False)
    want = threads.for_launcher({}, 0, 2, "auto").threads  # the namespaces share these CPUs
    count = mine or str(want)
    lines = sorted(line for line in proc.stdout.splitlines() if "OMP_NUM_THREADS=" in line)
    assert lines == [f"[{r}]:rank {r} OMP_NUM_THREADS={count} MKL_NUM_THREADS={count} "
                     f"marked={want}" for r in range(4)], proc.stdout + proc.stderr
    notes = proc.stderr.count("ringflow: note: OMP_NUM_THREADS=3 (yours) with 2 ranks")
    oversubscribed = mine and threads.physical_cores(threads.affinity()) < 3 * 2
    assert notes == (2 if oversubscribed else 0), proc.stderr  # local rank 0 of each host
