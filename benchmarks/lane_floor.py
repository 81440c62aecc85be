"""What a small allreduce could cost in Python on this host: the same-host lane's primitives alone,
against ringflow's engine, alternately in one run.

    python benchmarks/lane_floor.py [--np 2 4] [--rounds 3] [--iters 3000]

For each world size, alternates ``--rounds`` times between:

* ``floor``: ``N`` forked processes doing, in a loop, only what a lane operation must do -- copy
  4 KiB into a slot of a shared segment, take an ``flock``, mark the slot posted, commit when
  every slot is posted, release, poll (``sched_yield``) until committed, add the slots into an
  output, mark them read -- with no engine, no handle, no checks and no request;
* ``spin``: the same without the lock (each rank publishes a counter): not a safe protocol (a
  post could not be withdrawn), only how much the lock costs;
* ``ringflow``: ``ringflow-run -np N`` (its default placement) timing ``allreduce(x, name=...)``
  of the same 4 KiB on rank 0 after warm-up.

Prints the median over rounds of each job's p50 and the ratio ringflow / floor: what ringflow's
own Python costs beyond the lane's unavoidable work (section 13 of RESULTS.md).
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import statistics
import tempfile
import time

import engine_latency  # this directory's (a script's first path)
import numpy as np
import records

LINE, SLOT = 64, 4096  # a header line and 4 KiB of data per rank
_STATE, _BIT, _GEN, _READ = range(4)


def floor_rank(rank: int, n: int, path: str, iters: int, lock: bool) -> float:
    """One rank of the primitives-only lane: the p50 of one operation, in us."""
    with open(path, "r+b") as f:
        seg = mmap.mmap(f.fileno(), n * (LINE + SLOT))
    words = [memoryview(seg)[k * (LINE + SLOT):k * (LINE + SLOT) + LINE].cast("q")
             for k in range(n)]
    raw = np.frombuffer(seg, np.uint8)
    slots = [raw[k * (LINE + SLOT) + LINE:(k + 1) * (LINE + SLOT)].view(np.float32)
             for k in range(n)]
    mine = words[rank]
    fd = os.open(path, os.O_RDONLY)
    x = np.full(SLOT // 4, rank + 1, np.float32)
    out = np.empty_like(x)
    times = []
    for i in range(1, iters + 1):
        t0 = time.perf_counter()
        while any(w[_READ] < i - 1 for w in words):  # the others read my previous data
            os.sched_yield()
        slots[rank][:] = x
        if lock:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    os.sched_yield()
            mine[_BIT], mine[_STATE] = 7, 1
            if all(w[_STATE] == 1 and w[_BIT] == 7 for w in words):
                for w in words:
                    w[_GEN], w[_STATE] = i, 2
            fcntl.flock(fd, fcntl.LOCK_UN)
            while mine[_STATE] != 2:
                os.sched_yield()
        else:
            mine[_GEN] = i
            while any(w[_GEN] < i for w in words):
                os.sched_yield()
        np.add(slots[0], slots[1], out=out)
        for s in slots[2:]:
            np.add(out, s, out=out)
        mine[_READ], mine[_STATE] = i, 0
        times.append(time.perf_counter() - t0)
        if out[0] != n * (n + 1) / 2:
            raise AssertionError(f"rank {rank}: wrong sum {out[0]}")
    return float(np.percentile(np.array(times[iters // 10:]) * 1e6, 50))


def floor(n: int, iters: int, lock: bool) -> float:
    """Rank 0's p50 (us) of a primitives-only lane of ``n`` forked processes."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="lane-floor-") as seg:
        seg.truncate(n * (LINE + SLOT))
        seg.flush()
        read, write = os.pipe()
        pids = []
        for rank in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    p50 = floor_rank(rank, n, seg.name, iters, lock)
                    if rank == 0:
                        os.write(write, f"{p50}".encode())
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.close(write)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        result = os.read(read, 100)
        os.close(read)
        if any(codes):
            raise RuntimeError(f"a floor rank failed: exit codes {codes}")
        return float(result)


def engine(n: int, iters: int) -> float:
    """Rank 0's p50 (us) of a 4 KiB allreduce through ``ringflow-run -np n``: engine_latency's
    job (its same-host lane on, the default), without its step of many tensors."""
    job = engine_latency.run(True, n, argparse.Namespace(iters=iters, tensors=0, repeats=0))
    return float(np.percentile(np.array(job["lat"]) * 1e6, 50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3000)
    args = parser.parse_args()
    if min(args.np) < 2:
        parser.error("--np: the floor needs at least 2 ranks")
    print(f"4 KiB float32 allreduce, p50 us on rank 0, {os.cpu_count()} CPUs; medians of "
          f"{args.rounds} alternating jobs")
    print(f"{'ranks':<7}{'floor':>8}{'spin':>8}{'ringflow':>10}{'ringflow / floor':>18}")
    figures: dict[str, dict[str, float]] = {}
    for n in args.np:
        runs: dict[str, list[float]] = {"floor": [], "spin": [], "ringflow": []}
        for _ in range(args.rounds):
            runs["floor"].append(floor(n, args.iters, lock=True))
            runs["spin"].append(floor(n, args.iters, lock=False))
            runs["ringflow"].append(engine(n, args.iters))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{n:<7}{med['floor']:>8.1f}{med['spin']:>8.1f}{med['ringflow']:>10.1f}"
              f"{med['ringflow'] / med['floor']:>17.1f}x")
        figures[str(n)] = {f"{k}_us": float(v) for k, v in med.items()}
    # figures: per world size, the p50 us of the floor (with and without the lock) and ringflow's
    records.append("lane_floor", {"ranks": figures, "rounds": args.rounds})


if __name__ == "__main__":
    main()
