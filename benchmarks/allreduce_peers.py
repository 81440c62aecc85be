"""Allreduce bandwidth of ringflow against mpi4py/Open MPI and torch.distributed (gloo), in one run.

    python benchmarks/allreduce_peers.py                      # sizes 4 KiB..256 MiB, 2 and 4 ranks
    python benchmarks/allreduce_peers.py --np 2 --max-mib 64 --plot busbw.png

Every peer runs as real processes on this host, float32 SUM allreduce, the same sizes; each size is
timed op by op after a barrier and warm-up, and the median is reported. Columns follow nccl-tests:
``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n`` (what each rank's link must carry).
Each rank is pinned to its own slice of the CPUs when the ranks do not outnumber them (``mpirun
--bind-to core``, ``ringflow-run --bind-to core``, ``sched_setaffinity`` for gloo's processes);
otherwise nothing is pinned. Every peer runs with the ``GLIBC_TUNABLES`` that ``ringflow-run``
gives its workers (:data:`ringflow.runner.launch.MEMCPY_TUNABLE`). ``copy`` is how many
single-copy times of the buffer (np.copyto, measured by rank 0 of ringflow's job) one allreduce
takes: the memory-bandwidth floor to reason from. ringflow runs
through ``ringflow-run`` and the full engine (negotiation, fusion buffer, handles), not a bare
algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import records  # this directory's (a script's first path)

from ringflow.runner.launch import glibc_tunables
from ringflow.testing import free_port
from ringflow.topology import cpu_share

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
PEERS = ("ringflow", "mpi4py", "gloo")


def _iters(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iterations: many for small buffers, a few for large ones."""
    if nbytes <= 1 << 20:
        return 20, 200
    return 2, max(5, min(30, (256 << 20) // nbytes * 5))


def _timed(allreduce, barrier, sizes: list[int]) -> dict[str, float]:
    out = {}
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)  # zeros: repeated in-place sums stay finite
        warm, runs = _iters(nbytes)
        for _ in range(warm):
            allreduce(buf)
        times = []
        for _ in range(runs):
            barrier()
            t0 = time.perf_counter()
            allreduce(buf)
            times.append(time.perf_counter() - t0)
        out[str(nbytes)] = statistics.median(times)
    return out


def worker(peer: str, sizes: list[int], result: str) -> None:
    if peer == "ringflow":
        import ringflow as rf

        rf.init()
        rank = rf.rank()
        times = _timed(lambda b: rf.allreduce(b, name="bench", op=rf.Sum, out=b), rf.barrier,
                       sizes)
        rf.shutdown()
    elif peer == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        times = _timed(lambda b: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), comm.Barrier, sizes)
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        times = _timed(lambda b: dist.all_reduce(torch.from_numpy(b)), dist.barrier, sizes)
        dist.destroy_process_group()
    if rank == 0:
        if peer == "ringflow":  # the floor the report divides ringflow's times by
            times.update({f"copy {nbytes}": copy_floor(nbytes) for nbytes in sizes})
        with open(result, "w") as f:
            json.dump(times, f)


def run_peer(peer: str, n: int, sizes: list[int], timeout: float) -> dict[str, float] | None:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        me = [sys.executable, os.path.abspath(__file__), "--worker", peer, "--result", result,
              "--sizes", ",".join(map(str, sizes))]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # Every peer copies memory with the glibc tuning ringflow-run gives its workers, so the
        # ratios compare the algorithms, not the memcpy settings.
        env["GLIBC_TUNABLES"] = glibc_tunables(env)
        # Pinning, the same for every peer: one slice of the CPUs per rank when the ranks do not
        # outnumber them (Open MPI's own default at np <= 2), none otherwise.
        pin = n <= len(os.sched_getaffinity(0))
        if peer == "ringflow":
            bind = ["--bind-to", "core"] if pin else []
            procs = [subprocess.Popen([sys.executable, "-m", "ringflow.runner", "-np", str(n),
                                       *bind, *me], env=env, stdout=subprocess.DEVNULL)]
        elif peer == "mpi4py":
            bind = ["--bind-to", "core" if pin else "none"]
            procs = [subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe",
                                       *bind, "-np", str(n), *me], env=env,
                                      stdout=subprocess.DEVNULL)]
        else:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       WORLD_SIZE=str(n))
            procs = []
            for r in range(n):
                cpus = cpu_share(r, n, os.sched_getaffinity(0)) if pin else None
                procs.append(subprocess.Popen(
                    me, env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL,
                    preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if pin else None))
        try:
            codes = [p.wait(timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            print(f"  {peer} (np={n}) timed out after {timeout:.0f} s", file=sys.stderr)
            return None
        if any(codes) or not os.path.exists(result):
            print(f"  {peer} (np={n}) failed: exit codes {codes}", file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)


def copy_floor(nbytes: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return min(times)


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def report(n: int, sizes: list[int], results: dict[str, dict[str, float] | None]) -> list[str]:
    peers = [p for p in PEERS if results.get(p)]
    head = ["size"] + [f"{p} ms (busbw GB/s)" for p in peers]
    head += [f"ringflow / {p}" for p in peers if p != "ringflow"] + ["ringflow x copy"]
    lines = [f"### {n} ranks, float32 SUM allreduce, median", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for nbytes in sizes:
        row = [_fmt_size(nbytes)]
        for p in peers:
            t = results[p][str(nbytes)]
            busbw = nbytes / t * 2 * (n - 1) / n / 1e9
            row.append(f"{t * 1e3:.3f} ({busbw:.2f})")
        rf = results.get("ringflow")
        for p in peers:
            if p != "ringflow":
                ratio = results[p][str(nbytes)] / rf[str(nbytes)] if rf else float("nan")
                row.append(f"{ratio:.2f}x")
        row.append(f"{rf[str(nbytes)] / rf[f'copy {nbytes}']:.1f}" if rf else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("ratio > 1: ringflow is faster (peer time / ringflow time).")
    return lines


def plot(path: str, all_results: dict[int, dict[str, dict[str, float] | None]],
         sizes: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, results in all_results.items():
        for peer, times in results.items():
            if not times:
                continue
            bw = [s / times[str(s)] * 2 * (n - 1) / n / 1e9 for s in sizes]
            ax.plot(sizes, bw, marker="o", label=f"{peer}, {n} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_fmt_size(s) for s in sizes])
    ax.set_xlabel("buffer size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("float32 allreduce on one host")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes")
    ap.add_argument("--max-mib", type=int, default=256, help="largest buffer, MiB")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--plot", default="", help="write a PNG of busbw versus size here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per peer and size set")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, [int(s) for s in args.sizes.split(",")], args.result)
        return
    sizes = [s for s in SIZES if s <= args.max_mib << 20]
    everything = {}
    for n in args.np:
        results = {}
        for peer in args.peers:
            print(f"running {peer} with {n} ranks ...", file=sys.stderr, flush=True)
            results[peer] = run_peer(peer, n, sizes, args.timeout)
        everything[n] = results
        print("\n".join(report(n, sizes, results)), flush=True)
        print()
        # figures: np, and per peer the median seconds per size in bytes (None: it failed)
        records.append("allreduce_peers", {"np": n, "seconds": {
            peer: None if times is None else {str(s): times[str(s)] for s in sizes}
            for peer, times in results.items()}})
    if args.plot:
        plot(args.plot, everything, sizes)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
