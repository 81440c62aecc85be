"""ringflow's DistributedOptimizer vs torch DistributedDataParallel, as users run them.

    python benchmarks/torch_ddp_vs_ringflow.py [--models mlp cnn] [--threads script|launcher]
        [--rounds 3] [--peers ringflow ddp ddp-ringflow]
    python benchmarks/torch_ddp_vs_ringflow.py --horovod-script PATH/pytorch_synthetic_benchmark.py

The same model, batch and loop at 2 ranks on this host (``examples/pytorch_synthetic_benchmark.py``
builds the models; ``mlp``: 25.2 M parameters, ~100 MB of float32 gradients per step; ``cnn``:
0.4 M parameters):

- ``ringflow``: ``ringflow-run -np 2 python examples/pytorch_synthetic_benchmark.py``;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on gloo under
  ``torchrun --standalone --nproc-per-node 2`` (this file is the worker);
- ``ddp-ringflow``: the same DDP worker with ``backend="ringflow"`` (torch.distributed's API on
  ringflow's engine, :mod:`ringflow.torch.process_group`), the only change;
- ``independent`` (``--peers ... independent``): two single processes at once, no exchange, no
  launcher (on this VM it measured slower than DDP itself, 0.76x: not a ceiling here);
- ``lockstep`` (``--peers ... lockstep``): the DDP worker without DDP (no gradient exchange),
  its two ranks kept in step by one 1-element gloo allreduce after every backward pass: the
  cost of running in step, which no synchronous exchange avoids -- a ceiling for them all;
- ``single`` (``--single``): one process, no exchange, the baseline of the efficiency column.

Threads (``--threads``): ``script`` (default) calls ``torch.set_num_threads(1)`` in every script and
sets ``OMP_NUM_THREADS=1``, as the benchmark always did; ``launcher`` sets nothing, neither in
the script nor in the environment (the thread variables are removed from it), so each launcher's
defaults decide: torchrun's ``OMP_NUM_THREADS=1`` for several processes, ringflow-run's thread
rule (:mod:`ringflow.threads`) -- what an unchanged user script gets.

``--horovod-script PATH`` runs Horovod's own ``examples/pytorch/pytorch_synthetic_benchmark.py``
(not part of this repository: pass the path of a copy) under ``ringflow-run``, unchanged but for
``import horovod.torch as hvd`` -> ``import ringflow.torch as hvd`` (made in a copy in a scratch
directory at run time), against the DDP worker on the same model under torchrun, both with
launcher defaults. Its ``torchvision.models`` is ``benchmarks/shims/torchvision`` (a hand-written
ResNet-18, ``--resnet-width`` channels in its first stage), since no torchvision wheel matches
CPU torch 2.13; pass ``--model resnet18``-compatible arguments only.

Each round runs every peer once, the order reversed every other round (ABBA), so that a change
in the host's load hits all alike; the medians, min-max and every round's ratio to ``ddp`` are
printed. On a shared host compare ratios of one run, not figures of different runs.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import records

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch_synthetic_benchmark.py"
SHIMS = Path(__file__).resolve().parent / "shims"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
               "TF_NUM_INTEROP_THREADS")
HOROVOD_IMPORT = "import horovod.torch as hvd"
PEERS = ("ringflow", "ddp", "ddp-ringflow", "independent", "lockstep")


def _env(threads: str, extra_path: list[Path] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if threads == "script":
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [*map(str, extra_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


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


def _loop_args(args: argparse.Namespace) -> list[str]:
    return ["--batch-size", str(args.batch_size), "--num-iters", str(args.num_iters),
            "--num-batches-per-iter", str(args.num_batches_per_iter)]


def _run(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def run_single(args: argparse.Namespace, model: str, copies: int = 1) -> float:
    """``copies`` single processes at once (no exchange); their total samples/s."""
    cmd = [sys.executable, str(EXAMPLE), "--model", model, *_loop_args(args), "--json",
           "--num-threads", "1" if args.threads == "script" else "0"]
    env = _env(args.threads)
    if args.threads == "launcher":
        env["OMP_NUM_THREADS"] = "1"  # what either launcher gives each of its 2 processes
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for _ in range(copies)]
    total = 0.0
    for p in procs:
        out, err = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise RuntimeError(f"single-process benchmark failed:\n{err[-3000:]}")
        total += float(_summary(out)["total"])
    return total


def run_ringflow(args: argparse.Namespace, model: str) -> float:
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", *args.ringflow_flags,
           sys.executable, str(EXAMPLE), "--model", model, *_loop_args(args), "--json",
           "--num-threads", "1" if args.threads == "script" else "0"]
    return float(_summary(_run(cmd, _env(args.threads), args.timeout, "ringflow"))["total"])


def run_ddp(args: argparse.Namespace, model: str, backend: str = "gloo",
            extra_path: list[Path] = (), lockstep: bool = False) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--ddp-worker", "--model", model,
               "--backend", backend, "--out", tmp, *_loop_args(args)]
        if lockstep:
            cmd.append("--lockstep")
        if args.threads == "script":
            cmd.append("--set-threads")
        _run(cmd, _env(args.threads, extra_path), args.timeout, f"DDP on {backend}")
        return sum(json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2))


def run_horovod(args: argparse.Namespace, scratch: Path) -> float:
    """Horovod's script (import changed, in ``scratch``) under ringflow-run; total img/s."""
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", *args.ringflow_flags,
           sys.executable, str(scratch / "pytorch_synthetic_benchmark.py"), "--model", "resnet18",
           "--batch-size", str(args.batch_size), "--num-warmup-batches", "3",
           "--num-batches-per-iter", str(args.num_batches_per_iter),
           "--num-iters", str(args.num_iters)]
    out = _run(cmd, _env("launcher", [SHIMS]), args.timeout, "Horovod's synthetic benchmark")
    found = re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", out)
    if found is None:
        raise RuntimeError(f"no total in Horovod's benchmark output:\n{out[-3000:]}")
    return float(found.group(1))


