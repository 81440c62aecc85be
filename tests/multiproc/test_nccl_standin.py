"""The NCCL path, on CPU, through real processes: cupy's stand-in (tests/standins/cupy).

Every rank is a process started by ``ringflow.run`` and hands the core cupy arrays of the
stand-in, whose NCCL binding has the argument types of cupy's Cython code (cupy 13's tuple
unique id, cupy 14's bytes) and runs NCCL's semantics between the processes. So the whole host
side of the GPU path runs here: provider choice, the unique id through the store, one
communicator per process set, the shared-GPU check, every collective composed of NCCL's
primitives (:mod:`ringflow.algorithms.device`), the integer rule, and the handling of a peer that
dies inside an NCCL call. Each check is a closed form on every rank (rank r contributes r + 1).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ringflow.testing import run_commands, spawn_ranks

pytestmark = pytest.mark.timeout(240)

STANDINS = str(Path(__file__).resolve().parents[1] / "standins")
SIZES = [1, 2, 3, 4]


def _start(version: str, folder: str, devices: str = "own") -> tuple[int, int]:
    """init() with the stand-in on this rank: its own device (``own``) or device 0 for all."""
    import sys

    sys.path.insert(0, STANDINS)
    os.environ.update(CUPY_STANDIN_VERSION=version, CUPY_STANDIN_DEVICES="4",
                      CUPY_STANDIN_NCCL_DIR=folder, CUPY_STANDIN_NCCL_TIMEOUT="60")
    import cupy

    import ringflow as rf

    assert getattr(cupy, "STANDIN", False), cupy.__file__
    rank = int(os.environ["RINGFLOW_RANK"])
    cupy.cuda.Device(rank if devices == "own" else 0).use()
    rf.init()
    return rf.rank(), rf.size()


def _comms() -> dict:
    from ringflow import runtime

    nccl = runtime.running().backends.nccl
    return {} if nccl is None else dict(nccl._comms)


def every_collective_over_nccl(version: str, folder: str) -> list[str]:
    import ringflow as rf
    from ringflow.ops import scale_into

    r, n = _start(version, folder)
    import cupy as cp

    done = []
    total = n * (n + 1) // 2
    for length in sorted({0, 1, max(n - 1, 1), 100_003}):
        for dtype in (np.float32, np.int32, np.float16, np.float64, np.uint8):
            x = cp.full(length, r + 1, dtype)
            y = rf.allreduce(x, name=f"sum.{length}.{np.dtype(dtype).name}", op=rf.Sum)
            assert isinstance(y, cp.ndarray) and y.dtype == dtype and y.shape == (length,)
            np.testing.assert_array_equal(y.get(), np.full(length, total, dtype))
    assert tuple(range(n)) in _comms(), "the allreduces did not run over NCCL"
    done.append("sum")
    # Average with scale factors on integers: the host's integer rule (truncate, wrap)
    x = cp.asarray(np.arange(-5, 7, dtype=np.int32) * (r + 1) * 1000)
    y = rf.allreduce(x, name="int.avg", op=rf.Average, prescale_factor=3.0,
                     postscale_factor=0.7)
    host = np.arange(-5, 7, dtype=np.int32) * 1000
    pre = np.empty_like(host)
    want = sum(scale_into(host * (k + 1), 3.0, pre) or pre.copy() for k in range(n))
    scaled = np.empty_like(want)
    scale_into(want, 0.7 / n, scaled)
    np.testing.assert_array_equal(y.get(), scaled)
    # uint8 past its range: wrapped, as on the host
    y = rf.allreduce(cp.full(5, 200, np.uint8), name="u8", op=rf.Average, postscale_factor=2.0)
    want8 = np.empty(5, np.uint8)
    scale_into(np.full(5, (200 * n) % 256, np.uint8), 2.0 / n, want8)
    np.testing.assert_array_equal(y.get(), want8)
    done.append("scaled integers")
    # bool: Sum is or, Min is and
    y = rf.allreduce(cp.asarray(np.array([r == 0, True, False])), name="bool.or", op=rf.Sum)
    np.testing.assert_array_equal(y.get(), [True, True, False])
    y = rf.allreduce(cp.asarray(np.array([r == 0, True])), name="bool.and", op=rf.Min)
    np.testing.assert_array_equal(y.get(), [n == 1, True])
    # a fused group, fp16 on the wire, in place through out=
    xs = [cp.full(5, r + 1, np.float32), cp.full((2, 3), r + 1, np.float32),
          cp.zeros(0, np.float32)]
    ys = rf.grouped_allreduce(xs, name="group", op=rf.Sum, compression=rf.Compression.fp16)
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(y.get(), np.full(x.shape, total, np.float32))
    x = cp.full((2, 3), r + 1, np.float64)
    assert rf.allreduce(x, name="inplace", op=rf.Max, out=x) is x
    np.testing.assert_array_equal(x.get(), np.full((2, 3), n, np.float64))
    done.append("group, in place")
    # int16 has no NCCL dtype: staged, still exact
    y = rf.allreduce(cp.full(7, r + 1, np.int16), name="int16", op=rf.Sum)
    np.testing.assert_array_equal(y.get(), np.full(7, total, np.int16))
    # allgather: rank r contributes r + 1 rows of value r (ragged), and equal rows
    y = rf.allgather(cp.full((r + 1, 2), r, np.float32), name="gather.ragged")
    want = np.concatenate([np.full((k + 1, 2), k, np.float32) for k in range(n)])
    np.testing.assert_array_equal(y.get(), want)
    y = rf.allgather(cp.full((2, 3), r, np.int64), name="gather.even")
    np.testing.assert_array_equal(y.get(), np.repeat(np.arange(n), 6).reshape(2 * n, 3))
    done.append("allgather")
    # broadcast from the last rank, in place
    x = cp.full(6, r, np.float32)
    assert rf.broadcast(x, n - 1, name="bcast", out=x) is x
    np.testing.assert_array_equal(x.get(), np.full(6, n - 1, np.float32))
    done.append("broadcast")
    # alltoall: rank r sends d + 1 rows of value 10 r + d to rank d
    rows = cp.asarray(np.concatenate([np.full(d + 1, 10 * r + d, np.int32) for d in range(n)]))
    got, splits = rf.alltoall(rows, splits=[d + 1 for d in range(n)], name="a2a")
    assert isinstance(got, cp.ndarray) and list(splits) == [r + 1] * n
    np.testing.assert_array_equal(
        got.get(), np.concatenate([np.full(r + 1, 10 * s + r, np.int32) for s in range(n)]))
    done.append("alltoall")
    # reducescatter: n + 1 rows (ragged shares, lower ranks take the remainder), and n rows
    y = rf.reducescatter(cp.full((n + 1, 3), r + 1, np.float64), name="rs", op=rf.Sum)
    np.testing.assert_array_equal(y.get(), np.full((2 if r == 0 else 1, 3), total))
    y = rf.reducescatter(cp.full((n, 2), r + 1, np.float32), name="rs.avg", op=rf.Average)
    np.testing.assert_allclose(y.get(), np.full((1, 2), total / n))
    done.append("reducescatter")
    # rooted: reduce, gather (ragged)
    root = n - 1
    y = rf.reduce(cp.full(4, r + 1, np.float32), root, name="reduce", op=rf.Sum)
    if r == root:
        np.testing.assert_array_equal(y.get(), np.full(4, total, np.float32))
    y = rf.gather(cp.full((r + 1, 2), r, np.int32), root, name="gather")
    if r == root:
        np.testing.assert_array_equal(y.get(), np.concatenate(
            [np.full((k + 1, 2), k, np.int32) for k in range(n)]))
    done.append("rooted")
    # a process set of the even ranks gets its own communicator
    evens = rf.add_process_set(list(range(0, n, 2)))
    if evens.included():
        y = rf.allreduce(cp.full(3, r + 1, np.float32), name="evens", op=rf.Sum,
                         process_set=evens)
        np.testing.assert_array_equal(y.get(), np.full(3, sum(range(1, n + 1, 2))))
        assert tuple(range(0, n, 2)) in _comms()
    rf.remove_process_set(evens)
    done.append("process set")
    rf.shutdown()
    return done


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("version", ["14.2.0", "13.6.0"])
def test_every_collective_runs_over_nccl(n: int, version: str, tmp_path: Path) -> None:
    results = spawn_ranks(n, every_collective_over_nccl, args=(version, str(tmp_path)))
    assert all(res == results[0] for res in results), results
    assert results[0][-1] == "process set"


def shared_gpu(folder: str) -> tuple[bool, list[str]]:
    import logging

    import ringflow as rf

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("ringflow").addHandler(Keep(logging.WARNING))
    r, n = _start("14.2.0", folder, devices="shared")
    import cupy as cp

    y = rf.allreduce(cp.full(9, r + 1, np.float32), name="shared", op=rf.Sum)
    np.testing.assert_array_equal(y.get(), np.full(9, n * (n + 1) / 2, np.float32))
    y = rf.allgather(cp.full((1, 2), r, np.int32), name="shared.gather")
    np.testing.assert_array_equal(y.get(), np.repeat(np.arange(n), 2).reshape(n, 2))
    staged = _comms() == {tuple(range(n)): None}
    rf.shutdown()
    return staged, [s for s in seen if "share a GPU" in s]


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_share_a_gpu_are_staged_with_one_warning(n: int, tmp_path: Path) -> None:
    results = spawn_ranks(n, shared_gpu, args=(str(tmp_path),))
    assert all(staged for staged, _ in results), results
    warnings = [w for _, ws in results for w in ws]
    assert len(warnings) == 1, warnings
    assert f"ranks {' and '.join(map(str, range(n)))} share a GPU" in warnings[0]


def nccl_refuses_a_shared_gpu(folder: str) -> str:
    """Without the check, NCCL itself refuses (the failure users saw on a real GPU)."""
    import sys

    sys.path.insert(0, STANDINS)
    os.environ.update(CUPY_STANDIN_DEVICES="1", CUPY_STANDIN_NCCL_DIR=folder)
    from ringflow.algorithms.nccl import CupyNccl
    from ringflow.rendezvous.stores import FileStore

    rank = int(os.environ["RINGFLOW_RANK"])
    try:
        CupyNccl(rank, 2, FileStore(str(Path(folder) / "store")), "direct/", 0, 10.0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "created"


def test_the_stand_in_refuses_two_ranks_on_one_gpu_as_nccl_does(tmp_path: Path) -> None:
    results = spawn_ranks(2, nccl_refuses_a_shared_gpu, args=(str(tmp_path),))
    assert all("NCCL_ERROR_INVALID_USAGE" in r for r in results), results


def peer_dies_in_nccl(folder: str) -> None:
    import json
    import time

    import ringflow as rf

    # the last rank is killed as it starts the large allreduce's data plane: the others are
    # then inside NCCL, waiting for its contribution
    os.environ["RINGFLOW_FAULT"] = "rank=2,point=data_start,action=kill,size=100000"
    r, _ = _start("14.2.0", folder)
    import cupy as cp

    rf.allreduce(cp.ones(4, np.float32), name="warm", op=rf.Sum)
    start = time.monotonic()
    try:
        rf.allreduce(cp.ones(1 << 16, np.float32), name="after", op=rf.Sum)
        seen = "no error"
    except rf.RingflowError as exc:
        seen = f"{type(exc).__name__}: {exc}"
    Path(folder, f"{r}.json").write_text(json.dumps(
        {"elapsed": time.monotonic() - start, "error": seen}))
    time.sleep(30)  # the launcher stops this rank once it has seen rank n - 1 die


def test_a_peer_that_dies_inside_nccl_fails_the_others_within_seconds(tmp_path: Path) -> None:
    import json
    import time

    from ringflow.runner.pyrun import RankFailure

    with pytest.raises(RankFailure) as failure:
        spawn_ranks(3, peer_dies_in_nccl, args=(str(tmp_path),), deadline=60)
    assert "rank 2" in str(failure.value), failure.value
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert len({s["error"] for s in seen}) == 1, seen
    assert seen[0]["error"].startswith("PeerError") and "rank 2" in seen[0]["error"], seen
    assert all(s["elapsed"] < 5 for s in seen), seen


def test_check_build_marks_a_provider_usable_once_its_self_test_ran(tmp_path: Path) -> None:
    """With a GPU listed (a fake nvidia-smi) and the stand-in for cupy, ``--check-build`` runs a
    one-rank allreduce through each provider in a child process: cupy's runs (and is the one in
    use); torch's, a CPU build here, does not, and the line says why."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([STANDINS, root]), "CUPY_STANDIN_NCCL_DIR": str(tmp_path)}
    (proc,) = run_commands([[sys.executable, "-m", "ringflow.runner", "--check-build"]], env=env,
                           timeout=240, merge_stderr=False)
    lines = {line.split("(")[0].strip(): line for line in proc.stdout.splitlines()}
    cupy = lines["[X] NCCL via cupy"]
    assert "cupy 14.2.0, NCCL 2.28.9: a one-rank allreduce ran; in use" in cupy, proc.stdout
    torch_line = next(v for k, v in lines.items() if k.endswith("NCCL via torch"))
    assert torch_line.lstrip().startswith("[ ]") and "did not run" in torch_line, proc.stdout
