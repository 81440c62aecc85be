"""ringflow.ray.RayExecutor on a one-node Ray cluster that this module starts on 127.0.0.1.

The cluster (4 logical CPUs, no dashboard, no usage statistics) lives for the module; each test
starts its own executor. The actors import this worktree's ringflow and this test module through
the job's ``runtime_env`` (PYTHONPATH), as a user's cluster would through an installed package.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# Read by Ray when it is imported, so set before the import: without
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray 2.60 replaces 127.0.0.1 by the address of the default
# route's interface and its servers listen on every interface; usage statistics would phone home.
_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
os.environ.update(_RAY_ENV)

ray = pytest.importorskip("ray")

import ringflow  # noqa: E402
from ringflow.errors import ConfigError, LaunchError, PeerError, RankFailure, RingflowError  # noqa: E402
from ringflow.ray import RayExecutor  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
HERE = str(Path(__file__).resolve().parent)
#: Generous: an actor's death reached the driver in 30-40 ms here (see the report test).
DEATH_DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:  # Ray was imported before this module set the variable
        pytest.fail("Ray was imported before tests/multiproc/test_ray.py set "
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, so its cluster would listen beyond "
                    "loopback; set the variable in the environment of pytest")
    os.environ.update(_RAY_ENV)
    if ray.is_initialized():
        ray.shutdown()
    pythonpath = os.pathsep.join(filter(None, [ROOT, HERE, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def executor_of(cluster: None) -> Iterator:
    """``executor_of(n)``: a started executor of ``n`` workers, shut down after the test."""
    made: list[RayExecutor] = []

    def make(n: int, **start_kwargs: object) -> RayExecutor:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=n)
        made.append(executor)
        executor.start(**start_kwargs)
        return executor

    yield make
    for executor in made:
        executor.shutdown()


def _state(pid: int) -> str:
    """The process state letter, or "" when there is no such process; a zombie ("Z") has exited
    and only waits for the raylet to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _running(pids: list[int]) -> list[int]:
    return [p for p in pids if _state(p) not in ("", "Z")]


# -- functions the actors run (module level: the actors import this module) ----------------


def allreduce_rank_plus_one(scale: float) -> tuple:
    ringflow.init()
    total = ringflow.allreduce(np.full(9, ringflow.rank() + 1.0), name="t", op=ringflow.Sum)
    ints = ringflow.allreduce(np.arange(5, dtype=np.int64) * (ringflow.rank() + 1), name="i",
                              op=ringflow.Sum)
    return (ringflow.rank(), ringflow.size(), ringflow.local_rank(), ringflow.local_size(),
            ringflow.cross_rank(), ringflow.cross_size(), total * scale, ints)


def allreduce_again() -> float:
    # No init(): the engine of the previous call on this executor is still up.
    return float(ringflow.allreduce(np.ones(3), name="again", op=ringflow.Sum)[0])


def ringflow_rank() -> int:
    return int(os.environ["RINGFLOW_RANK"])


def fresh_job_each_call() -> float:
    # shutdown() + init() in every actor forms a fresh job over the same store.
    ringflow.shutdown()
    ringflow.init()
    return float(ringflow.allreduce(np.ones(2), name="fresh", op=ringflow.Sum)[0])


def raise_on_rank_one() -> str:
    ringflow.init()
    if ringflow.rank() == 1:
        raise KeyError("no such thing on rank one")
    ringflow.allreduce(np.ones(4), name="waits-for-rank-1")  # blocks until rank 1 is gone
    return "unreachable"


def allreduce_forever() -> None:
    ringflow.init()
    step = 0
    while True:
        ringflow.allreduce(np.ones(16), name=f"loop.{step % 3}")
        step += 1


