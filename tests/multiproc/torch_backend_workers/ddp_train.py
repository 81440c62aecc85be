"""A DistributedDataParallel script written for gloo; ``--backend ringflow`` is the only change.

    python ddp_train.py --backend ringflow --out DIR       # under torchrun / ringflow-run (env://)
    python ddp_train.py --replay N --out DIR               # one process, the global batch

Each rank starts from a different random model (DDP must broadcast rank 0's), draws its share
with torch's DistributedSampler (shuffled per epoch, padded: 70 samples), and trains an MLP with
momentum SGD; the final state is written to ``DIR/rank<r>.pt``. ``--replay N`` trains one
process on the same global batches (rank 0's batch, then rank 1's, ...; every rank's batch has
the same size, so the mean over them is the mean of DDP's averaged gradients) and writes
``DIR/replay.pt``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, BATCH, EPOCHS, SEED = 70, 4, 3, 1234


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    # rank 0 (seed SEED) has 1.0, the others more: DDP must broadcast rank 0's buffers too
    net.register_buffer("scale", torch.full((1,), 1.0 + 0.5 * (seed - SEED)))
    return net


def train(backend: str, out: str) -> None:
    dist.init_process_group(backend)  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, n = dist.get_rank(), dist.get_world_size()
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    net = torch.nn.parallel.DistributedDataParallel(model(SEED + rank))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x) * net.module.scale, y).backward()
            opt.step()
    torch.save(net.module.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    del net, opt
    dist.destroy_process_group()
    print(f"PASS rank {rank}/{n} trained on {backend}", flush=True)


def replay(n: int, out: str) -> None:
    data = dataset()
    net = model(SEED)  # rank 0's initial model, which DDP broadcasts
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(EPOCHS):
        shares = []
        for q in range(n):
            sampler = DistributedSampler(data, num_replicas=n, rank=q, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            shares.append(list(DataLoader(data, batch_size=BATCH, sampler=sampler)))
        for batches in zip(*shares, strict=True):
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            opt.zero_grad()
            F.cross_entropy(net(x) * net.scale, y).backward()
            opt.step()
    torch.save(net.state_dict(), os.path.join(out, "replay.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--replay", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.replay:
        replay(args.replay, args.out)
        return
    if args.backend == "ringflow":
        import ringflow.torch  # noqa: F401 - registers the backend
    train(args.backend, args.out)


if __name__ == "__main__":
    main()
