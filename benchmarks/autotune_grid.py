"""The autotuner against a grid of fixed settings, on loopback or on namespace hosts.

    python benchmarks/autotune_grid.py                          # 2 ranks on this host
    sudo python benchmarks/autotune_grid.py --hosts 2 --rate 1gbit   # 2 namespace hosts
    python benchmarks/autotune_grid.py --compression fp16       # the tuner may compress

Trains ``examples/pytorch_synthetic_benchmark.py``'s model (default the 25 M-parameter MLP) with
a DistributedOptimizer at 2 ranks, three jobs per run:

1. **grid**: one job steps through :data:`GRID` (12 settings of bucket size, fusion threshold
   and chunk size; with ``--compression``, 4 more with it on) ``--passes`` times, round robin, so
   that every setting is measured in the same job at several times; a sample is one uncounted
   step and ``--steps`` counted ones, scored ``1 / median step time`` as the tuner scores;
   a setting's score is the median of its samples;
2. **autotune**: ``ringflow-run --autotune`` for ``--tune-steps`` steps (default 200): the step
   at which the tuner chose (from its log) and what it chose;
3. **A/B**: one job alternates the tuner's choice, the grid's best setting and the defaults
   (``--passes`` samples each, interleaved): the ratios that answer "at least 95% of the best of
   the grid" and "never below 0.98x the defaults".

Settings are applied the way the tuner applies its own (rank 0 sets the engine's values; they
reach the other ranks with the plans), by a driver that rank 0 installs in place of the tuner:
this file, run as ``--worker``. ``--hosts 2`` builds namespace hosts with sshd and ``tc``
rate-limited links (``tests/multihost/netns_cluster.py``; root needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import records

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch_synthetic_benchmark.py"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "multihost"))

MIB = 1 << 20
#: bucket_bytes x (fusion_threshold_bytes, chunk_bytes): 12 settings around the defaults.
GRID = [{"bucket_bytes": b, "fusion_threshold_bytes": f, "chunk_bytes": c}
        for b in (0, MIB, 4 * MIB, 25 * MIB)
        for f, c in ((128 * MIB, 0), (8 * MIB, 0), (128 * MIB, 4 * MIB))]


# the worker (every rank) ----------------------------------------------------------------------
class Driver:
    """Rank 0's stand-in for the tuner: the settings of ``schedule`` in turn, one sample each
    (one uncounted step, then ``steps`` timed), steps found at the tuner's marker."""

    def __init__(self, schedule: list[Any], steps: int) -> None:
        self.schedule, self.steps = schedule, steps
        self.samples: list[tuple[int, float]] = []  # (index into schedule, score)
        self.done = False
        self.marker: Any = None
        self._seen: set[Any] = set()
        self._last: float | None = None
        self._i, self._skip, self._times = 0, 1, []

    def planned(self, names: list[tuple[Any, int]]) -> Any:
        if self.done:
            return None
        if self.marker is None:
            for name, nbytes in names:
                if nbytes > 64 * 1024:
                    if name in self._seen:
                        self.marker = name
                        return self.schedule[0]  # on every rank from this plan on
                    self._seen.add(name)
            return None
        if not any(name == self.marker for name, _ in names):
            return None
        now = time.monotonic()
        last, self._last = self._last, now
        if last is None:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._times.append(now - last)
        if len(self._times) < self.steps:
            return None
        self.samples.append((self._i, 1.0 / statistics.median(self._times)))
        self._i += 1
        self._times, self._skip = [], 1
        if self._i == len(self.schedule):
            self.done = True
            return None
        return self.schedule[self._i]