def train_torch(steps: int, batch: int, seed: int) -> list[np.ndarray]:
    import torch

    import ringflow.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    model = _model(torch)
    x, y = _data(torch, steps, hvd.size() * batch, seed)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(hvd.rank() * batch, (hvd.rank() + 1) * batch)
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step, mine]), y[step, mine]).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _model(torch):  # type: ignore[no-untyped-def]
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(torch, steps: int, rows: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(steps, rows, 4, generator=gen), torch.randn(steps, rows, 1, generator=gen)


def secret_and_environment() -> tuple[str, dict[str, str], int]:
    ringflow.init()
    ringflow.allreduce(np.ones(1), name="warm")
    return ringflow.rendezvous.read_secret().hex(), dict(os.environ), os.getpid()


class Counter:
    def __init__(self, start: int, *, step: int) -> None:
        self.value, self.step = start, step

    def bump(self) -> int:
        self.value += self.step
        return self.value


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_run_allreduces_on_every_rank_in_rank_order(executor_of, n: int) -> None:
    executor = executor_of(n)
    results = executor.run(allreduce_rank_plus_one, args=[2.0])
    assert [r[:6] for r in results] == [(r, n, r, n, 0, 1) for r in range(n)]
    for rank, (*_, total, ints) in enumerate(results):
        np.testing.assert_array_equal(total, np.full(9, n * (n + 1) / 2 * 2.0), f"rank {rank}")
        np.testing.assert_array_equal(ints, np.arange(5) * n * (n + 1) // 2, f"rank {rank}")
    # The job goes on: the engines stay up between calls.
    assert executor.run(allreduce_again) == [float(n)] * n
    assert executor.run(lambda k: ringflow.rank() * k, kwargs={"k": 10}) == [
        10 * r for r in range(n)]
    for _ in range(2):
        assert executor.run(fresh_job_each_call) == [float(n)] * n


def thread_plan() -> tuple[int, int, dict, dict]:
    import torch

    from ringflow import threads

    ringflow.init()
    plan = threads.current()
    return torch.get_num_threads(), plan.threads, plan.user, plan.set


def test_the_thread_rule_applies_at_init_in_the_actors(executor_of) -> None:
    """The cluster's runtime_env gives the actors OMP_NUM_THREADS=1: the user's, kept, and the
    other variables follow it (Ray's own default, set inside the actor process, is not the
    user's: tests/unit/test_threads.py)."""
    for torch_threads, count, user, mine in executor_of(2).run(thread_plan):
        assert (torch_threads, count, user) == (1, 1, {"OMP_NUM_THREADS": "1"})
        assert mine["MKL_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in mine


def test_execute_and_execute_single_use_the_executable(executor_of) -> None:
    executor = executor_of(2, executable_cls=Counter, executable_args=[5],
                           executable_kwargs={"step": 2})
    assert executor.execute(lambda counter: counter.bump()) == [7, 7]
    assert executor.execute_single(lambda counter: counter.bump()) == 9
    assert executor.execute(lambda counter: counter.value) == [9, 7]
    with pytest.raises(LaunchError, match="running already"):
        executor.start()
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="could not serialize"):
        executor.run(lambda: lock)
    assert executor.execute_single(lambda counter: counter.value) == 9  # the job goes on


def test_a_deadline_stops_the_job_and_names_the_first_unfinished_rank(executor_of) -> None:
    executor = executor_of(2)
    pids = executor.run(os.getpid)
    # Rank 0 returns at once, but through Ray's task dispatch: 1 s was too short for it on 2
    # cores at load 10 (the whole suite under pytest-xdist), so it was named instead of rank 1.
    with pytest.raises(RankFailure, match=r"did not finish within the deadline of 10\.0 s") as info:
        executor.run(lambda: time.sleep(0.0 if ringflow_rank() == 0 else 120), timeout=10.0)
    assert info.value.rank == 1
    assert "ranks [1] were still running" in str(info.value)
    assert _running(pids) == []


def test_torch_distributed_optimizer_matches_one_process_on_the_global_batch(executor_of) -> None:
    torch = pytest.importorskip("torch")
    n, steps, batch, seed = 2, 4, 3, 7
    executor = executor_of(n)
    per_rank = executor.run(train_torch, args=[steps, batch, seed], timeout=90)

    torch.manual_seed(seed)
    model = _model(torch)
    x, y = _data(torch, steps, n * batch, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
    expected = [p.detach().numpy() for p in model.parameters()]
    for rank, params in enumerate(per_rank):
        for got, want, first in zip(params, expected, per_rank[0], strict=True):
            np.testing.assert_array_equal(got, first, f"rank {rank} differs from rank 0")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")


def test_an_exception_on_rank_1_is_raised_naming_rank_1(executor_of) -> None:
    executor = executor_of(3)
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        executor.run(raise_on_rank_one, timeout=60)
    elapsed = time.monotonic() - started
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1: KeyError: 'no such thing on rank one'")
    assert "Traceback" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    assert elapsed < DEATH_DEADLINE_S
    # The job is over; a new start() makes a new one.
    with pytest.raises(LaunchError, match="the job is over"):
        executor.run(allreduce_again)
    executor.start()
    assert executor.run(allreduce_rank_plus_one, args=[1.0])[2][6][0] == 6.0


@pytest.mark.parametrize("how", ["SIGKILL", "ray.kill"])
def test_a_killed_actor_fails_run_naming_its_rank(executor_of, how: str) -> None:
    executor = executor_of(3)
    pids = executor.run(os.getpid)
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(1.0)  # every rank is inside the loop by now
        killed_at.append(time.monotonic())
        if how == "SIGKILL":
            os.kill(pids[1], signal.SIGKILL)
        else:
            ray.kill(executor.workers[1])

    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(RankFailure) as info:
        executor.run(allreduce_forever, timeout=60)
    latency = time.monotonic() - killed_at[0]
    killer.join()
    print(f"\n{how}: the driver raised {latency * 1000:.0f} ms after the kill")
    assert info.value.rank == 1
    assert f"rank 1: its Ray actor (pid {pids[1]} " in str(info.value)
    assert "died" in str(info.value)
    assert isinstance(info.value, RingflowError)
    assert latency < DEATH_DEADLINE_S
    assert _running(pids) == []  # the job is over: every actor was killed


def test_blocked_peers_of_a_dead_actor_get_peer_error(executor_of) -> None:
    """Without the executor's supervision (run_remote), the ranks blocked in a collective with
    a rank whose actor dies are released by ringflow's engine with PeerError naming it."""
    executor = executor_of(3)
    executor.run(ringflow.init)
    refs = executor.run_remote(allreduce_forever)
    time.sleep(1.0)
    ray.kill(executor.workers[1])
    started = time.monotonic()
    for rank in (0, 2):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(refs[rank], timeout=DEATH_DEADLINE_S)
        assert isinstance(info.value.cause, PeerError), info.value
        assert "rank 1" in str(info.value.cause)
    assert time.monotonic() - started < DEATH_DEADLINE_S


def test_shutdown_leaves_no_actor_store_or_placement_group(executor_of) -> None:
    executor = executor_of(2)
    pids = executor.run(os.getpid)
    job = executor._job
    store = (job.server.host, job.server.port)
    group = job.placement_group.id.hex()
    assert _running(pids) == pids
    executor.shutdown()
    assert _running(pids) == []
    with pytest.raises(OSError), socket.create_connection(store, timeout=2):
        pass
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
    executor.shutdown()  # twice is fine
    with pytest.raises(LaunchError, match="before start"):
        executor.run(os.getpid)


def test_an_executor_dropped_without_shutdown_leaves_nothing(cluster: None) -> None:
    executor = RayExecutor(num_workers=2)
    executor.start()
    pids = executor.run(os.getpid)
    store = (executor._job.server.host, executor._job.server.port)
    del executor
    gc.collect()
    assert _running(pids) == []
    with pytest.raises(OSError), socket.create_connection(store, timeout=2):
        pass


def test_secret_stays_out_of_environments_command_lines_and_logs(executor_of) -> None:
    executor = executor_of(2)
    outcomes = executor.run(secret_and_environment)
    secret = outcomes[0][0]
    assert len(secret) == 64 and all(o[0] == secret for o in outcomes)
    for _, env, pid in outcomes:
        assert env["RINGFLOW_SECRET_FD"].isdigit()
        assert "RINGFLOW_SECRET_FILE" not in env
        assert not [k for k, v in env.items() if secret in v.lower()]
        for name in ("cmdline", "environ"):
            with open(f"/proc/{pid}/{name}", "rb") as f:
                assert secret.encode() not in f.read().lower(), name
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    leaked = [p for p in logs.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _listeners() -> dict[int, str]:
    """Socket inode -> local address of every listening TCP socket and bound UDP socket."""
    found = {}
    for table, listening in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == listening and not local.endswith(":0000"):
                    found[inode] = f"{table} {local}"
    return found


def _is_loopback(local: str) -> bool:
    address = local.split()[1].split(":")[0]
    # /proc/net writes addresses as host-order hex words: 127.0.0.1 is 0100007F, ::1 is
    # 00000000000000000000000001000000, and ::ffff:127.0.0.1 ends in FFFF0000 0100007F.
    return (address.endswith("7F") and len(address) == 8) or address in (
        "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_listener_of_the_job_is_on_loopback(executor_of) -> None:
    """The driver, the store, Ray's processes (started by this driver) and the actors, with
    ringflow initialized: every listening socket is on 127.0.0.1."""
    executor = executor_of(2)
    executor.run(allreduce_rank_plus_one, args=[1.0])
    listeners = _listeners()
    mine: dict[str, list[str]] = {}
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:[") and int(target[8:-1]) in listeners:
                        name = Path(f"/proc/{pid}/comm").read_text().strip()
                        mine.setdefault(name, []).append(listeners[int(target[8:-1])])
    assert "raylet" in mine and "gcs_server" in mine, mine  # Ray's processes were seen
    job = executor._job
    assert job.server.host == "127.0.0.1"
    outside = {name: [a for a in addrs if not _is_loopback(a)] for name, addrs in mine.items()}
    assert {k: v for k, v in outside.items() if v} == {}, mine
    with contextlib.suppress(OSError):  # what `pytest -s` shows; ss may be missing
        print("\n" + subprocess.run(["ss", "-ltnup"], capture_output=True, text=True).stdout)
