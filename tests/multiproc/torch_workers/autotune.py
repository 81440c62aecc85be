"""The autotuner's values agree across ranks: a DistributedOptimizer trains under
``--autotune`` (compression allowed) until the tuner has tried every value, and every rank ends
with the same parameters bit for bit and the same values in force. Prints ``PASS`` or raises."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

import ringflow.torch as hvd
from ringflow import runtime

STEPS = 140

hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                      nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(hvd.rank())
seen = set()
for _ in range(STEPS):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(8, 256, generator=g)),
                    torch.randint(0, 10, (8,), generator=g)).backward()
    opt.step()
    seen.add(runtime.running().params)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
digests = hvd.allgather_object(digest.hexdigest(), name="digests")
assert len(set(digests)) == 1, f"ranks ended with different parameters: {digests}"
finals = hvd.allgather_object(runtime.running().params, name="finals")
assert len(set(finals)) == 1, finals
assert {p.chunk_bytes for p in seen} >= {0, 256 * 1024, 4 << 20}, seen
assert {p.wire_compression for p in seen} == {"none", "fp16"}, seen
if hvd.rank() == 0:
    assert runtime.running().seat.tuner is None, "the tuner has not finished"
print(f"PASS rank {hvd.rank()}: {len(seen)} settings ran, final {finals[0]}", flush=True)
hvd.shutdown()
