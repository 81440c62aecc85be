"""Overlap with backward: the same training with gradients submitted as they become ready
(the default buckets) and with every gradient submitted after backward (RINGFLOW_BUCKET_BYTES=0)
ends with the same bits. Prints ``PASS overlap rank r: ...`` on every rank, or raises; leaves
RINGFLOW_BUCKET_BYTES as it found it (a next script in the same process, one_process.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import ringflow.torch as hvd

STEPS = 6


def train(bucket_bytes: str) -> tuple[list[torch.Tensor], int]:
    os.environ["RINGFLOW_BUCKET_BYTES"] = bucket_bytes
    hvd.init()
    torch.manual_seed(0)
    # Backward order: the head (small), then 1.2 MiB, then 2 MiB: a first bucket closes during
    # backward, the rest goes at its end.
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 300), nn.ReLU(),
                          nn.Linear(300, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    early = 0
    for _ in range(STEPS):
        data, target = torch.randn(16, 512, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
        overlap = opt.step_overlap
        assert overlap is not None and overlap.operations == 6, overlap
        assert 0.0 <= overlap.hidden_s <= overlap.exchange_s, overlap
        early += overlap.early
    params = [p.detach().clone() for p in model.parameters()]
    hvd.shutdown()
    return params, early


found = os.environ.get("RINGFLOW_BUCKET_BYTES")
overlapped, early = train("4194304")
at_end, late = train("0")
if found is None:
    del os.environ["RINGFLOW_BUCKET_BYTES"]
else:
    os.environ["RINGFLOW_BUCKET_BYTES"] = found
assert early >= STEPS * 4, f"only {early} operations started during backward"
assert late == 0, f"{late} operations started during backward with RINGFLOW_BUCKET_BYTES=0"
for a, b in zip(overlapped, at_end, strict=True):
    assert torch.equal(a, b), f"overlap changed the result by {(a - b).abs().max().item()}"
print(f"PASS overlap rank {hvd.rank()}: {early} of {STEPS * 6} operations started during backward; "
      "results equal bit for bit", flush=True)
