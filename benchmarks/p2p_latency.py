"""Point-to-point round trips on 2 ranks of this host: ringflow's send/recv vs torch.distributed
(gloo), in one run.

    python benchmarks/p2p_latency.py [--iters 2000] [--big-iters 10] [--chunks 4]

One *round* is rank 0 -> rank 1 -> rank 0: rank 0 sends an array and receives it back, rank 1
receives it and sends it back (blocking calls, received into a preallocated array), timed on
rank 0 after warm-up. Sizes: 4 KiB and 64 MiB of float32. Printed: the median, p10 and p90 of
a round, and for 64 MiB the bandwidth ``2 * S / round``; for reference, the latency of one
4 KiB allreduce (named, cached) in the same ringflow job.

- ``ringflow``: ``ringflow-run -np 2`` (``ringflow.send`` / ``ringflow.recv``), once per chunk
  size in ``--chunks`` (MiB; ``ringflow.p2p.CHUNK_BYTES`` is the default);
- ``gloo``: ``torch.distributed.send`` / ``recv`` over gloo, two processes started with
  ``torch.multiprocessing`` and a file store (no fixed port).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SIZES = (("4KiB", 4096), ("64MiB", 64 << 20))


def rounds(send: Any, recv: Any, rank: int, nbytes: int, iters: int, warmup: int) -> list[float]:
    times = []
    for i in range(iters + warmup):
        t0 = time.perf_counter()
        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def ringflow_worker(out: str, iters: int, big_iters: int, chunk_mib: float) -> None:
    import ringflow as rf
    from ringflow.runtime import running

    rf.init()
    if chunk_mib:
        running().p2p._chunk = int(chunk_mib * (1 << 20))  # this benchmark's knob only
    r = rf.rank()
    result = {}
    for label, nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        buf = np.empty_like(x)
        n = iters if nbytes < (1 << 20) else big_iters
        result[label] = rounds(lambda x=x: rf.send(x, 1 - r), lambda b=buf: rf.recv(1 - r, out=b),
                               r, nbytes, n, 20 if n > 20 else 2)
    x = np.ones(1024, np.float32)  # reference: one 4 KiB allreduce on the same ranks
    result["allreduce4KiB"] = rounds(lambda: rf.allreduce(x, name="ref"), lambda: None, r, 4096,
                                     iters, 200)
    if r == 0:
        Path(out).write_text(json.dumps(result))
    rf.barrier()
    rf.shutdown()


def _gloo_rank(rank: int, store: str, out: str, iters: int, big_iters: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = {}
    for label, nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        buf = torch.empty_like(x)
        n = iters if nbytes < (1 << 20) else big_iters
        result[label] = rounds(lambda x=x: dist.send(x, 1 - rank),
                               lambda b=buf: dist.recv(b, 1 - rank), rank, nbytes, n,
                               20 if n > 20 else 2)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_ringflow(args: argparse.Namespace, chunk_mib: float) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, "-m", "ringflow.runner", "-np", "2", sys.executable,
                        __file__, "--worker", out, "--iters", str(args.iters), "--big-iters",
                        str(args.big_iters), "--chunk", str(chunk_mib)],
                       env=ENV, check=True, timeout=900)
        return json.loads(Path(out).read_text())  # type: ignore[no-any-return]


def run_gloo(args: argparse.Namespace) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_gloo_rank, args=(os.path.join(tmp, "store"), out, args.iters, args.big_iters),
                 nprocs=2, join=True)
        return json.loads(Path(out).read_text())  # type: ignore[no-any-return]


def describe(name: str, result: dict[str, list[float]]) -> dict[str, float]:
    row = {}
    for label, nbytes in SIZES:
        t = np.asarray(result[label]) * 1e3
        med = float(np.median(t))
        row[label] = med
        extra = f", {2 * nbytes / (med / 1e3) / 1e9:.2f} GB/s" if nbytes >= (1 << 20) else ""
        print(f"{name:>24} {label:>6}: round median {med:8.3f} ms  (p10 "
              f"{np.percentile(t, 10):.3f}, p90 {np.percentile(t, 90):.3f}){extra}", flush=True)
    if "allreduce4KiB" in result:
        t = np.asarray(result["allreduce4KiB"]) * 1e3
        print(f"{name:>24} (a 4 KiB allreduce: median {np.median(t):.3f} ms)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--big-iters", type=int, default=10)
    parser.add_argument("--chunks", type=float, nargs="*", default=[0.0],
                        help="chunk sizes in MiB to try (0: ringflow.p2p.CHUNK_BYTES)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        ringflow_worker(args.worker, args.iters, args.big_iters, args.chunk)
        return
    rows = {}
    for chunk in args.chunks:
        name = f"ringflow chunk {chunk:g} MiB" if chunk else "ringflow"
        rows[name] = describe(name, run_ringflow(args, chunk))
    if not args.no_gloo:
        gloo = describe("gloo", run_gloo(args))
        for name, row in rows.items():
            print(f"{name} / gloo: " + ", ".join(f"{label} {row[label] / gloo[label]:.2f}x"
                                                for label, _ in SIZES))


if __name__ == "__main__":
    main()
