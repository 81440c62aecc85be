"""The README's performance table and the benchmarks page's, rendered from the records.

    python benchmarks/report.py            # rewrite both from benchmarks/records.jsonl
    python benchmarks/report.py --check    # exit 1 if either differs (tests/docs runs this)

Each row of :data:`ROWS` names the benchmark whose latest record (:mod:`records`) gives its
figure and how to put it in words; a row whose benchmark has no record is left out. The table
goes between the ``<!-- figures: ... -->`` markers of README.md and docs/benchmarks/index.md;
everything else in those pages is prose, which quotes no figure the table holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import records

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", ROOT / "docs" / "benchmarks" / "index.md")
BEGIN = "<!-- figures: rendered by benchmarks/report.py from benchmarks/records.jsonl -->"
END = "<!-- figures: end -->"
MIB64, KIB4, KIB64 = str(64 << 20), str(4 << 10), str(64 << 10)


@dataclass(frozen=True)
class Row:
    label: str
    benchmark: str
    figure: Callable[[dict[str, Any]], str]
    match: tuple[tuple[str, Any], ...] = ()


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _peers_large(f: dict[str, Any]) -> str:
    s = f["seconds"]
    rf = s["ringflow"][MIB64]
    return f"{_x(s['mpi4py'][MIB64], rf)} / {_x(s['gloo'][MIB64], rf)} faster"


def _peers_small(f: dict[str, Any]) -> str:
    s = f["seconds"]
    rf, mpi = s["ringflow"], s["mpi4py"]
    return (f"{_x(mpi[KIB4], rf[KIB4])} / {_x(mpi[KIB64], rf[KIB64])} (ringflow "
            f"{rf[KIB4] * 1e3:.3f} / {rf[KIB64] * 1e3:.3f} ms against "
            f"{mpi[KIB4] * 1e3:.3f} / {mpi[KIB64] * 1e3:.3f})")


def _lane(f: dict[str, Any]) -> str:
    ranks = sorted(f["ranks"], key=int)
    r = f["ranks"]
    ratios = " / ".join(_x(r[n]["off"]["p50_us"], r[n]["on"]["p50_us"]) for n in ranks)
    us = " / ".join(f"{r[n]['on']['p50_us']:.0f}" for n in ranks)
    return f"{ratios} faster ({us} us p50 at {' / '.join(ranks)} ranks)"


def _join(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _floor(f: dict[str, Any]) -> str:
    ranks = sorted(f["ranks"], key=int)
    ours = [f["ranks"][n]["ringflow_us"] for n in ranks]
    floor = [f["ranks"][n]["floor_us"] for n in ranks]
    ratios = _join([a / b for a, b in zip(ours, floor, strict=True)], ".1f")
    return (f"{ratios.replace(' /', 'x /')}x slower ({_join(ours, '.0f')} us against "
            f"{_join(floor, '.0f')}, at {' / '.join(ranks)} ranks)")


def _hosts(f: dict[str, Any]) -> str:
    hosts = [h for h in ("2", "4", "8") if h in f["hosts"]]
    ours = [f["hosts"][n]["ringflow"] for n in hosts]
    gloo = [f["hosts"][n]["gloo"] for n in hosts]
    ratios = _join([a / b for a, b in zip(ours, gloo, strict=True)], ".2f")
    return (f"{ratios.replace(' /', 'x /')}x at {' / '.join(hosts)} hosts ({_join(ours, '.2f')} "
            f"of the ring bound; gloo {_join(gloo, '.2f')})")


def _training(peer: str) -> Callable[[dict[str, Any]], str]:
    """The median of the per-round ratios to DDP on gloo, per model (MLP / CNN)."""
    def figure(f: dict[str, Any]) -> str:
        return " / ".join(f"{f['models'][m]['ratio'][peer]:.2f}x" for m in ("mlp", "cnn"))
    return figure


def _horovod_script(f: dict[str, Any]) -> str:
    return f"{f['models']['horovod_script']['ratio']['ringflow']:.2f}x"


def _autotune(f: dict[str, Any]) -> str:
    return (f"{f['chosen_vs_best']:.2f}x the grid's best of {f['grid_size']}, "
            f"{f['chosen_vs_defaults']:.2f}x the defaults (chose at step {f['settled']} "
            f"of {f['tune_steps']})")


def _casts(f: dict[str, Any]) -> str:
    c = f["float16"]
    return (f"{c['compress']:.2f}x / {c['decompress']:.2f}x the time of torch's own cast "
            "(compress / decompress)")


def _compression(f: dict[str, Any]) -> str:
    slow = f["100mbit"]["steps_per_s"]
    return (f"PowerSGD rank 4: {_x(slow['ringflow-powersgd'], slow['ringflow'])} uncompressed, "
            f"{_x(slow['ringflow-powersgd'], slow['ddp-fp16'])} DDP's fp16 hook")


def _auto_loopback(f: dict[str, Any]) -> str:
    loop = f["loopback"]
    return (f"{loop['round_ratio']['ringflow-auto']:.3f}x uncompressed (median of "
            f"{f['rounds']} paired rounds)")


def _elastic(f: dict[str, Any]) -> str:
    def peer(name: str) -> str:
        g = f[name]
        got = f"recovered {g['recovered']} of {g['runs']}"
        if not g["recovered"]:
            return got
        return (f"{got}, kill to step {g['kill_to_step_s']:.2f} s, saving every step "
                f"{g['save_cost']:.0%} of a step")

    return (f"ringflow {peer('ringflow')}; torchrun {peer('torchrun')}; torchrun --nnodes 2:3 "
            f"{peer('torchrun-nnodes')}")


def _elastic_join(f: dict[str, Any]) -> str:
    runs = [r["parts_s"] for r in f["runs"] if "parts_s" in r]
    ours = statistics.median(r["generation"] + r["sync"] for r in runs)
    script = statistics.median(r["build"] + r["step"] for r in runs)
    return (f"{f['join_s']:.2f} s median, {f['join_max_s']:.2f} s max ({f['joined']} of "
            f"{f['rounds']}; goal {f['goal_s']:.2f} s: 1 s + {f['state_bytes'] / 2**20:.0f} MiB "
            f"at {f['loopback_gbps']:.1f} Gbit/s); the new generation and `sync()` {ours:.2f} s, "
            f"the newcomer's script (its model and optimizer, built after `hvd.init()`, and its "
            f"first step) {script:.2f} s")


def _gpu(f: dict[str, Any]) -> str:
    a = f["allreduce_vs_torch_nccl"]
    return (f"{f['resnet50_vs_no_exchange']:.3f}x img/s; {a['4KiB']:.2f}x / {a['64MiB']:.2f}x "
            f"the time of torch's NCCL; gloo {f['gloo_over_ringflow_2_ranks_64MiB']:.2f}x "
            "ringflow's time")


def _gpu_calls(f: dict[str, Any]) -> str:
    ours = [f[k]["allreduce_ Sum"] / f[k]["torch all_reduce"] for k in ("4KiB", "64MiB")]
    return f"{ours[0]:.2f}x / {ours[1]:.2f}x the time of torch's NCCL"


ROWS = (
    Row("64 MiB allreduce, 2 ranks, ringflow vs mpi4py + Open MPI / vs gloo "
        "(`benchmarks/allreduce_peers.py --np 2`)", "allreduce_peers", _peers_large,
        (("np", 2),)),
    Row("4 KiB / 64 KiB allreduce, the same run, vs mpi4py", "allreduce_peers", _peers_small,
        (("np", 2),)),
    Row("4 KiB allreduce, same-host lane on vs off (`benchmarks/engine_latency.py`)",
        "engine_latency", _lane),
    Row("4 KiB allreduce, ringflow vs the lane's primitives alone in Python "
        "(`benchmarks/lane_floor.py`)", "lane_floor", _floor),
    Row("64 MiB allreduce over namespace hosts at 1 Gbit/s, ringflow vs gloo "
        "(`sudo python benchmarks/multihost.py`)", "multihost", _hosts),
    Row("25 M MLP / small CNN training, ringflow's DistributedOptimizer vs DDP on gloo, "
        "no thread setting in the script, each launcher's defaults "
        "(`benchmarks/torch_ddp_vs_ringflow.py --threads launcher`)", "torch_ddp_vs_ringflow",
        _training("ringflow"), (("threads", "launcher"), ("horovod_script", False))),
    Row("the same, DDP on backend `\"ringflow\"` vs DDP on gloo (the backend's name changed)",
        "torch_ddp_vs_ringflow", _training("ddp_ringflow"),
        (("threads", "launcher"), ("horovod_script", False))),
    Row("the ceiling of any synchronous exchange: no gradient exchange, the ranks kept in step by "
        "one 4-byte allreduce a step, vs DDP on gloo (`--threads launcher --peers ... lockstep`)",
        "torch_ddp_vs_ringflow", _training("lockstep"),
        (("threads", "launcher"), ("horovod_script", False), ("lockstep", True))),
    Row("25 M MLP / small CNN training, `torch.set_num_threads(1)` in the script "
        "(`--threads script`)", "torch_ddp_vs_ringflow", _training("ringflow"),
        (("threads", "script"), ("horovod_script", False))),
    Row("the ceiling of any synchronous exchange, the same (`--threads script --peers ... "
        "lockstep`)", "torch_ddp_vs_ringflow", _training("lockstep"),
        (("threads", "script"), ("horovod_script", False), ("lockstep", True))),
    Row("Horovod's `pytorch_synthetic_benchmark.py` (import changed) under ringflow-run vs "
        "DDP under torchrun (`--horovod-script`)", "torch_ddp_vs_ringflow", _horovod_script,
        (("horovod_script", True),)),
    Row("Autotune on the 25 M MLP, 2 ranks on loopback (`benchmarks/autotune_grid.py`)",
        "autotune_grid", _autotune, (("where", "loopback"),)),
    Row("Autotune, the same on 2 namespace hosts at 1 Gbit/s "
        "(`sudo python benchmarks/autotune_grid.py --hosts 2`)", "autotune_grid", _autotune,
        (("where", "2 hosts 1gbit"),)),
    Row("25 M MLP training, 2 namespace hosts at 100 Mbit/s, gradient compression "
        "(`sudo python benchmarks/compression.py`)", "compression", _compression,
        (("model", "mlp"), ("part", "speed"))),
    Row("The same, both ranks on one host (shared memory): `--compression auto` "
        "(`python benchmarks/compression.py --no-hosts`)", "compression", _auto_loopback,
        (("model", "mlp"), ("part", "loopback"))),
    Row("fp16 compression of a 100 MB torch gradient (`benchmarks/cast_cost.py`)", "cast_cost",
        _casts, (("framework", "torch"),)),
    Row("Elastic, 25 M MLP, 3 workers, one SIGKILLed mid-step: `ringflow-run --min-np 2` "
        "(`commit()` every step) vs `torchrun --standalone --max-restarts 3` and three torchrun "
        "agents `--nnodes 2:3` (a checkpoint every step) (`benchmarks/elastic_vs_torchrun.py`)",
        "elastic_vs_torchrun", _elastic,
        (("peers", ["ringflow", "torchrun", "torchrun-nnodes"]), ("model", "mlp"))),
    Row("Elastic, 25 M MLP: a third worker joins 2, from its request to the first step at size "
        "3 (parameters and momentum from its peers) (`benchmarks/elastic_join.py`)",
        "elastic_join", _elastic_join, (("model", "mlp"),)),
    Row("CUDA on one NVIDIA H200, 1 rank: synthetic ResNet-50 (batch 64) vs no exchange; "
        "`hvd.allreduce_` of 4 KiB / 64 MiB vs torch.distributed's NCCL; 64 MiB at 2 ranks "
        "sharing the GPU (staged) vs gloo (`benchmarks/gpu_check.py`)", "gpu_check", _gpu),
    Row("the same `hvd.allreduce_` in a process of its own (`benchmarks/gpu_call_cost.py`)",
        "gpu_call_cost", _gpu_calls),
)


def render(path: Path | None = None) -> str:
    """The table, its sources (date, commit, command of each record used) under it."""
    lines = ["| comparison | ratio |", "|---|---|"]
    used: dict[str, dict[str, Any]] = {}
    for row in ROWS:
        record = records.latest(row.benchmark, path, **dict(row.match))
        if record is None:
            continue
        try:
            lines.append(f"| {row.label} | {row.figure(record['figures'])} |")
        except (KeyError, TypeError, ZeroDivisionError):
            continue  # a record without that figure (a partial run): the row is left out
        used[record["command"] + record["date"]] = record
    lines.append("")
    lines.append("Sources (the latest record of each; history in benchmarks/RESULTS.md):")
    for r in sorted(used.values(), key=lambda r: r["date"]):
        lines.append(f"- `{r['command']}`, {r['date'][:16].replace('T', ' ')} UTC, commit "
                     f"{r['commit']}, {r['machine'].split(' (')[0]}")
    return "\n".join(lines) + "\n"


def _region(text: str) -> tuple[int, int]:
    start = text.index(BEGIN) + len(BEGIN) + 1
    return start, text.index(END, start)


def update(check: bool = False, path: Path | None = None) -> list[Path]:
    """Write the table into every page (``check``: only say which differ); the pages that
    differed."""
    table = render(path)
    stale = []
    for page in PAGES:
        text = page.read_text()
        start, end = _region(text)
        if text[start:end] != table:
            stale.append(page)
            if not check:
                page.write_text(text[:start] + table + text[end:])
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs")
    args = parser.parse_args()
    stale = update(check=args.check)
    for page in stale:
        print(f"{page.relative_to(ROOT)}: {'differs' if args.check else 'rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
