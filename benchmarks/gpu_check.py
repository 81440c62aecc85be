"""Everything a lent GPU should show, in one run of under five minutes (issue 33).

    python benchmarks/gpu_check.py [--out RECORD.json]        # on a machine with a GPU
    python benchmarks/gpu_check.py --device cpu --quick       # the same steps on CPU (rehearsal)

Steps, each timed and bounded; a failing step is reported and the rest still run:

1. the environment: Python, torch (CUDA, its NCCL), cupy (its NCCL), ``nvidia-smi -L``, the commit;
2. ``ringflow-run --check-build`` (each NCCL provider's one-rank self-test);
3. ``pytest tests/gpu``;
4. training on CUDA through ``DistributedOptimizer`` at 1 rank and at 2 ranks on the one GPU
   (which the engine stages through host memory), each against one process replaying the
   global batches: the largest parameter difference;
5. ``DistributedDataParallel(model.cuda(), device_ids=[0])`` on backend ``"ringflow"`` at 1 and
   2 ranks, against the same replay;
6. a Horovod-style synthetic ResNet-50 (batch 64) at 1 rank: ``DistributedOptimizer`` against
   the plain optimizer (no exchange), alternating rounds in one process, img/s ratio;
7. a 1-rank ``hvd.allreduce_`` of 4 KiB and 64 MiB against torch.distributed's own NCCL in the
   same process, alternating: microseconds per operation, ratio;
8. a 64 MiB allreduce at 2 ranks on the one GPU: ringflow (staged) against torch's gloo with
   CUDA tensors, alternating in the same job: milliseconds, ratio.

It ends with one line, ``GPU CHECK: ...``, the figures the issue's goals name. ``--out`` writes
the whole record as JSON (command, commit, date, machine, figures). With ``--device cpu`` the
same code runs on CPU tensors (NCCL's comparisons are skipped): run it before spending GPU time.
On CUDA it also appends a record (benchmarks/records.py) of those figures: on a lent machine,
``BENCH_RECORDS=$OUT/records.jsonl`` brings it back to append here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import records  # this directory's (a script's first path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


# --- the models ---------------------------------------------------------------------------------


def resnet50() -> Any:
    """torchvision's ResNet-50 where installed, else the same architecture written here
    (bottleneck blocks [3, 4, 6, 3], 25.6 M parameters)."""
    try:
        from torchvision.models import resnet50 as tv

        return tv()
    except Exception:  # no torchvision (or one that does not match this torch)
        pass
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inp: int, width: int, stride: int) -> None:
            super().__init__()
            out = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(True), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
            self.skip = (nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False),
                                       nn.BatchNorm2d(out))
                         if stride != 1 or inp != out else nn.Identity())

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.skip(x)).relu()

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(True), nn.MaxPool2d(3, 2, 1)]
    inp = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(inp, width, stride if b == 0 else 1))
            inp = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, 1000)]
    return nn.Sequential(*layers)


def mlp() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _batches(steps: int, global_batch: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(global_batch, 32, generator=g), torch.randint(0, 10, (global_batch,),
                                                                        generator=g))
            for _ in range(steps)]


STEPS, GLOBAL_BATCH = 12, 48


def replay(device: str) -> list[Any]:
    """One process on the global batches: the parameters every rank must end with."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def train_hvd(device: str) -> tuple[list[Any], str]:
    """A rank of a DistributedOptimizer job on its share of the global batches."""
    import torch
    import torch.nn.functional as F

    import ringflow
    import ringflow.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    share = GLOBAL_BATCH // n
    for x, y in _batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
        F.cross_entropy(model(xs.to(device)), ys.to(device)).backward()
        opt.step()
    nccl = ringflow.runtime.running().backends.nccl
    comms = {} if nccl is None else nccl._comms
    path = "staged" if not comms or None in comms.values() else f"nccl via {nccl.provider}"
    params = [p.detach().cpu() for p in model.parameters()]
    hvd.shutdown()
    return params, path


