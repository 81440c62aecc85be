"""DistributedDataParallel on torch.distributed's backend "ringflow", started by torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp_digits.py
    ringflow-run -np 2 python examples/torch_ddp_digits.py          # works too (env://)
    torchrun --standalone --nproc-per-node 2 examples/torch_ddp_digits.py --backend gloo

A plain DDP script, as written for gloo: ``import ringflow.torch`` (which registers the backend)
and ``backend="ringflow"`` are the only changes. It trains a small CNN on scikit-learn's digits
(8x8 images, shipped with the package: no download), shards the data with torch's
DistributedSampler, and reports the test accuracy over all ranks with ``all_reduce`` -- which
sums, as torch's does (Horovod-style ``ringflow.torch.allreduce`` would average). The test set is
sharded without padding (a DistributedSampler would repeat samples to even the shards and count
them twice), so the global accuracy is exact.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringflow.torch  # noqa: F401 - registers torch.distributed's backend "ringflow"

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def datasets() -> tuple[TensorDataset, TensorDataset]:
    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    train, test = digits.split(len(y), 0.25)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ringflow")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group(args.backend)  # env://: torchrun's RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = datasets()
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DistributedDataParallel(Net())  # broadcasts rank 0's parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        dist.all_reduce(total)  # SUM: torch's default
        if rank == 0:
            print(f"epoch {epoch}: train loss {total[0] / total[1]:.4f} "
                  f"on {int(total[1])} samples", flush=True)

    model.eval()
    mine = range(rank, len(test_set), world)  # every test sample on exactly one rank
    x, y = test_set[list(mine)]
    with torch.no_grad():
        counts = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(counts)
    if rank == 0:
        print(f"test accuracy {counts[0] / counts[1]:.4f} ({int(counts[0])}/{int(counts[1])}) "
              f"on {world} ranks, backend {dist.get_backend()}", flush=True)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
