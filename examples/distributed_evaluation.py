"""Exact distributed evaluation: a global accuracy equal to one process's, to the last digit.

    ringflow-run -np 2 python examples/distributed_evaluation.py   # or -np 3, or alone

Trains a small model on scikit-learn's digits the Horovod way (ringflow.torch), then evaluates
it on a test set of 451 images (odd, and not a multiple of 3) three ways:

1. the usual recipe, and its trap: torch's ``DistributedSampler`` pads the last shard by
   repeating samples (452 images on 2 ranks, 453 on 3), and the per-rank accuracies are
   averaged, weighting ranks equally;
2. exact: ``hvd.DistributedSampler(..., pad=False)`` gives every image to exactly one rank, and
   ``ringflow.metrics.Accuracy`` adds the ranks' counts of correct predictions;
3. one process: ``ringflow.single_process_scope`` runs the evaluation on rank 0 alone over the
   whole test set and returns the result to every rank.

(2) equals (3) exactly, on every rank; (1) need not.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import ringflow.torch as hvd
from ringflow import metrics

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels)
    train, test = digits.split(len(y), 451)
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.02 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    sampler = hvd.DistributedSampler(train_set, shuffle=True, seed=0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in DataLoader(train_set, batch_size=32, sampler=sampler):
            optimizer.zero_grad()
            F.cross_entropy(net(images), labels).backward()
            optimizer.step()
    net.eval()

    # 1. The trap: padded shards, and the mean of per-rank accuracies.
    padded = TorchDistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                     shuffle=False)
    correct = seen = 0
    with torch.no_grad():
        for images, labels in DataLoader(test_set, batch_size=64, sampler=padded):
            correct += int((net(images).argmax(1) == labels).sum())
            seen += len(labels)
    averaged = float(hvd.allreduce(torch.tensor(correct / seen, dtype=torch.float64),
                                   name="padded.accuracy"))
    counted = int(hvd.allreduce(torch.tensor(seen), op=hvd.Sum, name="padded.seen"))

    # 2. Exact: each image on one rank, counts added.
    exact = hvd.DistributedSampler(test_set, shuffle=False, pad=False)
    accuracy = metrics.Accuracy()
    with torch.no_grad():
        for images, labels in DataLoader(test_set, batch_size=64, sampler=exact):
            accuracy.update(net(images), labels)
    distributed = accuracy.compute()

    # 3. One process: rank 0 over the whole test set, its result returned to every rank.
    @hvd.single_process_scope()
    def evaluate_alone() -> float:
        with torch.no_grad():
            predictions = net(x_test).argmax(1)
        return int((predictions == y_test).sum()) / len(y_test)

    alone = evaluate_alone()
    if hvd.rank() == 0:
        print(f"padded, averaged over ranks: {averaged:.17g} ({counted} images counted)")
        print(f"exact (pad=False, metrics):  {distributed!r} ({accuracy.total} images)")
        print(f"one process (rank 0 alone):  {alone!r} ({len(y_test)} images)")
    # Every rank holds the same two numbers: the comparison is the same everywhere.
    print(f"rank {hvd.rank()}: exact == one process: {distributed == alone}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