def worker(args: argparse.Namespace) -> None:
    import importlib.util

    import torch
    import torch.nn.functional as F

    import ringflow.torch as hvd
    from ringflow import runtime

    spec = importlib.util.spec_from_file_location("bench", EXAMPLE)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = bench.build_model(args.model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data, target = bench.synthetic_batch(args.model, args.batch_size)
    engine = runtime.running()
    driver = None
    if args.schedule:
        plan = json.loads(Path(args.schedule).read_text())
        schedule = [dataclasses.replace(engine.params, **s) for s in plan["schedule"]]
        if hvd.rank() == 0:
            driver = Driver(schedule, plan["steps"])
            with engine._control():
                engine.seat.tuner = driver
    steps = 0
    while True:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
        steps += 1
        if args.schedule:
            # Every rank stops at the same step: rank 0 says when the schedule is over.
            over = driver is not None and driver.done
            if steps % 5 == 0 and hvd.allreduce(torch.tensor(float(over)), op=hvd.Sum,
                                                name="over").item():
                break
        elif steps >= args.tune_steps:
            break
    if hvd.rank() == 0:
        out = {"steps": steps, "params": dataclasses.asdict(engine.params)}
        if driver is not None:
            out["samples"] = driver.samples
        Path(args.out).write_text(json.dumps(out))
    hvd.shutdown()


# the runs -------------------------------------------------------------------------------------
def _ringflow(args: argparse.Namespace, cluster: Any, flags: list[str], worker_args: list[str],
              env: dict[str, str]) -> None:
    command = [sys.executable, __file__, "--worker", "--model", args.model, "--batch-size",
               str(args.batch_size), *worker_args]
    if cluster is None:
        cmd = [sys.executable, "-m", "ringflow.runner", "-np", "2", *flags, *command]
    else:
        import netns_cluster

        cmd = netns_cluster.ringflow_run(cluster, {0: 1, 1: 1}, *flags, *command)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                          cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"job failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-3000:]}")


def _scheduled(args: argparse.Namespace, cluster: Any, env: dict[str, str], tmp: Path,
               settings: list[dict], passes: int, tag: str) -> list[list[float]]:
    """Every setting ``passes`` times, round robin, in one job: each one's scores."""
    schedule = [s for _ in range(passes) for s in settings]
    plan, out = tmp / f"{tag}.json", tmp / f"{tag}-out.json"
    plan.write_text(json.dumps({"schedule": schedule, "steps": args.steps}))
    _ringflow(args, cluster, [], ["--schedule", str(plan), "--out", str(out)], env)
    scores: list[list[float]] = [[] for _ in settings]
    for i, score in json.loads(out.read_text())["samples"]:
        scores[i % len(settings)].append(score)
    return scores


def _label(s: dict) -> str:
    parts = [f"bucket {s['bucket_bytes'] / MIB:g}M",
             f"fusion {s['fusion_threshold_bytes'] / MIB:g}M",
             f"chunk {s['chunk_bytes'] / MIB:g}M" if s.get("chunk_bytes") else "chunk 1M"]
    if s.get("wire_compression", "none") != "none":
        parts.append(s["wire_compression"])
    return ", ".join(parts)


