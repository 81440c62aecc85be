"""How ringflow's cost grows with the world size, the buffer size and the number of tensors.

    python benchmarks/scaling.py                                  # 1-8 ranks, 4 KiB..64 MiB
    python benchmarks/scaling.py --np 1 2 4 --max-mib 16 --plots docs/scaling

One ``ringflow-run -np N`` job per world size on this host (ringflow-run's default placement:
ranks pinned one slice of the CPUs each when they do not outnumber them, else not pinned), each
measuring, on rank 0 after a barrier and warm-up:

* every buffer size (float32 SUM allreduce, ``out=`` in place, cached name): the median time of
  one operation and its bus bandwidth ``size / time * 2 (N-1) / N`` (what each rank's link or
  memory must carry, as nccl-tests reports it);
* steps of ``T`` named 4 KiB tensors (``allreduce_async`` for each, then wait for all), for each
  ``T`` of ``--tensors``: the median step time divided by ``T``, the engine's cost per tensor as
  the tensor count grows (fusion on, the default threshold).

Prints one table per measurement and, with ``--plots DIR``, writes ``DIR/time_per_op.png``,
``DIR/busbw.png`` and ``DIR/per_tensor.png``. Across hosts (namespace hosts on rate-limited
links) the sweep is ``sudo python benchmarks/multihost.py --hosts 2 3 4``.
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

KIB4 = 1024  # float32 elements in 4 KiB


def _iters(nbytes: int) -> int:
    return max(5, min(500, (256 << 20) // max(nbytes, 1) // 4))


def worker(out: str, sizes: list[int], tensors: list[int], repeats: int) -> None:
    import ringflow as rf

    rf.init()
    result: dict[str, dict[str, float]] = {"op": {}, "per_tensor": {}}
    for nbytes in sizes:
        buf = np.zeros(max(nbytes // 4, 1), np.float32)  # stays 0: no overflow in place
        iters = _iters(nbytes)
        for _ in range(min(iters, 20)):
            rf.allreduce(buf, name=f"s{nbytes}", op=rf.Sum, out=buf)
        rf.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            rf.allreduce(buf, name=f"s{nbytes}", op=rf.Sum, out=buf)
            times.append(time.perf_counter() - t0)
        result["op"][str(nbytes)] = statistics.median(times)
    for count in tensors:
        xs = [np.full(KIB4, i, np.float32) for i in range(count)]
        steps = []
        for rep in range(repeats + 1):
            rf.barrier()
            t0 = time.perf_counter()
            handles = [rf.allreduce_async(x, name=f"t{count}.{i}") for i, x in enumerate(xs)]
            for h in handles:
                h.wait()
            if rep:  # the first step negotiates every name; later ones hit the cache
                steps.append(time.perf_counter() - t0)
        result["per_tensor"][str(count)] = statistics.median(steps) / count
    if rf.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    rf.shutdown()


def run(n: int, args: argparse.Namespace) -> dict[str, dict[str, float]] | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(n), sys.executable,
               os.path.abspath(__file__), "--worker", out, "--sizes",
               ",".join(map(str, args.sizes)), "--tensor-counts",
               ",".join(map(str, args.tensors)), "--repeats", str(args.repeats)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout)
        if proc.returncode or not os.path.exists(out):
            print(f"  np={n} failed (exit {proc.returncode})", file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9 if n > 1 else float("nan")


def tables(results: dict[int, dict], sizes: list[int], tensors: list[int]) -> list[str]:
    ns = sorted(results)
    lines = ["### time per allreduce, ms (bus bandwidth GB/s)", "",
             "| size | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in ns) + " |",
             "|---|" + "---|" * len(ns)]
    for s in sizes:
        cells = []
        for n in ns:
            t = results[n]["op"][str(s)]
            bw = busbw(s, t, n)
            cells.append(f"{t * 1e3:.3f}" + ("" if n == 1 else f" ({bw:.2f})"))
        lines.append(f"| {_fmt(s)} | " + " | ".join(cells) + " |")
    lines += ["", "### engine time per 4 KiB tensor in a step of T tensors, us", "",
              "| T | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in ns) + " |",
              "|---|" + "---|" * len(ns)]
    for count in tensors:
        cells = [f"{results[n]['per_tensor'][str(count)] * 1e6:.1f}" for n in ns]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return lines


def plots(folder: str, results: dict[int, dict], sizes: list[int], tensors: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    ns = sorted(results)
    for name, ylabel, value, xs, xlabel in (
        ("time_per_op", "time per allreduce (ms)",
         lambda n, x: results[n]["op"][str(x)] * 1e3, sizes, "buffer size"),
        ("busbw", "bus bandwidth (GB/s)",
         lambda n, x: busbw(x, results[n]["op"][str(x)], n), sizes, "buffer size"),
        ("per_tensor", "engine time per tensor (us)",
         lambda n, x: results[n]["per_tensor"][str(x)] * 1e6, tensors,
         "4 KiB tensors per step"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n in ns:
            if name == "busbw" and n == 1:
                continue
            label = f"{n} rank{'s' if n > 1 else ''}"
            ax.plot(xs, [value(n, x) for x in xs], marker="o", label=label)
        ax.set_xscale("log", base=2 if xs is sizes else 10)
        if xs is sizes:
            ax.set_xticks(xs, [_fmt(s) for s in xs])
        if name != "busbw":
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"ringflow on one host ({os.cpu_count()} CPUs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, f"{name}.png"), dpi=120)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--tensor-counts", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--max-mib", type=int, default=64, help="largest buffer, MiB")
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per tensor count")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--plots", default="", help="write the PNG plots into this folder")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, [int(s) for s in args.sizes.split(",")],
               [int(t) for t in args.tensor_counts.split(",")], args.repeats)
        return 0
    args.sizes = [4 << 10]
    while args.sizes[-1] * 4 <= args.max_mib << 20:
        args.sizes.append(args.sizes[-1] * 4)
    results = {}
    for n in args.np:
        print(f"np={n} ...", file=sys.stderr, flush=True)
        got = run(n, args)
        if got is not None:
            results[n] = got
    if not results:
        return 1
    print(f"ringflow scaling, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs; command: python benchmarks/scaling.py {' '.join(sys.argv[1:])}")
    print("\n".join(tables(results, args.sizes, args.tensors)))
    if args.plots:
        plots(args.plots, results, args.sizes, args.tensors)
        print(f"plots in {args.plots}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
