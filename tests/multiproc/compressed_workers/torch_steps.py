"""DistributedOptimizer with a compressor with state, as a process of ringflow-run
(tests/multiproc/test_compressed_processes.py): several buckets (RINGFLOW_BUCKET_BYTES is set
small), 4 steps; per step every compressed gradient is c * sum_w (D_w - e_w') (1-bit: plus the
server errors' E - E'), checked with every rank's raw gradient and errors (allgathered); the
parameters are rank 0's bits on every rank; the state survives torch.save / torch.load
(weights_only). Prints "PASS SPEC rank r".

    ringflow-run -np 3 python torch_steps.py onebit:min_elements=256

SPEC is what ``RINGFLOW_COMPRESSION`` (``ringflow-run --compression``) says: the script sets the
variable for its own run and puts it back after, so that its runs with several compressors share
one process (tests/multiproc/one_process.py).
"""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import torch

import ringflow.torch as hvd
from ringflow.compression import parse

SPEC = sys.argv[1]
FOUND = os.environ.get("RINGFLOW_COMPRESSION")
os.environ["RINGFLOW_COMPRESSION"] = SPEC
hvd.init()
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                          torch.nn.ReLU(), torch.nn.Linear(48, 5))
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                               named_parameters=net.named_parameters())
ex = opt._exchange
assert ex is not None and ex.options == parse(SPEC), (ex.options, SPEC)


def flat(values: dict, names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(values[k], np.float64).reshape(-1) if k in values else
                           np.zeros(dict(net.named_parameters())[k].numel()) for k in names])


for step in range(4):
    g = torch.Generator().manual_seed(1000 * step + r)
    x, y = torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)
    before = {k: np.array(v) for k, v in ex.errors.items()}
    server_before = {k: v.copy() for k, v in ex.server.items()}
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    raw = {k: p.grad.detach().clone() for k, p in net.named_parameters()}
    opt.synchronize()
    names = sorted(ex.errors)
    assert names, "nothing was compressed"
    mine = np.concatenate([flat({k: raw[k]}, [k]) for k in names]) + flat(before, names) \
        - flat({k: np.array(v) for k, v in ex.errors.items()}, names)
    total = hvd.allgather(torch.as_tensor(mine)[None], name=f"check.sent.{step}").sum(0)
    expected = total.numpy() / n
    if ex.server:  # 1-bit: rank w holds chunk w of each tensor's server error
        for k in names:
            def gathered(values: dict, tag: str, k: str = k, step: int = step) -> np.ndarray:
                mine = torch.as_tensor(np.asarray(values.get(k, np.zeros_like(ex.server[k]))))
                return hvd.allgather(mine, name=f"check.{tag}.{k}.{step}").numpy()
            count = dict(net.named_parameters())[k].numel()
            delta = (gathered(server_before, "was") - gathered(ex.server, "now"))[:count]
            at = sum(dict(net.named_parameters())[j].numel() for j in names[:names.index(k)])
            expected[at:at + count] += delta
    got = np.concatenate([dict(net.named_parameters())[k].grad.double().reshape(-1).numpy()
                          for k in names])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    with opt.skip_synchronize():
        opt.step()
for i, p in enumerate(net.parameters()):
    torch.testing.assert_close(p.detach(), hvd.broadcast(p.detach(), 0, name=f"check.p{i}"),
                               rtol=0, atol=0)
buf = io.BytesIO()
torch.save(opt.state_dict(), buf)
buf.seek(0)
opt.load_state_dict(torch.load(buf, weights_only=True))
print(f"PASS {SPEC} rank {r}", flush=True)
hvd.shutdown()
if FOUND is None:
    del os.environ["RINGFLOW_COMPRESSION"]
else:
    os.environ["RINGFLOW_COMPRESSION"] = FOUND
