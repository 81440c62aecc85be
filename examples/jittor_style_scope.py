"""Jittor-style training that imports ringflow only where one process is not the same as many:
global metrics, and code for rank 0 alone (validation on the whole test set, checkpoints).

    ringflow-run --auto -np 2 python examples/jittor_style_scope.py [--checkpoint-dir DIR]
    python examples/jittor_style_scope.py                       # alone: the same results

Jittor's guide, in ringflow:

- ``jt.rank`` / ``jt.world_size``          -> ``ringflow.rank()`` / ``ringflow.size()`` (no init)
- ``@jt.single_process_scope()``           -> ``@ringflow.single_process_scope()``
- ``correct.mpi_all_reduce()``             -> ``ringflow.metrics.Accuracy`` (or ``global_sum``)
- ``if jt.rank == 0: writer.add_scalar()`` -> ``if ringflow.rank() == 0: ...``

The training loop is unchanged single-process code: ``ringflow-run --auto`` makes the optimizer
average, the DataLoaders shard and BatchNorm synchronise. The evaluation DataLoader is sharded
too (each rank sees its part of the test set); ``metrics.Accuracy`` adds the ranks' counts, so
the global accuracy equals the one ``validate()`` computes on rank 0 over the whole test set,
which ``single_process_scope`` runs once and returns to every rank.
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringflow
from ringflow import metrics

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels)
    train_rows, test_rows = digits.split(len(y), 451)
    x_train, x_test = x[train_rows], x[test_rows]
    y_train, y_test = y[train_rows], y[test_rows]
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                       shuffle=True, drop_last=True)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=100)  # 451: 4 x 100 + 51

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    checkpoints = args.checkpoint_dir  # rank() answers before anything is initialised
    if checkpoints is None and ringflow.rank() == 0:
        checkpoints = tempfile.mkdtemp(prefix="ringflow-jittor-")

    @ringflow.single_process_scope()
    def validate(epoch: int) -> float:
        """Rank 0 alone, as one process: the test loader is not sharded in here."""
        accuracy = metrics.Accuracy()
        with torch.no_grad():
            for images, labels in test:
                accuracy.update(net(images), labels)
        os.makedirs(checkpoints, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(checkpoints, f"epoch-{epoch}.pt"))
        return accuracy.compute()

    for epoch in range(1, args.epochs + 1):
        net.train()
        for images, labels in train:
            optimizer.zero_grad()
            F.cross_entropy(net(images), labels).backward()
            optimizer.step()
        net.eval()
        accuracy = metrics.Accuracy()  # every rank: its share of the test set
        with torch.no_grad():
            for images, labels in test:
                accuracy.update(net(images), labels)
        distributed = accuracy.compute()  # global, on every rank
        alone = validate(epoch)  # rank 0 on the whole test set, returned to every rank
        if ringflow.rank() == 0:
            print(f"epoch {epoch}: test accuracy {distributed:.6f} over {accuracy.total} "
                  f"samples on {ringflow.size()} rank(s); on rank 0 alone {alone:.6f}; "
                  f"equal: {distributed == alone}", flush=True)
    if ringflow.rank() == 0:
        print(f"checkpoints in {checkpoints}")


if __name__ == "__main__":
    main()
