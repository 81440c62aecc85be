"""One rank of a timed float32 allreduce that also counts the bytes on its host's link.

    ringflow-run ... python allreduce_worker.py --bytes S --iters K --interface IF --out DIR

Every rank contributes ``rank + 1`` in every element and checks that the result is
``n (n+1) / 2`` everywhere (exact in float32 for these sizes). Local rank 0 of each host reads the
host's link counters (``/sys/class/net/IF/statistics``; the worker runs inside the host's network
namespace, whose ``/sys`` that is) after the warm-up and after the last timed allreduce, behind
barriers, so the difference holds the ``K`` timed allreduces plus ``K + 1`` barriers of control
traffic and nothing of job start-up. Each rank writes ``DIR/rank<r>.json``:
``{rank, host, local_rank, times, ok, tx, rx}`` (``tx``/``rx`` per allreduce, local rank 0 only).

Shared by ``test_hierarchical_bytes.py`` and ``benchmarks/multihost.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import ringflow as rf


def _counters(interface: str) -> tuple[int, int]:
    base = f"/sys/class/net/{interface}/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--interface", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rf.init()
    rank, n = rf.rank(), rf.size()
    x = np.full(args.bytes // 4, rank + 1, np.float32)
    out = np.empty_like(x)
    for _ in range(args.warmup):
        rf.allreduce(x, name="x", op=rf.Sum, out=out)
    counting = rf.local_rank() == 0
    rf.barrier()
    before = _counters(args.interface) if counting else (0, 0)
    times = []
    for _ in range(args.iters):
        rf.barrier()
        t0 = time.perf_counter()
        rf.allreduce(x, name="x", op=rf.Sum, out=out)
        times.append(time.perf_counter() - t0)
    rf.barrier()
    after = _counters(args.interface) if counting else (0, 0)
    expected = n * (n + 1) / 2
    result = {
        "rank": rank, "host": os.environ.get("RINGFLOW_HOSTNAME", ""),
        "local_rank": rf.local_rank(), "times": times,
        "ok": bool(np.all(out == expected)), "first": float(out[0]), "last": float(out[-1]),
        "tx": (after[0] - before[0]) / max(args.iters, 1) if counting else None,
        "rx": (after[1] - before[1]) / max(args.iters, 1) if counting else None,
    }
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    rf.shutdown()


if __name__ == "__main__":
    main()
