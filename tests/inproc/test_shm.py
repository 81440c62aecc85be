"""Shared-memory and hierarchical allreduce, ranks as threads (each with its own mappings)."""

from __future__ import annotations

import itertools
import os
import stat
import threading

import numpy as np
import pytest

from ringflow import backends
from ringflow.algorithms import shm
from ringflow.config import Config
from ringflow.errors import PeerError, RingflowTimeoutError, ShutdownError
from ringflow.ops import BFLOAT16, ReduceOp
from ringflow.rendezvous import MemoryStore

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.available(), reason="/dev/shm is not writable here"),
]

LENGTHS = [0, 1, 7, 30_001]


@pytest.fixture(autouse=True, params=["single-copy", "copy"])
def mode(request, monkeypatch) -> str:
    """Every test runs twice: ranks reading each other's memory (process_vm_readv; the ranks
    here are threads of one process, which may), and through the segments, as where ptrace is
    restricted (the probe at setup fails, so every rank falls back)."""
    if request.param == "copy":
        monkeypatch.setattr(shm, "_read_from", lambda pid, addr, dst: -1)  # EPERM
    else:
        monkeypatch.setattr(shm, "_cpus", lambda: set(range(64)))  # more than any test's ranks
    return request.param


def reduce(link: backends.Backends, x, out, op, postscale: float = 1.0) -> None:
    """Through the job's first allreduce implementation: shared memory, or hierarchical when
    there are several hosts (``local < n``)."""
    link.allreduce[0].allreduce(link.transport, x, out, op, postscale)


def _leftovers(links) -> list[str]:
    names = {link.shm._name for link in links if link is not None}
    return [f for f in os.listdir("/dev/shm") if f.split("_d")[0].split("_f")[0] in names]


