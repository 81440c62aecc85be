"""Two commits of ringflow side by side, alternately, in one run: is the new one slower?

    python benchmarks/compare_commits.py OLD [NEW] [--rounds 3] [--skip-ddp]

Checks both commits out into temporary worktrees (``git worktree add --detach``; removed at the
end) and runs each measurement for OLD then NEW, then NEW then OLD, ... (ABBA) ``--rounds``
times, so that both see the same machine load (always OLD first once put a loaded host's 1.7x on
the newer commit alone: RESULTS.md §18). The measuring code is this file's (the same for both); only
``ringflow`` comes from the commit, through ``PYTHONPATH``. Measurements, each through
``ringflow-run`` on this host:

* ``4 KiB p50``: median latency of one cached 4 KiB float32 allreduce, 2 ranks, ``--bind-to
  core`` (as benchmarks/engine_latency.py);
* ``64 MiB @2`` / ``64 MiB @4``: median time of a 64 MiB float32 Sum allreduce at 2 and 4 ranks
  (shared memory on one host);
* ``cnn samples/s``: examples/pytorch_synthetic_benchmark.py --model cnn at 2 ranks (ringflow's
  DistributedOptimizer; higher is better), unless ``--skip-ddp``.

Prints each round's figures and the ratio NEW / OLD of the medians over rounds (for times, above
1 means NEW is slower; for samples/s, below 1 means NEW is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KIB4 = 1024


def worker(kind: str, out: str) -> None:
    """One rank of a measurement; rank 0 writes the figure (seconds, or samples/s)."""
    import ringflow as rf

    rf.init()
    if kind == "latency":
        x = np.ones(KIB4, np.float32)
        for _ in range(300):
            rf.allreduce(x, name="lat")
        times = []
        for _ in range(1500):
            t0 = time.perf_counter()
            rf.allreduce(x, name="lat")
            times.append(time.perf_counter() - t0)
    else:
        x = np.ones(16 * 1024 * 1024, np.float32)  # 64 MiB
        rf.allreduce(x, name="big", op=rf.Sum)
        times = []
        for _ in range(8):
            rf.barrier()
            t0 = time.perf_counter()
            rf.allreduce(x, name="big", op=rf.Sum)
            times.append(time.perf_counter() - t0)
    if rf.rank() == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    rf.shutdown()


def _launch(tree: Path, np_: int, argv: list[str], bind: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_),
           *(["--bind-to", "core"] if bind else []), sys.executable, *argv]
    proc = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed in {tree}:\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    return proc.stdout


def measure(tree: Path, what: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figure.json")
        if what == "4 KiB p50 ms":
            _launch(tree, 2, [__file__, "--worker", "latency", out], bind=True)
            return json.loads(Path(out).read_text()) * 1e3
        if what.startswith("64 MiB"):
            np_ = int(what.split("@")[1].split()[0])
            _launch(tree, np_, [__file__, "--worker", "big", out])
            return json.loads(Path(out).read_text()) * 1e3
    stdout = _launch(tree, 2, [str(tree / "examples" / "pytorch_synthetic_benchmark.py"),
                               "--model", "cnn", "--num-iters", "5", "--num-batches-per-iter",
                               "5", "--num-threads", "1", "--json"])
    for line in stdout.splitlines():
        text = line.split(":", 1)[1] if line.startswith("[0]:") else line
        if text.startswith("{"):
            return float(json.loads(text)["total"])
    raise RuntimeError(f"no JSON summary from the synthetic benchmark:\n{stdout[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", nargs="?")
    p.add_argument("new", nargs="?", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.old is None:
        p.error("the old commit is required")
    whats = ["4 KiB p50 ms", "64 MiB @2 ms", "64 MiB @4 ms"]
    if not args.skip_ddp:
        whats.append("cnn samples/s")
    tmp = Path(tempfile.mkdtemp(prefix="ringflow-compare-"))
    trees = {}
    try:
        for label in ("old", "new"):
            ref = getattr(args, label)
            sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.strip()
            trees[label] = (sha, tmp / label)
            subprocess.run(["git", "worktree", "add", "--detach", str(tmp / label), sha],
                           cwd=ROOT, check=True, capture_output=True)
        figures: dict[str, dict[str, list[float]]] = {w: {"old": [], "new": []} for w in whats}
        for rnd in range(args.rounds):
            for what in whats:
                for label in ("old", "new") if rnd % 2 == 0 else ("new", "old"):  # ABBA
                    value = measure(trees[label][1], what)
                    figures[what][label].append(value)
                    print(f"round {rnd + 1} {what:<16} {label} {trees[label][0]}: {value:.3f}",
                          flush=True)
        print(f"\n| measurement | old {trees['old'][0]} | new {trees['new'][0]} | new / old |")
        print("|---|---|---|---|")
        for what in whats:
            old = statistics.median(figures[what]["old"])
            new = statistics.median(figures[what]["new"])
            print(f"| {what} | {old:.3f} | {new:.3f} | {new / old:.3f} |")
    finally:
        for _, tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
