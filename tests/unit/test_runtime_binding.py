"""runtime.bound: a thread acting as one rank of an in-process job (ringflow.testing.run_engines).

No engine runs here: a stand-in with ``shutdown()`` is enough for what the runtime reads.
"""

from __future__ import annotations

import threading

import pytest

import ringflow
from ringflow import runtime, submission, topology
from ringflow.client import local_client
from ringflow.errors import ConfigError, NotInitializedError
from ringflow.topology import RankInfo


class FakeEngine:
    def __init__(self) -> None:
        self.stopped = 0

    def shutdown(self) -> None:
        self.stopped += 1


def binding(rank: int, size: int) -> runtime.Binding:
    info = RankInfo(rank, size, rank, size, 0, 1, "host", detector="threads")
    return runtime.Binding(FakeEngine(), info, local_client(1.0))


def test_a_bound_thread_reads_its_rank_and_nothing_leaks_out() -> None:
    b = binding(2, 5)
    with runtime.bound(b):
        assert (ringflow.rank(), ringflow.size(), ringflow.local_rank()) == (2, 5, 2)
        assert ringflow.is_initialized() and runtime.running() is b.engine
        assert ringflow.get_client() is b.client
    assert not ringflow.is_initialized()
    # Outside the binding, rank() answers from the process's environment, as before init().
    assert ringflow.rank() == topology.detect().rank


def test_bindings_nest_and_are_per_thread() -> None:
    outer, inner = binding(0, 2), binding(1, 2)
    seen: list[int] = []
    with runtime.bound(outer):
        with runtime.bound(inner):
            assert ringflow.rank() == 1
            other = threading.Thread(target=lambda: seen.append(ringflow.is_initialized()))
            other.start()
            other.join()
        assert ringflow.rank() == 0
    assert seen == [False]  # another thread does not see this thread's binding


def test_shutdown_stops_only_the_bound_engine_and_init_cannot_restart_it() -> None:
    b = binding(0, 1)
    engine = b.engine
    with runtime.bound(b):
        ringflow.init()  # initialized already: nothing to do
        ringflow.shutdown()
        ringflow.shutdown()  # safe to call twice
        assert engine.stopped == 1 and b.engine is None
        with pytest.raises(NotInitializedError):
            ringflow.rank()
        with pytest.raises(ConfigError, match="run_engines, whose engine was shut down"):
            ringflow.init()


def test_unnamed_tensors_are_counted_per_engine() -> None:
    a, b = binding(0, 2), binding(1, 2)
    names = []
    for _ in range(2):
        for bd in (a, b):
            with runtime.bound(bd):
                names.append(submission.name_of("allreduce", None, 0))
    assert names == ["allreduce.noname.0", "allreduce.noname.0",
                     "allreduce.noname.1", "allreduce.noname.1"]