def _ranks(n: int, local: int, fn, timeout: float = 10.0) -> list:
    store = MemoryStore(timeout)
    links: list = [None] * n
    results: list = [None] * n
    errors: list = []

    def body(rank: int) -> None:
        try:
            links[rank] = backends.shared_memory(rank, n, store, Config(timeout_s=timeout),
                                                 local_size=local)
            results[rank] = fn(rank, links[rank])
        except BaseException as exc:  # re-raised below with the rank
            errors.append((rank, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for link in links:
        if link is not None:
            link.close(linger=0.5)
    assert _leftovers(links) == []
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"rank {rank}: {exc!r}") from exc
    return results


def _expected(dtype, op, n: int, length: int) -> np.ndarray:
    contrib = [(np.arange(length) % 5 + r + 1).astype(np.float64) for r in range(n)]
    if op == ReduceOp.SUM:
        out = np.sum(contrib, axis=0)
    elif op == ReduceOp.AVERAGE:
        out = np.sum(contrib, axis=0) / n
        if np.dtype(dtype).kind in "iu":
            out = np.trunc(out)
    elif op == ReduceOp.MIN:
        out = np.min(contrib, axis=0)
    elif op == ReduceOp.MAX:
        out = np.max(contrib, axis=0)
    else:
        out = np.prod(contrib, axis=0)
    return out.astype(dtype)


@pytest.mark.parametrize(("n", "local"), [(1, 1), (2, 2), (3, 3), (4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.float16,
                                   BFLOAT16, np.uint8])
def test_allreduce_closed_form_and_bitwise_identical(n, local, dtype):
    ops = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    if np.dtype(dtype) == np.uint8:
        ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX]  # products overflow a byte

    def body(rank: int, link) -> dict:
        got = {}
        for op in ops:
            for length in LENGTHS:
                x = (np.arange(length) % 5 + rank + 1).astype(dtype)
                out = np.empty_like(x)
                reduce(link, x, out, op)
                got[(op, length)] = out
        return got

    results = _ranks(n, local, body)
    assert all(r is not None for r in results)
    for op in ops:
        for length in LENGTHS:
            want = _expected(dtype, op, n, length)
            first = results[0][(op, length)]
            tol = 0 if np.dtype(dtype).itemsize > 2 or op != ReduceOp.AVERAGE else 1e-2
            np.testing.assert_allclose(first.astype(np.float64), want.astype(np.float64),
                                       rtol=tol, err_msg=f"{op.name} length {length}")
            for r in range(1, n):
                assert results[r][(op, length)].tobytes() == first.tobytes(), (r, op, length)


def test_float16_average_does_not_overflow_and_in_place_works():
    def body(rank: int, link) -> np.ndarray:
        x = np.full(70_001, 40000.0, np.float16)
        reduce(link, x, x, ReduceOp.AVERAGE)
        return x

    for out in _ranks(4, 4, body):
        assert np.all(out == 40000.0)


def test_input_view_packing_and_postscale():
    def body(rank: int, link) -> np.ndarray:
        view = link.shm.input_view(10, np.dtype(np.float32))
        view[:] = rank + 1
        reduce(link, view, view, ReduceOp.SUM, postscale=0.5)
        return view.copy()

    for out in _ranks(3, 3, body):
        assert np.all(out == 3.0)


def test_segments_are_owner_only_and_unlinked_once_mapped(tmp_path):
    path = str(tmp_path / "seg")
    mapping = shm._Mapping(path, 4096, create=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    mapping.close()
    # _ranks asserts that no file of the job is left, here after a 4 MiB segment was grown.
    _ranks(2, 2, lambda rank, link: reduce(link, np.ones(1 << 20, np.float32),
                                                        np.empty(1 << 20, np.float32),
                                                        ReduceOp.SUM))


def _mapped(names: set[str]) -> list[str]:
    """This process's descriptors and mappings of the segments named ``names`` (a closed
    segment leaves neither; Python's mmap holds a descriptor of its own while it is open)."""
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/maps") as maps:
        held += [line.split()[-1] for line in maps if "/dev/shm/" in line]
    return [h for h in held if any(name in h for name in names)]


def test_close_unmaps_every_segment_the_lane_and_the_flags_included():
    """What a rank held of a job's shared memory is gone at close, though views of it (the
    flag words, the lane's header words, an input view) were handed out; an elastic survivor
    closes a generation and goes on in the same process."""
    links: list = []

    def body(rank: int, link: backends.Backends):
        links.append(link)
        assert link.lane is not None or not lane_supported()
        view = link.shm.input_view(10, np.dtype(np.float32))
        view[:] = 1
        reduce(link, view, view, ReduceOp.SUM)
        return float(view[0])

    assert _ranks(3, 3, body) == [3.0] * 3
    names = {link.shm._name for link in links}
    assert _mapped(names) == []


def lane_supported() -> bool:
    from ringflow import lane

    return lane.TSO


def test_a_rank_that_never_arrives_times_out_naming_it():
    def body(rank: int, link):
        if rank == 1:
            return None  # never enters the allreduce
        with pytest.raises(RingflowTimeoutError, match=r"local ranks \[1\] did not reach"):
            reduce(link, np.ones(10, np.float32), np.empty(10, np.float32),
                   ReduceOp.SUM)
        return "timed out"

    assert _ranks(2, 2, body, timeout=1.0)[0] == "timed out"


def test_a_dead_peer_ends_the_barrier_wait():
    def body(rank: int, link):
        if rank == 1:
            link.transport.close(linger=0)  # what the others see when a process leaves
            return None
        with pytest.raises((PeerError, ShutdownError), match="rank 1"):
            reduce(link, np.ones(10, np.float32), np.empty(10, np.float32),
                   ReduceOp.SUM)
        return "failed"

    assert _ranks(2, 2, body, timeout=20.0)[0] == "failed"


def test_a_rank_of_another_host_leaving_does_not_fail_a_local_barrier():
    """2 hosts x 2 ranks: rank 3 (host 1) says goodbye while rank 1 waits in host 0's barrier
    for a slow rank 0. Only the ranks being waited for may fail the wait."""
    import time

    def body(rank: int, link):
        if rank == 3:
            link.transport.close(linger=0)
            return "left"
        if rank == 2:
            return "idle"
        if rank == 0:
            time.sleep(1.0)  # rank 3's goodbye reaches rank 1 while it waits here
        link.shm.barrier()
        return "passed"

    assert _ranks(4, 2, body, timeout=20.0) == ["passed", "passed", "idle", "left"]


def test_a_rank_that_reached_the_barrier_and_left_does_not_fail_it():
    """Rank 0 reaches the barrier and shuts down, as after its last operation, while rank 1
    still waits there for a slow rank 2 (seen as a flaky 4-rank engine test: a waiting rank
    checked the peers after a nap without looking at the flags again). Only the late ranks may
    fail the wait."""
    import time

    def body(rank: int, link):
        if rank == 0:
            link.shm._epoch += 1  # reach the barrier without waiting in it
            link.shm._words[0][shm._EPOCH] = link.shm._epoch
            link.transport.close(linger=0)
            return "left"
        if rank == 2:
            time.sleep(1.0)  # rank 0's goodbye reaches rank 1 while it waits for this one
        link.shm.barrier()
        return "passed"

    assert _ranks(3, 3, body, timeout=20.0) == ["left", "passed", "passed"]


def test_single_copy_only_when_ranks_do_not_outnumber_the_cpus(mode, monkeypatch):
    monkeypatch.setattr(shm, "_cpus", lambda: {0, 1})
    assert _ranks(2, 2, lambda rank, link: link.shm.single_copy) == [mode == "single-copy"] * 2
    assert _ranks(3, 3, lambda rank, link: link.shm.single_copy) == [False] * 3
    # What counts is the union of the ranks' affinities: two ranks bound to one CPU each...
    spread = itertools.count()
    monkeypatch.setattr(shm, "_cpus", lambda: {next(spread)})
    assert _ranks(2, 2, lambda rank, link: link.shm.single_copy) == [mode == "single-copy"] * 2
    # ...and two ranks bound to the same CPU.
    monkeypatch.setattr(shm, "_cpus", lambda: {3})
    assert _ranks(2, 2, lambda rank, link: link.shm.single_copy) == [False] * 2


def test_every_rank_agrees_on_the_mode(mode, monkeypatch):
    if mode == "single-copy":  # one rank's probe fails: all of them copy
        real, calls, lock = shm._read_from, [], threading.Lock()

        def first_fails(pid, addr, dst):
            with lock:
                calls.append(1)
                if len(calls) == 1:
                    return -1
            return real(pid, addr, dst)

        monkeypatch.setattr(shm, "_read_from", first_fails)
    assert _ranks(3, 3, lambda rank, link: link.shm.single_copy) == [False] * 3


def test_a_peer_whose_memory_cannot_be_read_fails_the_allreduce(mode, monkeypatch):
    if mode == "copy":
        pytest.skip("only the single-copy path reads peers' memory")
    real, victim = shm._read_from, {}
    monkeypatch.setattr(shm, "_read_from", lambda pid, addr, dst: (
        -3 if threading.current_thread() is victim.get("thread") else real(pid, addr, dst)))

    def body(rank: int, link):
        if rank == 1:
            victim["thread"] = threading.current_thread()  # its reads fail with ESRCH
            with pytest.raises(PeerError, match="could not read local rank 0's memory"):
                reduce(link, np.ones(10, np.float32), np.empty(10, np.float32),
                   ReduceOp.SUM)
            return "failed"
        with pytest.raises(RingflowTimeoutError, match=r"local ranks \[1\]"):
            reduce(link, np.ones(10, np.float32), np.empty(10, np.float32), ReduceOp.SUM)
        return "timed out"

    assert _ranks(2, 2, body, timeout=1.0) == ["timed out", "failed"]
