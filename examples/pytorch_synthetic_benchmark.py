"""Synthetic data-parallel training benchmark, like Horovod's pytorch_synthetic_benchmark.py.

    ringflow-run -np 2 python examples/pytorch_synthetic_benchmark.py --model mlp
    ringflow-run -np 2 python examples/pytorch_synthetic_benchmark.py --model cnn --fp16-allreduce

Trains on random data (no I/O) with DistributedOptimizer and reports samples/s per rank and in
total as mean +- 1.96 std over ``--num-iters`` timed iterations of ``--num-batches-per-iter``
batches each. Models: ``mlp`` (25.2 M parameters: 1024-4096-4096-1024 with a 10-way head, ~100 MB
of float32 gradients per step), ``cnn`` (0.4 M parameters on 3x32x32 images), or any
``torchvision.models`` name when torchvision is installed. Run without the launcher it measures
one process with no gradient exchange, the baseline for scaling efficiency.

``build_model``, ``synthetic_batch`` and ``time_steps`` are importable, so that
``benchmarks/torch_ddp_vs_ringflow.py`` times DistributedDataParallel on the same model and loop.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("mlp", "cnn")


def build_model(name: str) -> nn.Module:
    """The benchmark model ``name`` (``mlp``, ``cnn`` or a torchvision model name)."""
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))
    from torchvision import models  # optional

    return getattr(models, name)()


def synthetic_batch(name: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        data = torch.randn(batch_size, 1024, generator=g)
    elif name == "cnn":
        data = torch.randn(batch_size, 3, 32, 32, generator=g)
    else:
        data = torch.randn(batch_size, 3, 224, 224, generator=g)
    return data, torch.randint(0, 10, (batch_size,), generator=g)


def time_steps(step: Callable[[], None], batch_size: int, warmup: int, per_iter: int,
               iters: int, log: Callable[[str], None] = lambda _: None) -> list[float]:
    """Samples/s of each timed iteration (``per_iter`` steps each) after ``warmup`` steps."""
    timeit.timeit(step, number=warmup)
    rates = []
    for i in range(iters):
        seconds = timeit.timeit(step, number=per_iter)
        rates.append(batch_size * per_iter / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help=f"{', '.join(MODELS)} or torchvision")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--bf16-allreduce", action="store_true")
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch.set_num_threads per rank (0: leave torch's default)")
    parser.add_argument("--json", action="store_true", help="rank 0 also prints a JSON summary")
    args = parser.parse_args()

    import ringflow.torch as hvd

    hvd.init()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = (hvd.Compression.fp16 if args.fp16_allreduce else
                   hvd.Compression.bf16 if args.bf16_allreduce else hvd.Compression.none)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data, target = synthetic_batch(args.model, args.batch_size)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(line: str) -> None:
        if hvd.rank() == 0:
            print(line, flush=True)

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.2f} M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of ranks: {hvd.size()}, threads per rank: {torch.get_num_threads()}")
    rates = time_steps(step, args.batch_size, args.num_warmup_batches,
                       args.num_batches_per_iter, args.num_iters, log)
    mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
    total = hvd.allreduce(torch.tensor(mean, dtype=torch.float64), op=hvd.Sum, name="rate")
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {float(total):.1f} +-{hvd.size() * conf:.1f}")
    if args.json:
        log(json.dumps({"model": args.model, "ranks": hvd.size(), "per_rank": mean,
                        "per_rank_conf": conf, "total": float(total), "params": params}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