def train_ddp(device: str) -> tuple[list[Any], str]:
    """A rank of DDP on backend "ringflow" (torch's env:// contract, set by ringflow's
    launcher)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ringflow.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("ringflow")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = mlp().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[0] if device == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    share = GLOBAL_BATCH // n
    for x, y in _batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
        F.cross_entropy(ddp(xs.to(device)), ys.to(device)).backward()
        opt.step()
    params = [p.detach().cpu() for p in model.parameters()]
    dist.destroy_process_group()
    return params, "ddp"


def _difference(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _against_replay(fn: Callable[[str], Any], n: int, device: str) -> dict[str, Any]:
    from ringflow.testing import spawn_ranks

    want = replay(device)
    results = spawn_ranks(n, fn, args=(device,), deadline=240)
    diffs = [_difference(params, want) for params, _ in results]
    across = max(_difference(results[0][0], params) for params, _ in results)
    return {"ranks": n, "path": results[0][1], "max_diff_vs_one_process": max(diffs),
            "max_diff_across_ranks": across, "ok": max(diffs) < 1e-4 and across == 0.0}


# --- timing ----------------------------------------------------------------------------------


def resnet_overhead(device: str, quick: bool) -> dict[str, Any]:
    """img/s of a 1-rank DistributedOptimizer against the plain optimizer, alternating."""
    import torch
    import torch.nn.functional as F

    import ringflow.torch as hvd

    hvd.init()
    batch, side = (4, 64) if quick else (64, 224)
    rounds, steps = (2, 2) if quick else (5, 10)
    data = torch.randn(batch, 3, side, side, device=device)
    target = torch.randint(0, 1000, (batch,), device=device)
    plain_model, hvd_model = resnet50().to(device), resnet50().to(device)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01),
                                       named_parameters=hvd_model.named_parameters())

    def rate(model: Any, opt: Any) -> float:
        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            opt.step()

        step()
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        return batch * steps / (time.perf_counter() - start)

    pairs = [(rate(plain_model, plain), rate(hvd_model, wrapped)) for _ in range(rounds)]
    hvd.shutdown()
    none = statistics.median(p for p, _ in pairs)
    ours = statistics.median(h for _, h in pairs)
    return {"img_per_s_no_exchange": none, "img_per_s_ringflow": ours, "ratio": ours / none,
            "rounds": pairs, "batch": batch, "image": side}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def allreduce_latency(device: str, quick: bool) -> dict[str, Any]:
    """Microseconds per in-place allreduce at 1 rank: ringflow against torch.distributed's own
    (NCCL on a GPU, gloo on CPU), alternating rounds."""
    import torch
    import torch.distributed as dist

    import ringflow.torch as hvd

    hvd.init()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    out: dict[str, Any] = {}
    for label, nbytes in (("4KiB", 4096), ("64MiB", 64 << 20)):
        t = torch.ones(nbytes // 4, device=device)
        reps = 20 if quick else (2000 if nbytes == 4096 else 100)

        def ours(t: Any = t, name: str = f"lat.{label}") -> None:
            hvd.allreduce_(t, name=name, op=hvd.Sum)

        def theirs(t: Any = t) -> None:
            dist.all_reduce(t)

        rounds = []
        for _ in range(3 if quick else 5):
            pair = []
            for fn in (ours, theirs):
                fn()
                _sync(device)
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                _sync(device)
                pair.append((time.perf_counter() - start) / reps * 1e6)
            rounds.append(pair)
        mine = statistics.median(p[0] for p in rounds)
        torch_us = statistics.median(p[1] for p in rounds)
        out[label] = {"ringflow_us": mine, "torch_us": torch_us, "ratio": mine / torch_us,
                      "rounds": rounds}
    dist.destroy_process_group()
    hvd.shutdown()
    return out


def against_gloo(device: str, quick: bool) -> dict[str, Any]:
    """A rank of the 2-rank 64 MiB comparison on one GPU: ringflow's allreduce and gloo's
    all_reduce of the same CUDA tensor, alternating."""
    import torch
    import torch.distributed as dist

    import ringflow.torch as hvd

    hvd.init()
    dist.init_process_group("gloo")
    t = torch.ones((16 if quick else 64) << 18, device=device)
    rounds = []
    for _ in range(3 if quick else 5):
        pair = []
        for fn in (lambda: hvd.allreduce_(t, name="big", op=hvd.Sum), lambda: dist.all_reduce(t)):
            fn()
            _sync(device)
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(3):
                fn()
            _sync(device)
            pair.append((time.perf_counter() - start) / 3 * 1e3)
        rounds.append(pair)
    dist.destroy_process_group()
    hvd.shutdown()
    mine = statistics.median(p[0] for p in rounds)
    gloo = statistics.median(p[1] for p in rounds)
    return {"ringflow_ms": mine, "gloo_ms": gloo, "ratio_gloo_over_ringflow": gloo / mine,
            "rounds": rounds}


def _in_job(fn: Callable[..., Any], n: int, *args: Any) -> Any:
    from ringflow.testing import spawn_ranks

    return spawn_ranks(n, fn, args=args, deadline=240)[0]


# --- the run ----------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.node()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # report, do not stop
        env["torch"] = f"unavailable: {exc}"
    try:
        import cupy
        from cupy.cuda import nccl

        from ringflow.algorithms.nccl import version_text

        env["cupy"] = cupy.__version__
        env["cupy_nccl"] = version_text(int(nccl.get_version()))
    except Exception as exc:  # report, do not stop
        env["cupy"] = f"unavailable: {type(exc).__name__}: {exc}"
    _, out = _run(["nvidia-smi", "-L"], 30) if _which("nvidia-smi") else (1, "no nvidia-smi")
    env["nvidia_smi"] = out.strip().splitlines()
    env["commit"] = _run(["git", "rev-parse", "--short", "HEAD"], 10)[1].strip()
    return env


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU rehearsal)")
    parser.add_argument("--out", help="write the record as JSON here")
    args = parser.parse_args()
    dev, quick = args.device, args.quick
    record: dict[str, Any] = {"command": " ".join(sys.argv), "date":
                              datetime.datetime.now(datetime.timezone.utc).isoformat(
                                  timespec="seconds"), "device": dev}
    started = time.monotonic()

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # report and go on: every step is worth its own line
            value = {"error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()[-3000:]}
        record[name] = value
        shown = json.dumps(value, default=str)
        print(f"== {name} ({time.monotonic() - t0:.1f} s): {shown[:1500]}", flush=True)
        return value

    step("environment", environment)
    step("check_build", lambda: _run([sys.executable, "-m", "ringflow.runner",
                                      "--check-build"], 180)[1].splitlines())

    def tests() -> dict[str, Any]:
        code, out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rfE", "tests/gpu"], 240)
        return {"returncode": code, "summary": out.strip().splitlines()[-1:],
                "failures": [x for x in out.splitlines() if x.startswith(("FAILED", "ERROR"))],
                "output_tail": out[-8000:] if code else ""}

    if dev == "cuda":
        step("tests_gpu", tests)
    for n in (1, 2):
        step(f"train_{n}_rank", lambda n=n: _against_replay(train_hvd, n, dev))
        step(f"ddp_{n}_rank", lambda n=n: _against_replay(train_ddp, n, dev))
    step("resnet50_1_rank", lambda: _in_job(resnet_overhead, 1, dev, quick))
    step("allreduce_1_rank", lambda: _in_job(allreduce_latency, 1, dev, quick))
    step("allreduce_2_ranks_vs_gloo", lambda: _in_job(against_gloo, 2, dev, quick))
    record["seconds"] = time.monotonic() - started
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(summary(record), flush=True)
    if dev == "cuda":
        records.append("gpu_check", figures(record))
    return 0


def figures(r: dict[str, Any]) -> dict[str, Any]:
    """The record's figures (benchmarks/records.py): what the issue's goals name."""
    def get(step: str, *path: str) -> Any:
        value: Any = r.get(step)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "gpu": get("environment", "gpu"), "tests_gpu": (get("tests_gpu", "summary") or [""])[0],
        "train_max_diff": {n: get(f"train_{n}_rank", "max_diff_vs_one_process") for n in (1, 2)},
        "ddp_max_diff": {n: get(f"ddp_{n}_rank", "max_diff_vs_one_process") for n in (1, 2)},
        "resnet50_vs_no_exchange": get("resnet50_1_rank", "ratio"),
        "allreduce_vs_torch_nccl": {k: get("allreduce_1_rank", k, "ratio")
                                    for k in ("4KiB", "64MiB")},
        "gloo_over_ringflow_2_ranks_64MiB": get("allreduce_2_ranks_vs_gloo",
                                                "ratio_gloo_over_ringflow"),
    }


def summary(r: dict[str, Any]) -> str:
    def get(*path: str) -> Any:
        value: Any = r
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return "?"
            value = value[key]
        return value

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else str(value)

    tests = get("tests_gpu", "summary")
    parts = [
        f"tests/gpu {tests[0] if isinstance(tests, list) and tests else tests}",
        f"train 1 rank {get('train_1_rank', 'path')} diff "
        f"{num(get('train_1_rank', 'max_diff_vs_one_process'), '.1e')}",
        f"2 ranks {get('train_2_rank', 'path')} diff "
        f"{num(get('train_2_rank', 'max_diff_vs_one_process'), '.1e')}",
        f"DDP(ringflow) 1/2 ranks diff {num(get('ddp_1_rank', 'max_diff_vs_one_process'), '.1e')}"
        f"/{num(get('ddp_2_rank', 'max_diff_vs_one_process'), '.1e')}",
        f"ResNet-50 {num(get('resnet50_1_rank', 'ratio'), '.3f')}x no exchange",
        f"1-rank allreduce vs torch {num(get('allreduce_1_rank', '4KiB', 'ratio'), '.2f')}x (4 KiB)"
        f" {num(get('allreduce_1_rank', '64MiB', 'ratio'), '.2f')}x (64 MiB)",
        f"64 MiB 2 ranks gloo/ringflow "
        f"{num(get('allreduce_2_ranks_vs_gloo', 'ratio_gloo_over_ringflow'), '.2f')}x",
        f"{num(r.get('seconds'), '.0f')} s",
    ]
    return "GPU CHECK: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