def prepare_horovod(path: Path, scratch: Path) -> None:
    """Copy Horovod's script into ``scratch`` with its one import changed (nothing else)."""
    text = path.read_text()
    if text.count(HOROVOD_IMPORT) != 1:
        raise SystemExit(f"{path}: expected one line {HOROVOD_IMPORT!r} (Horovod's "
                         "examples/pytorch/pytorch_synthetic_benchmark.py)")
    (scratch / "pytorch_synthetic_benchmark.py").write_text(
        text.replace(HOROVOD_IMPORT, "import ringflow.torch as hvd"))


# the DDP worker (under torchrun) ---------------------------------------------------------------
def ddp_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    if args.backend == "ringflow":
        import ringflow.torch  # noqa: F401 - registers the backend
    if args.set_threads:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    bench = _example()
    torch.manual_seed(0)
    model = bench.build_model(args.model)
    if not args.lockstep:
        model = DistributedDataParallel(model)
    held = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01 * world)}
    data, target = bench.synthetic_batch(args.model, args.batch_size)
    tick = torch.zeros(1)

    def step() -> None:
        held["optimizer"].zero_grad()
        F.cross_entropy(held["model"](data), target).backward()
        if args.lockstep:
            dist.all_reduce(tick)
        held["optimizer"].step()

    rates = bench.time_steps(step, args.batch_size, 3, args.num_batches_per_iter, args.num_iters)
    Path(args.out, f"{rank}.json").write_text(json.dumps(float(np.mean(rates))))
    # DDP holds the process group: drop it so that destroy_process_group really ends gloo's
    # threads now, not during interpreter finalization (where gloo can abort the process).
    dist.barrier()
    del step, model
    held.clear()
    gc.collect()
    dist.destroy_process_group()


