"""ringflow's DistributedOptimizer vs torch DistributedDataParallel (gloo, and ringflow's backend).

    python benchmarks/torch_ddp_vs_ringflow.py [--models mlp cnn] [--num-iters 5] [--ddp-rounds 3]

For each model, with the same model, batch, loop and 2 ranks x 1 thread on this host, it measures:

- ``single``: one process, no gradient exchange (the baseline);
- ``independent``: two single processes at once, no exchange (what the host allows at best);
- ``ringflow``: ``ringflow-run -np 2 examples/pytorch_synthetic_benchmark.py``;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, two processes started with
  ``torch.multiprocessing`` and a file store (no fixed port);
- ``ddp-ringflow``: the same DDP script with ``backend="ringflow"`` (torch.distributed's API on
  ringflow's engine, :mod:`ringflow.torch.process_group`), the only change.

The two DDP runs alternate (gloo, ringflow, gloo, ... ``--ddp-rounds`` times each; the medians
are reported, and each round's ratio), so that a change in the host's load hits both alike. It
prints total samples/s, the scaling efficiency ``total / (2 x single)`` of each, and the ratios
ringflow / DDP and DDP(ringflow) / DDP(gloo). The synthetic benchmark's models: ``mlp``
(25.2 M parameters, ~100 MB of float32 gradients per step) and ``cnn`` (0.4 M parameters).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch_synthetic_benchmark.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("pytorch_synthetic_benchmark", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        text = line.split(":", 1)[1] if line.startswith("[0]:") else line
        if text.startswith("{"):
            return json.loads(text)
    raise RuntimeError(f"no JSON summary in the benchmark output:\n{stdout[-3000:]}")


def _bench_args(args: argparse.Namespace, model: str) -> list[str]:
    return [str(EXAMPLE), "--model", model, "--batch-size", str(args.batch_size),
            "--num-iters", str(args.num_iters), "--num-batches-per-iter",
            str(args.num_batches_per_iter), "--num-threads", "1", "--json"]


def run_single(args: argparse.Namespace, model: str, copies: int = 1) -> float:
    procs = [subprocess.Popen([sys.executable, *_bench_args(args, model)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(copies)]
    total = 0.0
    for p in procs:
        out, err = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise RuntimeError(f"single-process benchmark failed:\n{err[-3000:]}")
        total += _summary(out)["total"]
    return total


def run_ringflow(args: argparse.Namespace, model: str) -> float:
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", sys.executable,
           *_bench_args(args, model)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        raise RuntimeError(f"ringflow benchmark failed:\n{tail}")
    return float(_summary(proc.stdout)["total"])


def _ddp_worker(rank: int, world: int, store: str, out_dir: str, model_name: str,
                batch_size: int, per_iter: int, iters: int, backend: str = "gloo") -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    if backend == "ringflow":
        sys.path.insert(0, str(ROOT))  # this checkout's ringflow, whatever is installed
        import ringflow.torch  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    bench = _example()
    torch.manual_seed(0)
    model = DistributedDataParallel(bench.build_model(model_name))
    held = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01 * world)}
    data, target = bench.synthetic_batch(model_name, batch_size)

    def step() -> None:
        held["optimizer"].zero_grad()
        F.cross_entropy(held["model"](data), target).backward()
        held["optimizer"].step()

    rates = bench.time_steps(step, batch_size, 3, per_iter, iters)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(float(np.mean(rates))))
    # DDP holds the process group: drop it so that destroy_process_group really ends gloo's
    # threads now, not during interpreter finalization (where gloo can abort the process).
    dist.barrier()
    del step, model
    held.clear()
    gc.collect()
    dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, model: str, backend: str = "gloo") -> float:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_ddp_worker, args=(2, store, tmp, model, args.batch_size,
                                    args.num_batches_per_iter, args.num_iters, backend),
                 nprocs=2)
        return sum(json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--ddp-rounds", type=int, default=3,
                        help="DDP on gloo and on ringflow, alternating, this many times each")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    for model in args.models:
        single = run_single(args, model)
        results = {
            "independent": run_single(args, model, copies=2),
            "ringflow": run_ringflow(args, model),
        }
        rounds: dict[str, list[float]] = {"gloo": [], "ringflow": []}
        for _ in range(args.ddp_rounds):
            for backend in rounds:
                rounds[backend].append(run_ddp(args, model, backend))
        results["ddp"] = statistics.median(rounds["gloo"])
        results["ddp-ringflow"] = statistics.median(rounds["ringflow"])
        print(f"\nmodel {model}, batch {args.batch_size} per rank, 2 ranks x 1 thread; "
              f"single process: {single:.1f} samples/s")
        print(f"{'mode':<12} {'samples/s':>10} {'efficiency':>11}")
        for mode, total in results.items():
            print(f"{mode:<12} {total:>10.1f} {total / (2 * single):>10.0%}")
        ratio = results["ringflow"] / results["ddp"]
        print(f"ringflow / DDP: {ratio:.2f}x", flush=True)
        per_round = [f"{o / g:.2f}" for g, o in zip(rounds["gloo"], rounds["ringflow"],
                                                       strict=True)]
        backend_ratio = results["ddp-ringflow"] / results["ddp"]
        print(f"DDP(ringflow) / DDP(gloo): {backend_ratio:.2f}x (medians of "
              f"{args.ddp_rounds}; per round {', '.join(per_round)})", flush=True)
        rows.append((model, single, results, ratio, backend_ratio))
    print("\n| model | single | DDP eff. | ringflow eff. | no-exchange eff. | ringflow/DDP "
          "| DDP on ringflow eff. | DDP ringflow/gloo |")
    print("|---|---|---|---|---|---|---|---|")
    for model, single, res, ratio, backend_ratio in rows:
        print(f"| {model} | {single:.0f}/s | {res['ddp'] / (2 * single):.0%} | "
              f"{res['ringflow'] / (2 * single):.0%} | {res['independent'] / (2 * single):.0%} "
              f"| {ratio:.2f}x | {res['ddp-ringflow'] / (2 * single):.0%} "
              f"| {backend_ratio:.2f}x |")


if __name__ == "__main__":
    main()
