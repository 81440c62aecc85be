"""Where a one-rank CUDA allreduce spends its time (issue 33's goal: within 2x of
torch.distributed's NCCL at 4 KiB and 64 MiB).

    python benchmarks/gpu_call_cost.py [--device cuda|cpu] [--profile] [--calls 2000]

One process, one rank. Prints, as JSON lines:

* ``hvd.allreduce_`` (in place, Sum) against ``dist.all_reduce`` (NCCL; gloo on CPU) of the same
  tensor, alternating rounds, microseconds per call (the device synchronised at the end of each
  round, so queued work is counted);
* the same for ``hvd.allreduce`` (a new output) and for Average (a scaled copy);
* with ``--profile``: cProfile's 25 most expensive functions (own time) over ``--calls``
  in-place 4 KiB calls (cProfile inflates Python calls; the list shows where, not how much);
* the cost of the CUDA calls the submission path makes (stream queries, an event's record and
  query), microseconds each.

On CUDA it appends a record (benchmarks/records.py; ``BENCH_RECORDS=$OUT/records.jsonl`` on a
lent machine brings it back): the medians, microseconds, per size and case.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import records  # this directory's (a script's first path)

# This checkout's ringflow, after PYTHONPATH's (another commit's, to compare) and an installed one.
sys.path.append(str(Path(__file__).resolve().parent.parent))


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _per_call(fn: Callable[[], Any], calls: int, device: str) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = args.device

    import torch
    import torch.distributed as dist

    import ringflow.torch as hvd

    hvd.init()
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    figures: dict[str, Any] = {"device": dev}
    for label, nbytes in (("4KiB", 4096), ("64MiB", 64 << 20)):
        t = torch.ones(nbytes // 4, device=dev)
        calls = args.calls if nbytes == 4096 else max(args.calls // 20, 10)
        cases = {
            "allreduce_ Sum": lambda t=t, n=label: hvd.allreduce_(t, name=f"a.{n}", op=hvd.Sum),
            "allreduce Sum": lambda t=t, n=label: hvd.allreduce(t, name=f"b.{n}", op=hvd.Sum),
            "allreduce_ Average": lambda t=t, n=label: hvd.allreduce_(t, name=f"c.{n}"),
            "torch all_reduce": lambda t=t: dist.all_reduce(t),
        }
        rounds: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for what, fn in cases.items():
                rounds[what].append(_per_call(fn, calls, dev))
        med = {k: statistics.median(v) for k, v in rounds.items()}
        base = med["torch all_reduce"]
        figures[label] = {k: round(v, 2) for k, v in med.items()}
        print(json.dumps({"size": label, "us": {k: round(v, 2) for k, v in med.items()},
                          "ratio_to_torch": {k: round(v / base, 2) for k, v in med.items()},
                          "rounds": rounds}), flush=True)
    if args.profile:
        t = torch.ones(1024, device=dev)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            hvd.allreduce_(t, name="a.4KiB", op=hvd.Sum)
        _sync(dev)
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
        print("profile (cProfile, own time per allreduce_ call, us; calls per allreduce_):")
        for (file, line, fn), (_, calls, own, _, _) in rows:
            print(f"  {own / args.calls * 1e6:7.2f}  x{calls // args.calls}  "
                  f"{Path(file).name}:{line}({fn})", flush=True)
    if dev == "cuda":
        x = torch.ones(1024, device=dev)
        probes = {
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(x.device),
            "torch.cuda.default_stream()": lambda: torch.cuda.default_stream(x.device),
            "Event() + record + query": lambda: _event(torch),
            "x.device": lambda: x.device,
            "x.is_contiguous()": lambda: x.is_contiguous(),
            "x.new_empty(1024)": lambda: x.new_empty((1024,)),
        }
        print(json.dumps({k: round(_per_call(fn, args.calls, dev), 3)
                          for k, fn in probes.items()}), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()
    if dev == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(0)
        records.append("gpu_call_cost", figures)


def _event(torch: Any) -> bool:
    event = torch.cuda.Event()
    event.record()
    return bool(event.query())


if __name__ == "__main__":
    main()
