"""Auto mode's edges, run under ``ringflow-run --auto`` at any size (1 too): each check records
its result in ``OUT/rank<r>.json``; the test compares them across ranks and with closed forms.
"""

import argparse
import json
import os
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ringflow
import ringflow.torch.auto
from ringflow import metrics
from ringflow.errors import MismatchError

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
torch.set_num_threads(1)

# Before init(): rank and size from the launcher, and nothing started.
result = {"before_init": [ringflow.rank(), ringflow.size(), ringflow.is_initialized()],
          "enabled": ringflow.torch.auto.enabled()}
n, r = ringflow.size(), ringflow.rank()
calls = os.path.join(args.out, "calls")

# An evaluation loader (shuffle=False, 7 samples, batch 4): shards, each sample on one rank;
# no warning under no_grad, one (once) when gradients are enabled.
x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
evaluation = DataLoader(TensorDataset(x, torch.arange(7)), batch_size=4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        result["shard"] = [index.tolist() for _, index in evaluation]
    result["shard_again"] = [index.tolist() for _, index in evaluation]
    result["shard_again"] += [index.tolist() for _, index in evaluation]
result["shard_len"] = len(evaluation)
result["shard_warnings"] = [str(w.message)[:50] for w in caught]


@ringflow.single_process_scope()
def validate(tag: str) -> dict:
    """Runs on rank 0 alone: the loader is not sharded here, and nothing waits for others."""
    with open(calls, "a") as f:
        f.write(f"{tag} {ringflow.rank()}\n")
    seen = [i for _, index in evaluation for i in index.tolist()]
    accuracy = metrics.Accuracy()
    accuracy.update(torch.tensor(seen) % 3, torch.zeros(len(seen), dtype=torch.long))
    return {"seen": seen, "accuracy": accuracy.compute(), "by": ringflow.rank()}


result["validate"] = [validate("a"), validate("b")]
accuracy = metrics.Accuracy()
for _, index in evaluation:
    accuracy.update(index % 3, torch.zeros(len(index), dtype=torch.long))
result["accuracy"] = accuracy.compute()  # global: must equal validate()'s, exactly


@ringflow.single_process_scope
def broken() -> None:
    raise FileNotFoundError("no such checkpoint")


try:
    broken()
except FileNotFoundError as exc:
    result["broken"] = str(exc)

# torch.nn.SyncBatchNorm and BatchNorm1d: the statistics of the global batch.
g = torch.Generator().manual_seed(5)
batch = torch.randn(12, 4, generator=g) * 3 + 1
mine = torch.cat([b for b in torch.arange(12).tensor_split(n)][r:r + 1]) if n > 1 \
    else torch.arange(12)
for name, layer in (("sync", nn.SyncBatchNorm(4)), ("bn", nn.BatchNorm1d(4))):
    reference = nn.BatchNorm1d(4)
    with ringflow.single_process_scope():  # one process's BatchNorm on the whole batch
        want = reference(batch)[mine]
    got = layer(batch[mine])
    result[name] = [float((got - want).detach().abs().max()),
                    float((layer.running_var - reference.running_var).abs().max())]

# Optimizers: parameters start as rank 0's; gradients are averaged at step().
w = nn.Parameter(torch.full((2,), float(r + 1)))
sgd = torch.optim.SGD([w], lr=0.5)
result["broadcast"] = w.tolist()  # rank 0's: 1.0
(w * (r + 1)).sum().backward()
sgd.step()  # averaged: 1 - 0.5 * (mean over ranks of r + 1) = 1 - (n + 1) / 4
result["averaged"] = w.tolist()

# A training loader whose last batch has fewer samples than ranks: ranks without a share of it
# step after the next epoch's first batch; every rank fails with the same error, not silently.
tiny = DataLoader(TensorDataset(torch.ones(n + 1, 2)), batch_size=n)  # batches of n and 1
result["tiny_len"] = len(tiny)  # what this rank will iterate: ranks without a share, one fewer
try:
    for _ in range(2):
        for (inputs,) in tiny:
            sgd.zero_grad()
            (w * inputs).sum().backward()
            sgd.step()
except MismatchError as exc:
    result["mismatch"] = str(exc).split(" (")[0]

# What auto mode leaves alone, and says so.
class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result["iterable"] = [int(v) for v in DataLoader(Stream(), batch_size=2) for v in v]
    uneven = DataLoader(TensorDataset(torch.arange(10)), batch_size=5)
    result["uneven"] = [b[0].tolist() for b in uneven]
result["left_alone_warnings"] = [str(w.message)[:60] for w in caught]

# Without auto mode, torch.nn.SyncBatchNorm normalises locally: a warning says so, once.
ringflow.torch.auto.disable()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    layer = nn.SyncBatchNorm(4)
    layer(batch[mine])
    layer(batch[mine])
result["torch_sync_warnings"] = [str(w.message)[:60] for w in caught]

with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
    json.dump(result, f)