def run(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    from ringflow.autotune import Params
    from ringflow.config import Config

    defaults = dataclasses.asdict(Params.of(Config()))
    grid = [dict(g) for g in GRID]
    if args.compression != "none":
        grid += [{"bucket_bytes": b, "fusion_threshold_bytes": 128 * MIB, "chunk_bytes": 0,
                  "wire_compression": args.compression} for b in (0, MIB, 4 * MIB, 25 * MIB)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGFLOW_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="autotune-grid-") as tmpdir:
        tmp = Path(tmpdir)
        os.chmod(tmp, 0o755)
        t0 = time.monotonic()
        scores = _scheduled(args, cluster, env, tmp, grid, args.passes, "grid")
        medians = [statistics.median(s) for s in scores]
        best = max(range(len(grid)), key=lambda i: medians[i])
        print(f"grid ({time.monotonic() - t0:.0f} s), steps/s, median of {args.passes} samples:",
              flush=True)
        for s, m, xs in zip(grid, medians, scores, strict=True):
            print(f"  {_label(s):<40} {m:.3f} ({min(xs):.3f}-{max(xs):.3f})", flush=True)
        t0 = time.monotonic()
        log, out = tmp / "autotune.csv", tmp / "autotune-out.json"
        flags = ["--autotune", "--autotune-log-file", str(log)]
        if args.compression != "none":
            flags += ["--autotune-compression", args.compression]
        _ringflow(args, cluster, flags, ["--tune-steps", str(args.tune_steps), "--out", str(out)],
                  env)
        lines = log.read_text().splitlines()
        chosen_row = [line for line in lines if ",chosen," in line]
        settled = int(chosen_row[0].split(",")[0]) if chosen_row else None
        chosen = json.loads(out.read_text())["params"]
        print(f"autotune ({time.monotonic() - t0:.0f} s): "
              f"{'chose at step ' + str(settled) if settled else 'did not finish'} of "
              f"{args.tune_steps}: {_label(chosen)}", flush=True)
        t0 = time.monotonic()
        trio = [chosen, {**defaults, **grid[best]}, defaults]
        ab = _scheduled(args, cluster, env, tmp, trio, args.ab_passes, "ab")
        per_pass = list(zip(*ab, strict=True))
        vs_best = [c / b for c, b, _ in per_pass]
        vs_default = [c / d for c, _, d in per_pass]
        same = [name for name, other in (("defaults", defaults), ("the grid's best",
                                                                  {**defaults, **grid[best]}))
                if {**defaults, **other} == {**defaults, **chosen}]
        if same:
            print(f"(the choice is {' and '.join(same)}: that ratio is the A/B's own noise)")
        print(f"A/B ({time.monotonic() - t0:.0f} s, {args.ab_passes} interleaved samples each): "
              f"chosen / best of grid {statistics.median(vs_best):.3f} (per pass "
              f"{', '.join(f'{r:.2f}' for r in vs_best)}); chosen / defaults "
              f"{statistics.median(vs_default):.3f} (per pass "
              f"{', '.join(f'{r:.2f}' for r in vs_default)})", flush=True)
        result = {"grid": [{"setting": s, "scores": xs} for s, xs in zip(grid, scores,
                                                                         strict=True)],
                  "best": grid[best], "settled": settled, "chosen": chosen,
                  "autotune_log": lines, "ab": ab, "chosen_vs_best": statistics.median(vs_best),
                  "chosen_vs_defaults": statistics.median(vs_default)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per sample")
    ap.add_argument("--passes", type=int, default=3, help="samples of each grid setting")
    ap.add_argument("--ab-passes", type=int, default=5, help="samples of each A/B side")
    ap.add_argument("--tune-steps", type=int, default=200)
    ap.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                    help="let the tuner compress, and add settings with it to the grid")
    ap.add_argument("--hosts", type=int, choices=(0, 2), default=0,
                    help="0: loopback (this host); 2: two namespace hosts (root)")
    ap.add_argument("--rate", default="1gbit", help="link rate of each namespace host (tc)")
    ap.add_argument("--json", default="")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    where = "loopback, 2 ranks" if not args.hosts else f"2 namespace hosts at {args.rate}"
    print(f"autotune against the grid: {args.model}, batch {args.batch_size}, {where}",
          flush=True)
    if not args.hosts:
        result = run(args, None)
    else:
        import netns_cluster

        reason = netns_cluster.unavailable()
        if reason is not None:
            print(f"skipped: namespace hosts cannot be built here: {reason}", file=sys.stderr)
            return
        with netns_cluster.cluster(2) as c, netns_cluster.shaped(c, args.rate):
            result = run(args, c)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    records.append("autotune_grid", {
        "model": args.model, "where": "loopback" if not args.hosts else f"2 hosts {args.rate}",
        "compression": args.compression, "grid_size": len(result["grid"]),
        "tune_steps": args.tune_steps, "settled": result["settled"],
        "chosen_vs_best": result["chosen_vs_best"],
        "chosen_vs_defaults": result["chosen_vs_defaults"]})


if __name__ == "__main__":
    main()