# the comparison -----------------------------------------------------------------------------
def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def compare(args: argparse.Namespace, label: str, runners: dict[str, Any],
            single: float | None) -> dict[str, Any]:
    """Alternate ``runners`` for ``args.rounds`` rounds; print and return the medians."""
    rounds: dict[str, list[float]] = {peer: [] for peer in runners}
    order = list(runners)
    for i in range(args.rounds):
        for peer in (order if i % 2 == 0 else order[::-1]):
            rounds[peer].append(runners[peer]())
            print(f"  round {i + 1} {peer}: {rounds[peer][-1]:.1f} samples/s", flush=True)
    medians = {peer: statistics.median(xs) for peer, xs in rounds.items()}
    print(f"\n{label}, batch {args.batch_size} per rank, 2 ranks, threads: {args.threads}"
          + (f"; single process: {single:.1f} samples/s" if single else ""))
    print(f"{'peer':<14} {'samples/s: median (min-max)':>30}"
          + (f" {'efficiency':>11}" if single else ""))
    for peer, xs in rounds.items():
        eff = f" {medians[peer] / (2 * single):>10.0%}" if single else ""
        print(f"{peer:<14} {_spread(xs):>30}{eff}")
    ratios: dict[str, list[float]] = {}
    if "ddp" in rounds:
        for peer in rounds:
            if peer == "ddp":
                continue
            per = [o / g for o, g in zip(rounds[peer], rounds["ddp"], strict=True)]
            ratios[peer] = per
            name = {"ringflow": "ringflow / DDP", "ddp-ringflow": "DDP(ringflow) / DDP(gloo)",
                    "independent": "no exchange / DDP"}.get(peer, f"{peer} / DDP")
            print(f"{name}: {statistics.median(per):.2f}x (median of {args.rounds} rounds; "
                  f"per round {', '.join(f'{r:.2f}' for r in per)})", flush=True)
    return {"label": label, "rounds": rounds, "medians": medians, "ratios": ratios,
            "single": single}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--set-threads", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--threads", choices=("script", "launcher"), default="script",
                        help="script: set_num_threads(1) in the scripts and OMP_NUM_THREADS=1; "
                        "launcher: nothing set, each launcher's defaults")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS[:3]))
    parser.add_argument("--single", action="store_true",
                        help="also measure one process without exchange (efficiency column)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--rounds", "--ddp-rounds", dest="rounds", type=int, default=3,
                        help="rounds of every peer, alternating")
    parser.add_argument("--ringflow-flags", default="",
                        help="extra ringflow-run flags, one string (e.g. '--autotune')")
    parser.add_argument("--horovod-script", type=Path,
                        help="Horovod's examples/pytorch/pytorch_synthetic_benchmark.py")
    parser.add_argument("--resnet-width", type=int, default=16,
                        help="first-stage channels of the shim's ResNet-18 (torchvision: 64)")
    parser.add_argument("--json", default="", help="also write every figure here")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args)
        return
    args.ringflow_flags = args.ringflow_flags.split()
    results = []
    if args.horovod_script is not None:
        args.threads = "launcher"  # Horovod's script sets no threads
        os.environ["BENCH_RESNET_WIDTH"] = str(args.resnet_width)
        scratch = Path(tempfile.mkdtemp(prefix="horovod-synthetic-"))
        try:
            prepare_horovod(args.horovod_script, scratch)
            runners = {"ringflow": lambda: run_horovod(args, scratch),
                       "ddp": lambda: run_ddp(args, "resnet18", extra_path=[SHIMS])}
            results.append(compare(args, f"Horovod's pytorch_synthetic_benchmark.py, ResNet-18 "
                                   f"(width {args.resnet_width}), 224x224", runners, None))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    else:
        for model in args.models:
            single = run_single(args, model) if args.single else None
            runners = {}
            for peer in args.peers:
                if peer == "ringflow":
                    runners[peer] = lambda m=model: run_ringflow(args, m)
                elif peer == "independent":
                    runners[peer] = lambda m=model: run_single(args, m, copies=2)
                elif peer == "lockstep":
                    runners[peer] = lambda m=model: run_ddp(args, m, lockstep=True)
                else:
                    backend = "ringflow" if peer == "ddp-ringflow" else "gloo"
                    runners[peer] = lambda m=model, b=backend: run_ddp(args, m, b)
            results.append(compare(args, f"model {model}", runners, single))
    print("\n| comparison | threads | ringflow / DDP (per round) |")
    print("|---|---|---|")
    for res in results:
        for peer, per in res["ratios"].items():
            print(f"| {res['label']}: {peer} | {args.threads} | {statistics.median(per):.2f}x "
                  f"({', '.join(f'{r:.2f}' for r in per)}) |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    # the record (benchmarks/records.py): per model (or "horovod_script"), each peer's median
    # samples/s and the median of its per-round ratios to DDP on gloo
    figures: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds,
                               "batch_size": args.batch_size, "models": {},
                               "horovod_script": args.horovod_script is not None,
                               "lockstep": "lockstep" in args.peers}
    for res, key in zip(results, ["horovod_script"] if args.horovod_script else args.models,
                        strict=True):
        figures["models"][key] = {
            **{peer.replace("-", "_"): m for peer, m in res["medians"].items()},
            "ratio": {peer.replace("-", "_"): statistics.median(per)
                      for peer, per in res["ratios"].items()}}
    records.append("torch_ddp_vs_ringflow", figures)


if __name__ == "__main__":
    main()
