"""MNIST-style training with ringflow.torch on scikit-learn's digits (8x8 images, ships offline).

    ringflow-run -np 2 python examples/pytorch_mnist.py [--epochs 8] [--checkpoint-dir DIR]

The Horovod recipe, unchanged but for the import: shard the data with DistributedSampler, scale
the learning rate by the number of ranks, wrap the optimizer in DistributedOptimizer, broadcast
the initial parameters and optimizer state from rank 0, average the metrics over ranks, and let
rank 0 alone write checkpoints.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringflow.torch as hvd

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


class Net(nn.Module):
    """A small CNN for 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def metric_average(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor(value), name=name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where rank 0 writes checkpoints (default: a new temporary dir)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank; the ranks share the machine

    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels)
    train, test = digits.split(len(y), 0.25)
    train_set, test_set = TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])
    train_sampler = hvd.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = hvd.DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    ckpt_dir = args.checkpoint_dir
    if hvd.rank() == 0:
        ckpt_dir = ckpt_dir or tempfile.mkdtemp(prefix="ringflow-mnist-")
        os.makedirs(ckpt_dir, exist_ok=True)

    # Warm, then decay: the scaled learning rate is large for a tiny model at the end.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        total_loss, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            batches += 1
        scheduler.step()
        model.eval()
        correct, seen, test_loss = 0, 0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                out = model(data)
                test_loss += float(F.cross_entropy(out, target, reduction="sum"))
                correct += int((out.argmax(1) == target).sum())
                seen += len(target)
        # Each rank saw its shard (padded to equal size by the sampler): average over ranks.
        train_loss = metric_average(total_loss / max(batches, 1), "train_loss")
        accuracy = metric_average(correct / max(seen, 1), "accuracy")
        test_loss = metric_average(test_loss / max(seen, 1), "test_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {accuracy:.4f}  ({time.perf_counter() - start:.1f} s)",
                  flush=True)
            torch.save({"epoch": epoch, "model": model.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(ckpt_dir, f"checkpoint-{epoch}.pt"))
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.4f} on {hvd.size()} ranks; checkpoints in "
              f"{ckpt_dir}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
