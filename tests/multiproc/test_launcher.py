"""ringflow-run and spawn_ranks with real processes on this host."""

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
from ringflow.errors import RankFailure
from ringflow.testing import CommandResult, run_commands, spawn_ranks

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
ENV = {**os.environ, "PYTHONPATH": PYTHONPATH}
LAUNCHER = [sys.executable, "-m", "ringflow.runner"]


def script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def launch(*args: str, timeout: float = 60) -> CommandResult:
    """ringflow-run with ``args``; its exit code is the test's to check."""
    (result,) = run_commands([[*LAUNCHER, *args]], env=ENV, timeout=timeout, check=False,
                             merge_stderr=False)
    return result


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (an orphaned zombie may wait for a lazy init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def wait_for(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


CONTRACT = """
    import os
    from ringflow.rendezvous import connect
    from ringflow.topology import detect

    env = os.environ
    info = detect()
    rank, size = info.rank, info.size
    assert info.detector == "ringflow", info
    assert size == 3 and info.local_size == 3 and info.local_rank == rank, info
    assert (info.cross_rank, info.cross_size) == (0, 1), info
    assert env["RINGFLOW_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert int(env["RINGFLOW_LAUNCHER_PID"]) == os.getppid()
    assert env["RINGFLOW_JOB_ID"] and int(env["RINGFLOW_SECRET_FD"]) > 2
    assert "glibc.cpu.x86_non_temporal_threshold=" in env["GLIBC_TUNABLES"]
    store = connect()
    store.set(f"value/{rank}", f"{env['RINGFLOW_JOB_ID']}:{rank * 10 + 7}".encode())
    seen = [store.get(f"value/{r}").decode() for r in range(size)]
    assert seen == [f"{env['RINGFLOW_JOB_ID']}:{r * 10 + 7}" for r in range(size)], seen
    print(f"rank {rank} saw", [s.split(":")[1] for s in seen])
    store.add("done", 1)
    store.close()
"""


def test_environment_contract_and_store_exchange(tmp_path):
    proc = launch("-np", "3", sys.executable, script(tmp_path, CONTRACT))
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        assert f"[{rank}]:rank {rank} saw ['7', '17', '27']" in proc.stdout.splitlines()


BOUND = """
    import os, threading
    import numpy as np
    import ringflow as rf

    early = threading.Thread(target=threading.Event().wait, daemon=True)
    early.start()  # a thread from before init() must be pinned too
    rf.init()
    rf.allreduce(np.ones(3), name="warm")  # engine and transport threads are running
    masks = set()
    for t in os.listdir("/proc/self/task"):
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(t)))))
        except ProcessLookupError:  # a short-lived thread ended between listing and asking
            pass
    print(f"rank {rf.rank()} cpus {sorted(masks)}")
    rf.shutdown()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
def test_bind_to_core_pins_every_thread_of_each_rank_to_its_own_cpus(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    proc = launch("-np", "2", "--bind-to", "core", sys.executable, script(tmp_path, BOUND))
    assert proc.returncode == 0, proc.stderr
    half = len(cpus) // 2
    for rank, mine in ((0, cpus[:half]), (1, cpus[half:2 * half])):
        assert f"[{rank}]:rank {rank} cpus {[tuple(mine)]}" in proc.stdout.splitlines(), proc.stdout
    proc = launch("-np", "2", "--bind-to", "none", sys.executable, script(tmp_path, BOUND))
    assert proc.returncode == 0, proc.stderr
    assert f"[1]:rank 1 cpus {[tuple(cpus)]}" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or len(os.sched_getaffinity(0)) < (os.cpu_count() or 0),
                    reason="needs Linux, at least 2 CPUs, and no affinity set on the tests")
def test_ringflow_run_binds_by_default_only_where_it_is_safe(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    proc = launch("-np", "2", sys.executable, script(tmp_path, BOUND))  # default: auto
    assert proc.returncode == 0, proc.stderr
    for rank, mine in ((0, cpus[:half]), (1, cpus[half:2 * half])):
        assert f"[{rank}]:rank {rank} cpus {[tuple(mine)]}" in proc.stdout.splitlines(), proc.stdout
    # More ranks than CPUs: nobody is pinned (two ranks would share one CPU).
    n = len(cpus) + 1
    proc = launch("-np", str(n), sys.executable, script(tmp_path, BOUND))
    assert proc.returncode == 0, proc.stderr
    assert f"[{n - 1}]:rank {n - 1} cpus {[tuple(cpus)]}" in proc.stdout.splitlines(), proc.stdout
    # A job someone placed already (taskset, a cpuset, mpirun's binding) stays where it is.
    placed = cpus[:-1] if len(cpus) > 2 else cpus[:1]
    (proc,) = run_commands(
        [["taskset", "-c", ",".join(map(str, placed)), *LAUNCHER, "-np", "2", sys.executable,
          script(tmp_path, BOUND)]], env=ENV, timeout=120, merge_stderr=False)
    assert f"[0]:rank 0 cpus {[tuple(placed)]}" in proc.stdout.splitlines(), proc.stdout


SHM_MODE = """
    import numpy as np
    import ringflow as rf

    rf.init()
    x = np.arange(1 << 20, dtype=np.float32)
    ok = np.array_equal(rf.allreduce(x * (rf.rank() + 1), name="x", op=rf.Sum), x * 3)
    print(f"rank {rf.rank()} single copy {rf.runtime.running().backends.shm.single_copy} ok {ok}")
    rf.shutdown()
"""


def test_ranks_that_share_one_cpu_take_the_copy_path(tmp_path):
    """Single copy is for ranks that do not outnumber the CPUs they may run on together."""
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.run([*LAUNCHER, "-np", "2", sys.executable, script(tmp_path, SHM_MODE)],
                          env=ENV, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"[{rank}]:rank {rank} single copy False ok True" in proc.stdout.splitlines()


def test_bin_script_and_explicit_hosts(tmp_path):
    body = "import os; print(os.environ['RINGFLOW_RANK'], os.environ['RINGFLOW_SIZE'])"
    (proc,) = run_commands(
        [[sys.executable, os.path.join(ROOT, "bin", "ringflow-run"), "-np", "2", "-H",
          "localhost:4", sys.executable, script(tmp_path, body)]], env=ENV, timeout=60,
        merge_stderr=False)
    assert sorted(proc.stdout.splitlines()) == ["[0]:0 2", "[1]:1 2"]


def test_failing_rank_sets_exit_code_and_is_reported(tmp_path):
    body = """
        import os, sys, time
        if os.environ["RINGFLOW_RANK"] == "1":
            print("boom on rank one", file=sys.stderr)
            sys.exit(3)
        time.sleep(60)
    """
    start = time.monotonic()
    proc = launch("-np", "3", sys.executable, script(tmp_path, body))
    assert proc.returncode == 3
    assert "ringflow-run: rank 1 on host localhost exited with code 3" in proc.stderr
    assert "rank 1's stderr:\n  boom on rank one\n" in proc.stderr  # the report's tail
    assert time.monotonic() - start < 30  # the sleeping ranks were terminated


def test_rank_killed_by_signal_gives_128_plus_signal(tmp_path):
    body = """
        import os, signal, time
        if os.environ["RINGFLOW_RANK"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """
    proc = launch("-np", "3", sys.executable, script(tmp_path, body))
    assert proc.returncode == 128 + signal.SIGKILL
    assert "rank 2 on host localhost was killed by signal SIGKILL" in proc.stderr


def test_output_is_prefixed_with_partial_lines_and_invalid_utf8(tmp_path):
    body = r"""
        import os, sys, time
        rank = os.environ["RINGFLOW_RANK"].encode()
        out, err = sys.stdout.buffer, sys.stderr.buffer
        out.write(b"hello " + rank + b"\npart"); out.flush()
        time.sleep(0.2)
        out.write(b"ial\n\xff\xfebad\nno newline at end"); out.flush()
        err.write(b"to stderr\nunterminated"); err.flush()
    """
    proc = subprocess.run(
        [*LAUNCHER, "-np", "2", sys.executable, script(tmp_path, body)],
        env=ENV, capture_output=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode().splitlines()
    err = proc.stderr.decode().splitlines()
    for rank in range(2):
        expected = [f"hello {rank}", "partial", "\ufffd\ufffdbad", "no newline at end"]
        assert [line[4:] for line in out if line.startswith(f"[{rank}]:")] == expected
        assert [line[4:] for line in err if line.startswith(f"[{rank}]:")] == [
            "to stderr", "unterminated"
        ]


def start_sleepers(tmp_path: Path, np: int) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A job whose ranks each start a grandchild, record both pids, and sleep."""
    body = f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        rank = os.environ["RINGFLOW_RANK"]
        path = os.path.join({str(tmp_path)!r}, "pid-" + rank)
        with open(path + ".tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.replace(path + ".tmp", path)
        time.sleep(60)
    """
    launcher = subprocess.Popen(
        [*LAUNCHER, "-np", str(np), sys.executable, script(tmp_path, body)], env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    files = [tmp_path / f"pid-{r}" for r in range(np)]
    wait_for(lambda: all(f.exists() for f in files))
    return launcher, [int(p) for f in files for p in f.read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_leaves_no_worker(tmp_path, sig):
    launcher, pids = start_sleepers(tmp_path, 3)
    assert all(alive(pid) for pid in pids)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}" in err.decode()
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10)


def test_sigkill_to_launcher_kills_workers_through_pdeathsig(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    launcher, pids = start_sleepers(tmp_path, 2)
    workers = pids[0::2]
    launcher.kill()
    launcher.wait(timeout=30)
    wait_for(lambda: not any(alive(pid) for pid in workers), timeout=10)
    for grandchild in pids[1::2]:  # not covered by the death signal; clean up after ourselves
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def proc_texts(kind: str) -> list[tuple[int, bytes]]:
    texts = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/{kind}", "rb") as f:
                    texts.append((int(entry), f.read()))
            except OSError:
                pass  # gone, or another user's
    return texts


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_secret_never_in_any_command_line_or_environment(tmp_path):
    body = f"""
        import os, time
        from ringflow.rendezvous import read_secret
        rank = os.environ["RINGFLOW_RANK"]
        path = os.path.join({str(tmp_path)!r}, "secret-" + rank)
        with open(path + ".tmp", "w") as f:
            f.write(read_secret().hex() + " " + str(os.getpid()))
        os.replace(path + ".tmp", path)
        while not os.path.exists(os.path.join({str(tmp_path)!r}, "go")):
            time.sleep(0.02)
    """
    launcher = subprocess.Popen(
        [*LAUNCHER, "-np", "3", "--verbose", sys.executable, script(tmp_path, body)], env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        files = [tmp_path / f"secret-{r}" for r in range(3)]
        wait_for(lambda: all(f.exists() for f in files))
        values = {f.read_text().split()[0] for f in files}
        assert len(values) == 1
        hex_secret = values.pop()
        needles = [hex_secret.encode(), hex_secret.upper().encode(), bytes.fromhex(hex_secret)]
        worker_pids = {int(f.read_text().split()[1]) for f in files}
        cmdlines = proc_texts("cmdline")
        assert {launcher.pid, *worker_pids} <= {pid for pid, _ in cmdlines}
        for pid, text in cmdlines:
            assert not any(n in text for n in needles), f"secret in /proc/{pid}/cmdline"
        for pid, text in proc_texts("environ"):
            if pid in worker_pids or pid == launcher.pid:
                assert not any(n in text for n in needles), f"secret in /proc/{pid}/environ"
    finally:
        (tmp_path / "go").touch()
        out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, err
    assert hex_secret.encode() not in out + err  # not in --verbose logs either


def test_more_processes_than_slots_fails_before_starting(tmp_path):
    marker = tmp_path / "started"
    body = f"open({str(marker)!r}, 'w').close()"
    proc = launch("-np", "3", "-H", "localhost:2", sys.executable, script(tmp_path, body))
    assert proc.returncode == 2
    assert "-np 3 asks for more processes than the 2 slots" in proc.stderr
    assert not marker.exists()


def test_usage_errors_and_version():
    assert launch("-np", "2").returncode == 2
    assert launch("python").returncode == 2  # -np missing
    bad = launch("-np", "2", "-H", "localhost:0", "python")
    assert bad.returncode == 2 and "expected a positive integer" in bad.stderr
    remote = launch("-np", "2", "-H", "no-such-host.invalid:2", "python")
    assert remote.returncode == 1 and "pass --network-interface" in remote.stderr
    version = launch("--version")
    assert version.returncode == 0 and ringflow.__version__ in version.stdout


def test_missing_program_is_a_launch_error(tmp_path):
    proc = launch("-np", "2", str(tmp_path / "no-such-program"))
    assert proc.returncode == 1
    assert "could not start rank 0" in proc.stderr


# spawn_ranks: the workers are module-level functions so that they pickle by reference.


def rank_and_arg(arg):
    return int(os.environ["RINGFLOW_RANK"]), int(os.environ["RINGFLOW_SIZE"]), arg


def exchange_through_store():
    from ringflow.rendezvous import connect

    rank, size = int(os.environ["RINGFLOW_RANK"]), int(os.environ["RINGFLOW_SIZE"])
    store = connect()
    store.set(f"v{rank}", str(rank + 1).encode())
    total = sum(int(store.get(f"v{r}")) for r in range(size))
    store.close()
    return total


def fail_on_rank(bad):
    if int(os.environ["RINGFLOW_RANK"]) == bad:
        raise ValueError(f"rank {bad} is bad")
    time.sleep(60)


def hang_from_rank(first):
    if int(os.environ["RINGFLOW_RANK"]) >= first:
        time.sleep(60)
    return "done"


@pytest.mark.parametrize("n", [1, 3])
def test_spawn_ranks_returns_results_in_rank_order(n):
    assert spawn_ranks(n, rank_and_arg, args=("x",), deadline=60) == [
        (r, n, "x") for r in range(n)
    ]


def test_spawn_ranks_workers_have_the_full_contract():
    assert spawn_ranks(3, exchange_through_store, deadline=60) == [6, 6, 6]


def test_spawn_ranks_names_the_failing_rank():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_ranks(3, fail_on_rank, args=(1,), deadline=60)
    assert info.value.rank == 1
    assert "ValueError: rank 1 is bad" in str(info.value)
    assert "Traceback" in str(info.value) and "fail_on_rank" in str(info.value)
    assert time.monotonic() - start < 30


def test_spawn_ranks_deadline_names_lowest_unfinished_rank():
    start = time.monotonic()
    # 10 s: rank 0 (which returns at once) must have started and finished by then, even on a
    # loaded machine; otherwise it is the lowest unfinished rank.
    with pytest.raises(RankFailure, match=r"deadline of 10\.0 s") as info:
        spawn_ranks(3, hang_from_rank, args=(1,), deadline=10.0)
    assert info.value.rank == 1
    assert time.monotonic() - start < 40
