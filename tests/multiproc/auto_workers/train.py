"""A plain single-process torch training script (no ringflow import), for the auto-mode tests.

Run alone it trains on the global batch; under ``ringflow-run --auto`` every rank must end with
the same parameters (to rounding). It saves, per rank (``RANK``, 0 alone), the final state and
the indices of every batch it saw to ``OUT/rank<r>.pt``.
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=102)
parser.add_argument("--batch-size", type=int, default=12)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lbfgs", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
data = torch.Generator().manual_seed(1)  # the data does not depend on the model's draws
x = torch.randn(args.samples, 8, generator=data)
y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
dataset = TensorDataset(x, y, torch.arange(args.samples))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                  nn.Linear(16, 3))
        self.unused = nn.Parameter(torch.ones(3))  # no gradient, ever: SGD must skip it

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
seen = []
for _ in range(args.epochs):
    model.train()
    for inputs, targets, index in loader:
        seen.append(index.tolist())
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()

if args.lbfgs:  # a closure optimizer on the first (unshuffled) batch
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    inputs, targets, _ = next(iter(DataLoader(dataset, batch_size=args.batch_size)))

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        return loss

    lbfgs.step(closure)

os.makedirs(args.out, exist_ok=True)
torch.save({"state": model.state_dict(), "seen": seen, "batches": len(loader)},
           os.path.join(args.out, f"rank{os.environ.get('RANK', '0')}.pt"))
