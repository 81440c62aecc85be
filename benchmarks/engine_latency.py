"""Engine latency on 2 ranks of this host: one small allreduce, and one step of many tensors.

    python benchmarks/engine_latency.py [--iters 2000] [--tensors 1000] [--repeats 20]

Starts ``ringflow-run -np 2 --bind-to core`` once with fusion on (the default threshold) and once
with ``RINGFLOW_FUSION_THRESHOLD_BYTES=0``, and prints:

* the latency of one 4 KiB float32 allreduce through the engine (``allreduce(x, name=...)``
  measured end to end on rank 0, after warm-up, so the response cache is hot): median, p10, p90;
* the time of one step of 1,000 named 4 KiB tensors submitted with ``allreduce_async`` and then
  waited (median over ``--repeats`` steps after a warm-up step).

Reference (issue 3): Horovod 0.28.1 took 1.1-1.4 ms for one 4 KiB allreduce on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

KIB4 = 1024  # float32 elements in 4 KiB


def worker(out: str, iters: int, tensors: int, repeats: int) -> None:
    import ringflow as rf

    rf.init()
    x = np.ones(KIB4, np.float32)
    for _ in range(200):
        rf.allreduce(x, name="lat")
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rf.allreduce(x, name="lat")
        lat.append(time.perf_counter() - t0)
    xs = [np.full(KIB4, i, np.float32) for i in range(tensors)]
    steps = []
    for rep in range(repeats + 1):
        rf.barrier()
        t0 = time.perf_counter()
        handles = [rf.allreduce_async(t, name=f"step.{i}") for i, t in enumerate(xs)]
        for h in handles:
            h.wait()
        if rep:  # the first step negotiates every name; later ones hit the cache
            steps.append(time.perf_counter() - t0)
    stats = rf.stats()
    if rf.rank() == 0:
        with open(out, "w") as f:
            json.dump({"lat": lat, "steps": steps, "stats": stats}, f)
    rf.shutdown()


def run(fusion: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        env.pop("RINGFLOW_FUSION_THRESHOLD_BYTES", None)
        if not fusion:
            env["RINGFLOW_FUSION_THRESHOLD_BYTES"] = "0"
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", "--bind-to", args.bind_to,
               sys.executable, __file__,
               "--worker", out, "--iters", str(args.iters), "--tensors", str(args.tensors),
               "--repeats", str(args.repeats)]
        subprocess.run(cmd, env=env, check=True, timeout=600)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bind-to", choices=("core", "none"), default="core",
                        help="ringflow-run --bind-to (default core: one CPU per rank)")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.iters, args.tensors, args.repeats)
        return
    rows = []
    for fusion in (True, False):
        res = run(fusion, args)
        lat = np.array(res["lat"]) * 1e3
        step = np.array(res["steps"]) * 1e3
        rows.append((fusion, lat, step, res["stats"]))
    print(f"ringflow engine, 2 ranks on this host, {os.cpu_count()} CPUs "
          f"(Horovod 0.28.1 reference: 1.1-1.4 ms per 4 KiB allreduce)")
    print(f"{'fusion':<8}{'4 KiB allreduce ms: p50':>24}{'p10':>8}{'p90':>8}"
          f"{f'step of {args.tensors} x 4 KiB ms: p50':>34}{'p10':>8}{'p90':>8}"
          f"{'collectives':>13}")
    for fusion, lat, step, stats in rows:
        p = np.percentile
        print(f"{'on' if fusion else 'off':<8}{p(lat, 50):>24.3f}{p(lat, 10):>8.3f}"
              f"{p(lat, 90):>8.3f}{p(step, 50):>34.1f}{p(step, 10):>8.1f}{p(step, 90):>8.1f}"
              f"{stats['collectives']:>13}")


if __name__ == "__main__":
    main()
