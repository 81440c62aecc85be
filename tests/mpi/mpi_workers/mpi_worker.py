"""One scenario of tests/mpi/test_mpi_transport.py, run by every rank under ``mpirun``.

Usage: ``mpirun -np N python mpi_worker.py SCENARIO OUTDIR``. Each rank checks its results in
closed form (the formulas of tests/inproc/test_algorithms.py), then writes ``OUTDIR/<rank>.json``
with what it saw (transport, digests of every result for the bitwise comparison across ranks,
errors as class and text); the test compares the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "inproc"))

# The closed forms are the algorithm tests' own, so that both suites check the same formulas.
import test_algorithms as closed

import ringflow as rf
from ringflow.algorithms import even_split


def transport_name() -> str:
    return type(rf.runtime.running().transport).__name__


def suite(ps: rf.ProcessSet, tag: str, big: int) -> dict[str, str]:
    """Every collective x op x dtype x length {0, 1, m-1, big odd} over ``ps``; returns digests.

    Checked in closed form here; the digests let the test compare the bits across ranks.
    """
    m, q = ps.size(), ps.rank()
    digests: dict[str, str] = {}

    def record(what: str, arrays: list[np.ndarray]) -> None:
        h = hashlib.sha256()
        for a in arrays:
            h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
        digests[what] = h.hexdigest()

    for dtype in closed.ALL_DTYPES:
        lengths = closed.lengths(m, big)
        # allreduce, one tensor at a time (the unfused path) ...
        got = []
        for length in lengths:
            for op in closed.ops_for(dtype):
                x = closed.contribution(q, m, length, dtype, op)
                r = rf.allreduce(x, name=f"{tag}.ar.{dtype}.{op.name}.{length}", op=op,
                                 process_set=ps)
                closed.check_reduced(r, closed.expected(m, length, dtype, op), dtype,
                                     f"allreduce {op.name} m={m} {length} {dtype}")
                got.append(r)
        record(f"allreduce.{dtype}", got)
        # ... and all lengths of one op at once (fused into one buffer)
        for op in closed.ops_for(dtype):
            xs = [closed.contribution(q, m, length, dtype, op) for length in lengths]
            rs = rf.grouped_allreduce(xs, name=f"{tag}.gar.{dtype}.{op.name}", op=op,
                                      process_set=ps)
            for length, r in zip(lengths, rs, strict=True):
                closed.check_reduced(r, closed.expected(m, length, dtype, op), dtype,
                                     f"grouped allreduce {op.name} m={m} {length} {dtype}")
            record(f"grouped_allreduce.{dtype}.{op.name}", rs)
        # allgather: odd ranks of the set have half as many rows
        got = []
        for length in closed.lengths(m, big // 3):
            counts = [length if p % 2 == 0 else length // 2 for p in range(m)]
            r = rf.allgather(closed.block(q, counts[q], dtype), name=f"{tag}.ag.{dtype}.{length}",
                             process_set=ps)
            want = np.concatenate([closed.block(p, counts[p], dtype) for p in range(m)])
            np.testing.assert_array_equal(r, want, err_msg=f"allgather {counts} {dtype}")
            got.append(r)
        record(f"allgather.{dtype}", got)
        # broadcast from a root that moves with the length
        got = []
        for length in lengths:
            root = (length + 1) % m
            x = closed.block(root, length, dtype, 1).reshape(-1)
            if q != root:
                x[...] = 0
            glob = (ps.ranks or range(rf.size()))[root]  # root_rank is a global rank
            r = rf.broadcast(x, glob, name=f"{tag}.bc.{dtype}.{length}", process_set=ps)
            np.testing.assert_array_equal(r, closed.block(root, length, dtype, 1).reshape(-1))
            got.append(r)
        record(f"broadcast.{dtype}", got)
        # alltoall with uneven splits (zeros included)
        for scale in closed.lengths(m, 301):
            splits = closed.a2a_splits(q, m, scale)
            rows = np.concatenate([closed.a2a_rows(q, d, splits[d], dtype) for d in range(m)])
            r, rsplits = rf.alltoall(rows, splits, name=f"{tag}.a2a.{dtype}.{scale}",
                                     process_set=ps)
            want_splits = [closed.a2a_splits(p, m, scale)[q] for p in range(m)]
            assert list(rsplits) == want_splits, (rsplits, want_splits)
            want = np.concatenate([closed.a2a_rows(p, q, want_splits[p], dtype)
                                   for p in range(m)])
            np.testing.assert_array_equal(r, want, err_msg=f"alltoall {scale} {dtype}")
        # reducescatter: this rank's rows of the reduction
        for rows in closed.lengths(m, 1001):
            for op in closed.ops_for(dtype):
                x = closed.contribution(q, m, rows * 2, dtype, op).reshape(rows, 2)
                r = rf.reducescatter(x, name=f"{tag}.rs.{dtype}.{op.name}.{rows}", op=op,
                                     process_set=ps)
                lo, hi = even_split(rows, m)[q]
                full = closed.expected(m, rows * 2, dtype, op).reshape(rows, 2)
                closed.check_reduced(r, full[lo:hi], dtype,
                                     f"reducescatter {op.name} m={m} rows={rows} {dtype}")
    rf.barrier(process_set=ps)
    return digests


def error_of(fn: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
    try:
        fn(*args, **kwargs)
    except rf.RingflowError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    return {"type": "none", "text": ""}


def run(scenario: str, out: Path) -> dict[str, Any]:
    if scenario == "thread_serialized":
        import mpi4py

        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    res: dict[str, Any] = {"rank": world.Get_rank()}
    if scenario == "suite":
        rf.init()
        n = rf.size()
        res["transport"] = transport_name()
        res["global"] = suite(rf.global_process_set, "g", closed.BIG)
        # A process set of every rank but 1 (n=2: both): the ring over MPI point-to-point.
        ps = rf.add_process_set([r for r in range(n) if r != 1 or n == 2])
        if ps.included():
            res["subset"] = suite(ps, "s", 3001)
            res["subset_ranks"] = ps.ranks
        res["after"] = float(rf.allreduce(np.full(3, rf.rank() + 1.0), name="after",
                                          op=rf.Sum)[0])
    elif scenario == "comm":
        sub = world.Split(world.Get_rank() % 2, world.Get_rank())
        rf.init(comm=sub)
        res.update(size=rf.size(), sub_rank=rf.rank(), local_size=rf.local_size(),
                   cross_size=rf.cross_size(), transport=transport_name())
        # The application's own MPI traffic on the parent communicator, between ringflow ops.
        res["world_sum"] = world.allreduce(world.Get_rank() + 1)
        res["global"] = suite(rf.global_process_set, "c", 1001)
        res["world_max"] = world.allreduce(world.Get_rank(), op=MPI.MAX)
        got = rf.allreduce(np.full(5, rf.rank() + 1, np.int64), name="c.sum", op=rf.Sum)
        res["sum"] = int(got[0])
    elif scenario == "gil":
        # mpi4py's pickled collectives hold the GIL while they wait: rank 0, which serves the
        # store from a thread, must not leave init() (and enter one) before every rank has had
        # its store answers. The other ranks' store requests come late to make that likely.
        if world.Get_rank():
            from ringflow.rendezvous import TCPStore

            ask = TCPStore._call

            def late(*args: Any, **kwargs: Any) -> bytes:
                time.sleep(0.2)
                return ask(*args, **kwargs)

            TCPStore._call = late  # type: ignore[method-assign]
        rf.init()
        res["world_sum"] = world.allreduce(world.Get_rank() + 1)
        res["sum"] = float(rf.allreduce(np.full(3, rf.rank() + 1.0), name="g", op=rf.Sum)[0])
    elif scenario == "errors":
        rf.init()
        r, n = rf.rank(), rf.size()
        res["transport"] = transport_name()
        shape = (3,) if r == n - 1 else (2,)
        res["mismatch"] = error_of(rf.allreduce, np.ones(shape), name="bad", op=rf.Sum)
        res["after"] = float(rf.allreduce(np.full(2, r + 1.0), name="ok", op=rf.Sum)[0])
        if r == n - 1:
            rf.shutdown()  # a goodbye: its peers' ops that need it fail, nothing hangs
        else:
            time.sleep(1.0)
            res["departed"] = error_of(rf.allreduce, np.ones(4), name="needs_last", op=rf.Sum)
    elif scenario == "thread_serialized":
        res["thread_level"] = MPI.Query_thread()
        res["init"] = error_of(rf.init)
        world.Barrier()  # no rank leaves (closing rank 0's store) before every rank has tried
        if rf.is_initialized():
            res["transport"] = transport_name()
            res["sum"] = float(rf.allreduce(np.full(2, rf.rank() + 1.0), name="x",
                                            op=rf.Sum)[0])
    elif scenario == "die":
        rf.init()
        r, n = rf.rank(), rf.size()
        rf.allreduce(np.ones(4), name="first", op=rf.Sum)
        (out / f"{r}.started").write_text("1")
        if r == n - 1:
            os._exit(3)
        for i in range(600):  # the runtime kills this rank; it must never finish
            rf.allreduce(np.ones(4), name=f"loop.{i}", op=rf.Sum)
            time.sleep(0.05)
        res["finished"] = True
    elif scenario == "frozen":
        rf.init()
        r, n = rf.rank(), rf.size()
        rf.allreduce(np.ones(4), name="first", op=rf.Sum)
        if r == n - 1:
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no heartbeat, no data
            os._exit(0)  # resumed by the runtime only to be killed: report nothing
        start = time.monotonic()
        res["frozen"] = error_of(rf.allreduce, np.ones(4), name="needs_frozen", op=rf.Sum)
        res["seconds"] = time.monotonic() - start
        (out / f"{r}.json").write_text(json.dumps(res))
        # The frozen rank never reaches MPI_Finalize: end the job the MPI way.
        time.sleep(0.5)
        world.Abort(7)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return res


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    try:
        res = run(scenario, out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)  # an exception on one rank ends the job, never a hang
        raise
    (out / f"{res['rank']}.json").write_text(json.dumps(res))
    rf.shutdown()


if __name__ == "__main__":
    main()
