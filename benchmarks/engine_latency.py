"""Engine latency on this host: one small allreduce, and one step of many tensors.

    python benchmarks/engine_latency.py [--np 1 2 4] [--rounds 3] [--iters 2000] [--tensors 1000]

For each world size of ``--np`` (default 1, 2 and 4), starts ``ringflow-run -np N`` (its default
placement) alternately with the same-host lane on (the default) and off
(``RINGFLOW_LANE_WAIT_US=0``: small cached allreduces go through rank 0, the eager path),
``--rounds`` times each, and prints the medians of:

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
import records  # this directory's (a script's first path)

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


def run(lane: bool, n: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        env["RINGFLOW_LANE_WAIT_US"] = "500" if lane else "0"
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable, __file__,
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
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3,
                        help="jobs per configuration, alternating (medians are reported)")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.iters, args.tensors, args.repeats)
        return
    p = np.percentile
    print(f"ringflow engine on this host, {os.cpu_count()} CPUs, ringflow-run's default placement "
          f"(Horovod 0.28.1 reference: 1.1-1.4 ms per 4 KiB allreduce at 2 ranks); "
          f"{args.rounds} jobs per row, alternating; medians of the jobs' figures")
    print(f"{'ranks':<6}{'lane':<6}{'4 KiB allreduce us: p50':>24}{'p10':>8}{'p90':>8}"
          f"{f'step of {args.tensors} x 4 KiB ms':>30}{'ops on the lane':>17}")
    figures: dict[str, dict] = {}
    for n in args.np:
        rows: dict[bool, list] = {True: [], False: []}
        for _ in range(args.rounds):
            for lane in (True, False):
                res = run(lane, n, args)
                lat = np.array(res["lat"]) * 1e6
                step = np.array(res["steps"]) * 1e3
                rows[lane].append((p(lat, 50), p(lat, 10), p(lat, 90), p(step, 50),
                                   res["stats"]["lane"] / max(res["stats"]["tensors"], 1)))
        med = {lane: np.median(np.array(r), axis=0) for lane, r in rows.items()}
        for lane in (True, False):
            m = med[lane]
            print(f"{n:<6}{'on' if lane else 'off':<6}{m[0]:>24.1f}{m[1]:>8.1f}{m[2]:>8.1f}"
                  f"{m[3]:>30.1f}{m[4]:>16.0%}")
        print(f"{n:<6}ratio off/on: 4 KiB p50 {med[False][0] / med[True][0]:.2f}x, "
              f"step {med[False][3] / med[True][3]:.2f}x")
        figures[str(n)] = {("on" if lane else "off"): {
            "p50_us": float(med[lane][0]), "p10_us": float(med[lane][1]),
            "p90_us": float(med[lane][2]), "step_ms": float(med[lane][3])}
            for lane in (True, False)}
    # figures: per world size, the lane on and off: 4 KiB p50/p10/p90 and the step's time
    records.append("engine_latency", {"ranks": figures, "rounds": args.rounds})


if __name__ == "__main__":
    main()
