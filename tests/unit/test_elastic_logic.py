"""The pure parts of elastic training (issue 30): the driver's answers (ringflow.world), the
sampler's shards (ringflow.elastic.shard), ObjectState's commit/restore/sync and the run loop
(ringflow.elastic.run_fn), the discovery script's output (ringflow.runner.elastic.discover),
the driver's clock for lagging members (ringflow.runner.elastic_driver). Real processes:
tests/multiproc/test_elastic.py."""

from __future__ import annotations

import pickle
import random
import time

import pytest

from ringflow.elastic import ObjectState, run_fn, shard
from ringflow.errors import (
    ConfigError,
    HostsUpdatedInterrupt,
    LaunchError,
    PeerError,
    RingflowTimeoutError,
)
from ringflow.rendezvous import MemoryStore
from ringflow.runner.elastic import discover
from ringflow.runner.elastic_driver import ElasticDriver, Policy
from ringflow.topology import RankInfo
from ringflow.world import World, format_assignment, parse_assignment


def test_assignment_round_trip_and_removed():
    info = RankInfo(2, 3, 0, 1, 2, 3, "127.0.0.1", "ringflow")
    assert parse_assignment(format_assignment(4, info)) == (4, info)
    assert parse_assignment(b"removed") is None


def test_malformed_assignment_names_the_fix():
    with pytest.raises(ConfigError, match="are the launcher and the workers the same ringflow"):
        parse_assignment(b"1 2 three")


def test_world_asks_and_waits_for_its_answer():
    store = MemoryStore(timeout=5)
    world = World(store, 7, timeout_s=1)
    store.set("elastic/resp/7/1", format_assignment(0, RankInfo(0, 2, 0, 1, 0, 2, "a")))
    store.set("elastic/update", b"-1")
    g, info = world.join()
    assert (g, info.rank, info.size, store.get("elastic/req/7")) == (0, 0, 2, b"1")
    assert not world.update_pending()
    store.set("elastic/update", b"0")
    assert world.update_pending()
    store.set("elastic/resp/7/2", b"removed")
    assert world.join() is None
    assert store.get("elastic/req/7") == b"2"


def test_a_generation_stores_wait_ends_when_the_driver_says_it_lost_a_member():
    store = MemoryStore(timeout=5)
    gen = World(store, 0, timeout_s=1, default_timeout_s=0.3).store_of(2)
    store.set("elastic2/x", b"1")
    assert gen.get("elastic2/x") == b"1"
    with pytest.raises(RingflowTimeoutError, match=r"'elastic2/y' was not set within 0\.3 s"):
        gen.get("elastic2/y")
    store.set("elastic/abort/2", b"1")
    start = time.monotonic()
    with pytest.raises(PeerError, match="generation 2 of the elastic job lost a worker"):
        gen.wait(["elastic2/y"], timeout=30)
    assert time.monotonic() - start < 5  # one poll, not the 30 s asked for


@pytest.mark.parametrize("length", [0, 1, 12, 101])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_cover_each_sample_once_whatever_the_sizes(length, shuffle):
    """Generations of sizes 3, 1, 4, 2 take turns: after k full steps of one sample a rank, the
    next generation shards the rest; every sample of the epoch is taken exactly once."""
    rng = random.Random(length)
    taken: list[int] = []
    processed = 0
    while processed < length:
        size = rng.choice([1, 2, 3, 4])
        shards = [shard(length, 3, 5, shuffle, processed, r, size) for r in range(size)]
        assert sorted(i for s in shards for i in s) == sorted(
            shard(length, 3, 5, shuffle, processed, 0, 1))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        steps = rng.randint(1, max(1, max(map(len, shards))))
        for k in range(steps):
            taken += [s[k] for s in shards if k < len(s)]
        processed = min(length, processed + steps * size)
    assert sorted(taken) == list(range(length))


class _Bcast:
    """rank 0's value as a broadcast from rank 0 would give it: here, a given one."""

    def __init__(self, root_value: object = None) -> None:
        self.root_value = root_value

    def __call__(self, obj: object) -> object:
        return obj if self.root_value is None else self.root_value


def test_object_state_commit_restore_and_deep_copies():
    state = ObjectState(bcast_object=_Bcast(), get_rank=lambda: 0, epoch=0, seen=[1])
    state.epoch = 3
    state.seen.append(2)
    state.restore()
    assert (state.epoch, state.seen) == (0, [1])  # in place changes are rolled back too
    state.epoch, state.seen = 4, [1, 2]
    state.save()
    state.seen.append(3)
    state.restore()
    assert (state.epoch, state.seen) == (4, [1, 2])


def test_object_state_saved_is_what_a_restarted_process_restores():
    """What torchrun's agent store keeps between restarts: ``saved()`` pickled, loaded into a
    new state of the same kind, then restored."""
    state = ObjectState(bcast_object=_Bcast(), get_rank=lambda: 0, epoch=0, seen=[1])
    state.epoch, state.seen = 5, [1, 2]
    state.save()
    state.epoch = 6  # not committed
    fresh = ObjectState(bcast_object=_Bcast(), get_rank=lambda: 0, epoch=0, seen=[])
    fresh.load_saved(pickle.loads(pickle.dumps(state.saved())))
    assert (fresh.epoch, fresh.seen) == (0, [])  # until restored
    fresh.restore()
    assert (fresh.epoch, fresh.seen) == (5, [1, 2])


