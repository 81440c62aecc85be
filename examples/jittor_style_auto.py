"""A plain single-process PyTorch script: no ringflow in it, and nothing to change to run it on N.

    python examples/jittor_style_auto.py                            # one process
    ringflow-run --auto -np 2 python examples/jittor_style_auto.py  # two, data-parallel
    mpirun -np 2 python -m ringflow.torch.auto examples/jittor_style_auto.py   # any launcher

Under ``--auto`` (Jittor's mpirun mode) the SGD optimizer averages gradients over the ranks at
every step (and starts from rank 0's parameters), the DataLoader splits each batch of 64 among
the ranks (32 each on 2) in the order one process would draw them, and the BatchNorm layers
normalise over the whole batch of 64. Every rank therefore ends with the model one process
trains, up to the order of floating-point additions (the ranks add in another order): compare
the checksums printed by both runs. Training amplifies those last-bit differences where a ReLU
decision flips; after 5 epochs the checksums still agree to about 5 significant digits.

The test accuracy is computed on the whole test set at once, without a DataLoader, so every
rank prints the same, correct number. An evaluation DataLoader would be sharded: see
``jittor_style_scope.py`` for global metrics and rank-0-only code.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import digits  # examples/digits.py: scikit-learn's digits, read with numpy


def model() -> nn.Module:
    # A strided convolution rather than max-pooling: digits have many equal pixels, so a pool
    # window often holds a tie, and a tie that rounding decides differently (the ranks add in
    # another order) sends a gradient elsewhere; the runs would still agree, less closely.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    images, labels = digits.load()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(labels)
    train_rows, test_rows = digits.split(len(y), 0.25)
    x_train, x_test = x[train_rows], x[test_rows]
    y_train, y_test = y[train_rows], y[test_rows]
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                       shuffle=True, drop_last=True)

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(1, args.epochs + 1):
        net.train()
        for images, labels in train:
            optimizer.zero_grad()
            F.cross_entropy(net(images), labels).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
        print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in net.parameters())
    print(f"final test accuracy {accuracy:.4f}; parameter checksum {checksum:.5f}")


if __name__ == "__main__":
    main()
