"""The thread rule (ringflow/threads.py) as pure functions: the count, the user's variables,
launchers' defaults, cgroup quotas, SMT siblings, and what init() does to torch."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringflow import threads
from ringflow.threads import MARK, VARIABLES


@pytest.mark.parametrize(("cpus", "cores", "sharing", "local", "quota", "want"), [
    (2, 2, 2, 2, None, 1),      # this VM: 2 ranks unbound
    (1, 2, 2, 2, None, 1),      # 2 ranks bound by ringflow: a CPU each
    (2, 2, 1, 1, None, 2),      # one rank
    (16, 8, 2, 2, None, 4),     # 8 cores with SMT, 2 ranks: cores, not CPUs
    (8, 8, 2, 2, None, 4),      # bound to 8 CPUs, whose cores the other rank's CPUs share
    (2, 1, 1, 4, None, 1),      # mpirun --bind-to core on an SMT core: one core of its own
    (2, 2, 4, 4, None, 1),      # more ranks than cores: never 0
    (64, 64, 2, 2, 8.0, 4),     # a container limited to 8 CPUs' worth of time
    (64, 64, 2, 2, 1.5, 1),     # a fraction below one per rank
    (64, 64, 1, 1, 2.5, 2),
])
def test_the_rule(cpus: int, cores: int, sharing: int, local: int, quota: float | None,
                  want: int) -> None:
    n, why = threads.count(cpus, cores, sharing, local, quota)
    assert n == want
    assert why


def test_the_reason_names_what_bounds_the_count() -> None:
    assert threads.count(2, 2, 2, 2, None)[1] == "2 cores / 2 ranks"
    assert threads.count(1, 1, 1, 2, None)[1] == "1 core of its own"
    assert threads.count(64, 64, 2, 2, 8.0)[1] == "CPU quota 8 / 2 ranks"


def test_unset_variables_get_the_count_and_a_mark() -> None:
    plan = threads.decide({}, (3, "why"), 2, 6)
    assert plan.threads == 3 and plan.user == {} and plan.note == ""
    assert plan.set == dict.fromkeys(VARIABLES, "3")
    env = plan.environ()
    assert env[MARK] == f"3:{','.join(VARIABLES)}:why"
    assert threads._marked(env) == set(VARIABLES)


def test_the_users_variables_win_and_omp_num_threads_sets_the_count() -> None:
    plan = threads.decide({"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "2"}, (1, "why"), 2, 2)
    assert plan.user == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "2"}
    assert plan.threads == 4 and plan.rule == 1
    assert set(plan.set) == set(VARIABLES) - {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert set(plan.set.values()) == {"4"}
    assert plan.note == ("OMP_NUM_THREADS=4 (yours) with 2 ranks on 2 cores is 8 threads: the "
                         "cores are oversubscribed; ringflow's default here is 1 (unset it to "
                         "take that)")


def test_a_users_count_that_fits_gets_no_note_and_odd_values_are_kept() -> None:
    assert threads.decide({"OMP_NUM_THREADS": "2"}, (2, "w"), 1, 2).note == ""
    nested = threads.decide({"OMP_NUM_THREADS": "2,1"}, (1, "w"), 1, 8)
    assert nested.threads == 2 and nested.user == {"OMP_NUM_THREADS": "2,1"}
    junk = threads.decide({"OMP_NUM_THREADS": "many", "OPENBLAS_NUM_THREADS": ""}, (1, "w"), 1, 8)
    assert junk.threads == 1 and junk.user == {"OMP_NUM_THREADS": "many"}
    assert "OPENBLAS_NUM_THREADS" in junk.set  # empty is unset


def test_variables_a_launcher_set_are_not_the_users() -> None:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "7"}
    plan = threads.decide(env, (3, "why"), 1, 4, launcher_set={"OMP_NUM_THREADS"})
    assert plan.user == {"MKL_NUM_THREADS": "7"} and plan.set["OMP_NUM_THREADS"] == "3"
    capped = threads.decide({}, (3, "why"), 1, 4, cap=(2, "reserved"))
    assert (capped.threads, capped.why) == (2, "reserved")


def test_an_enclosing_launchers_mark_makes_its_values_not_the_users() -> None:
    outer = threads.decide({}, (1, "outer"), 2, 2).environ()
    inner = threads.decide(outer, (2, "inner"), 1, 2, launcher_set=threads._marked(outer))
    assert inner.user == {} and inner.threads == 2


def test_torchruns_omp_num_threads_is_not_the_users(monkeypatch) -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr(threads, "_initial_environ", lambda pid: {b"PATH"})
    assert threads._launcher_defaults(env) == ({"OMP_NUM_THREADS"}, None)
    # the user gave torchrun one: it is in the agent's environment
    monkeypatch.setattr(threads, "_initial_environ", lambda pid: {b"PATH", b"OMP_NUM_THREADS"})
    assert threads._launcher_defaults(env) == (set(), None)
    # another value, or no /proc: the user's
    monkeypatch.setattr(threads, "_initial_environ", lambda pid: None)
    assert threads._launcher_defaults(env) == (set(), None)
    assert threads._launcher_defaults({**env, "OMP_NUM_THREADS": "3"}) == (set(), None)


def test_rays_omp_num_threads_caps_the_rule(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "ray", SimpleNamespace())
    monkeypatch.setattr(threads, "_initial_environ", lambda pid: {b"PATH"})
    assert threads._launcher_defaults({"OMP_NUM_THREADS": "2"}) == (
        {"OMP_NUM_THREADS"}, (2, "the Ray actor's CPU reservation"))
    monkeypatch.setattr(threads, "_initial_environ", lambda pid: {b"OMP_NUM_THREADS"})
    assert threads._launcher_defaults({"OMP_NUM_THREADS": "2"}) == (set(), None)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path) -> None:
    _write(tmp_path / "proc", "0::/kube/pod/ctr\n")
    _write(tmp_path / "fs/kube/cpu.max", "400000 100000\n")
    _write(tmp_path / "fs/kube/pod/cpu.max", "150000 100000\n")
    _write(tmp_path / "fs/kube/pod/ctr/cpu.max", "max 100000\n")
    assert threads.cpu_quota(str(tmp_path / "proc"), str(tmp_path / "fs")) == 1.5
    _write(tmp_path / "fs/kube/pod/cpu.max", "max 100000\n")
    assert threads.cpu_quota(str(tmp_path / "proc"), str(tmp_path / "fs")) == 4.0


def test_cgroup_v1_quota_and_no_limit(tmp_path) -> None:
    _write(tmp_path / "proc", "4:memory:/a\n3:cpu,cpuacct:/docker/abc\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "fs/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert threads.cpu_quota(str(tmp_path / "proc"), str(tmp_path / "fs")) == 2.5
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert threads.cpu_quota(str(tmp_path / "proc"), str(tmp_path / "fs")) is None
    assert threads.cpu_quota(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


def test_smt_siblings_are_one_core(tmp_path) -> None:
    for cpu in range(8):  # 4 cores, siblings (c, c + 4)
        _write(tmp_path / f"cpu{cpu}/topology/thread_siblings_list", f"{cpu % 4},{cpu % 4 + 4}\n")
    assert threads.physical_cores(range(8), str(tmp_path)) == 4
    assert threads.physical_cores([0, 4], str(tmp_path)) == 1
    assert threads.physical_cores([0, 1], str(tmp_path)) == 2
    assert threads.physical_cores([0, 9], str(tmp_path)) == 2  # unreadable: CPUs


def test_the_launchers_plan_on_this_host() -> None:
    cpus = len(threads.affinity())
    cores = threads.physical_cores(threads.affinity())
    quota = threads.cpu_quota()
    for local in (1, 2, 3):
        plan = threads.for_launcher({}, 0, local, "auto")
        want = max(1, min(cores // local, int(quota // local) if quota else cpus))
        assert plan.threads == want, (local, plan)
        assert plan.environ()[MARK].startswith(f"{want}:")


class _Torch:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_num_threads(self) -> int:
        return self.n

    def set_num_threads(self, n: int) -> None:
        self.n = n


def test_torch_follows_unless_the_user_set_it() -> None:
    plan = threads.decide({}, (1, "why"), 2, 2)
    torch = _Torch(2)  # torch's default here
    assert threads._torch(torch, plan, 2, 2, {2})[0] == "torch.set_num_threads(1) (was 2)"
    assert torch.n == 1
    mine = _Torch(3)  # set by the user before init()
    what, note = threads._torch(mine, plan, 2, 2, {2})
    assert mine.n == 3 and what == "torch.set_num_threads(3) kept (yours)"
    assert note.startswith("torch.set_num_threads=3 (yours) with 2 ranks on 2 cores is 6 threads")


def test_at_init_sets_the_environment_for_what_loads_later(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_FRAMEWORKS", {})  # leave this process's torch alone
    saved = dict(os.environ)
    try:
        for name in (*VARIABLES, MARK, "TORCHELASTIC_RUN_ID"):
            os.environ.pop(name, None)
        os.environ["MKL_NUM_THREADS"] = "1"
        info = SimpleNamespace(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0,
                               detector="single")
        plan = threads.at_init(info, None, "", threads.affinity(), False)
        assert threads.current() is plan
        assert plan.user == {"MKL_NUM_THREADS": "1"}
        assert all(os.environ[k] == str(plan.threads) for k in plan.set)
        assert threads._marked(os.environ) == set(plan.set)
    finally:
        os.environ.clear()
        os.environ.update(saved)