def test_object_state_sync_takes_rank0s_saved_values():
    state = ObjectState(bcast_object=_Bcast({"epoch": 9, "seen": [7]}), get_rank=lambda: 1,
                        epoch=0, seen=[])
    state.sync()
    assert (state.epoch, state.seen) == (9, [7])


class _Recorder(ObjectState):
    """An ObjectState that logs its calls and checks no host updates (no job here)."""

    def __init__(self, **kwargs: object) -> None:
        self.calls: list[str] = []
        super().__init__(bcast_object=_Bcast(), get_rank=lambda: 0, **kwargs)

    def sync(self) -> None:
        self.calls.append("sync")
        super().sync()

    def restore(self) -> None:
        self.calls.append("restore")
        super().restore()

    def check_host_updates(self) -> None:
        pass


def test_run_rolls_back_on_a_failure_and_not_on_an_interrupt_and_syncs_after_each_reset():
    events = iter(["fail", "interrupt", "done"])
    resets: list[int] = []

    def train(state: _Recorder) -> str:
        state.step += 1
        what = next(events)
        if what == "fail":
            raise PeerError("a peer died")
        if what == "interrupt":
            state.commit()
            raise HostsUpdatedInterrupt("hosts changed")
        return f"done at {state.step}"

    state = _Recorder(step=0)
    state.register_reset_callbacks([lambda: resets.append(state.step)])
    assert run_fn(train, lambda: None)(state) == "done at 2"
    assert state.calls == ["sync", "restore", "sync", "sync"]
    assert resets == [0, 1]  # the failed step was undone; the interrupted one was committed


def test_a_failure_during_sync_rolls_back_and_resets():
    state = _Recorder(step=5)
    failures = iter([True, False])
    original = state.sync

    def flaky_sync() -> None:
        original()
        if next(failures):
            raise PeerError("a peer died during sync")

    state.sync = flaky_sync  # type: ignore[method-assign]
    resets: list[int] = []
    assert run_fn(lambda s: s.step, lambda: resets.append(1))(state) == 5
    assert resets == [1] and state.calls == ["sync", "restore", "sync"]


def _script(tmp_path, text: str):
    path = tmp_path / "hosts.sh"
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return str(path)


def test_discover_reads_names_and_slots(tmp_path):
    script = _script(tmp_path, "printf 'localhost:2\\n\\n127.0.0.1\\n[::1]:3\\n'\n")
    assert discover(script, slots_per_host=4) == {"localhost": 2, "127.0.0.1": 4, "::1": 3}


@pytest.mark.parametrize(("text", "fragment"), [
    ("exit 3\n", "exited with code 3"),
    ("echo 'a:0'\n", "expected a positive integer"),
])
def test_discover_failures_say_what_failed(tmp_path, text, fragment):
    with pytest.raises(LaunchError, match=fragment):
        discover(_script(tmp_path, text), 1)


def test_a_bad_worker_id_names_the_variables(monkeypatch):
    from ringflow import runtime
    from ringflow.config import Config

    monkeypatch.setenv("RINGFLOW_ELASTIC_ID", "one")
    monkeypatch.setattr(runtime, "_world", None)
    with pytest.raises(ConfigError, match="RINGFLOW_ELASTIC_ID='one' and "
                                          "RINGFLOW_ELASTIC_TIMEOUT_S='600' must be a number"):
        runtime._next_generation(Config.from_env({}))


def test_outside_an_elastic_job_a_failed_reinit_is_raised(monkeypatch):
    """Under a fixed-size launcher there is no next generation to ask for: the reset's init()
    error ends the loop instead of retrying for good."""
    from ringflow import elastic, runtime

    calls: list[str] = []
    monkeypatch.setattr(runtime, "_world", None)
    monkeypatch.setattr(elastic, "shutdown", lambda: calls.append("shutdown"))

    def init() -> None:
        calls.append("init")
        raise PeerError("rank 1 is gone")

    monkeypatch.setattr(elastic, "init", init)
    with pytest.raises(PeerError, match="rank 1 is gone"):
        elastic._reset()
    assert calls == ["shutdown", "init"]


class _Pool:
    """Workers that only record what the driver asks of them."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.stopped: list[int] = []

    def start(self, spec, env) -> None:
        self.started.append(spec.rank)

    def stop(self, wid: int) -> None:
        self.stopped.append(wid)


def _ask(store: MemoryStore, wid: int) -> None:
    store.add(f"elastic/req/{wid}", 1)


def test_the_lagging_clock_starts_when_a_member_asks_not_when_newcomers_wait():
    """Newcomers waiting never get a member stopped (it may be in a long step: they wait for its
    next commit); once a member has left its generation, one that has not is stopped after the
    elastic timeout."""
    store, pool = MemoryStore(), _Pool()
    driver = ElasticDriver(Policy(min_np=2, max_np=3, elastic_timeout_s=1.0), store,
                           lambda: {}, pool)
    driver.hosts = {"a": 2}
    t = driver.started
    driver._fill(t)
    _ask(store, 0)
    _ask(store, 1)
    assert driver._form(t) is None and driver.generation == 0 and driver.members == [0, 1]
    driver.hosts = {"a": 2, "b": 1}
    driver._fill(t)
    _ask(store, 2)  # a newcomer waits
    assert driver._form(t) is None and store.get("elastic/update") == b"0"
    assert driver._form(t + 100.0) is None and pool.stopped == []
    _ask(store, 0)  # a member leaves its generation; member 1 lags
    assert driver._form(t + 101.0) is None and pool.stopped == []
    assert driver._form(t + 102.5) is None and pool.stopped == [1]
