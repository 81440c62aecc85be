"""A torch elastic worker for tests/multiproc/test_elastic.py: TorchState with a model, a
DistributedOptimizer (SGD with momentum), an ElasticSampler and plain values.

One sample a rank a step; a rank whose shard is used up in the last step of an epoch contributes
a zero gradient, so every rank runs the same steps. Each step is recorded (generation, step,
epoch, sample) before ``commit()``; the victim (``KILL=HOST:STEP``) records its sample, then
SIGKILLs itself between backward (its gradients are on their way) and ``step()``. At the end each
worker writes its parameters and momentum buffers as hex.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import torch

import ringflow.torch as hvd
from ringflow import runtime

OUT = os.environ["OUT"]
LENGTH, EPOCHS = int(os.environ["LENGTH"]), int(os.environ["EPOCHS"])
SLEEP = float(os.environ.get("SLEEP", "0"))
WID, HOST = os.environ["RINGFLOW_ELASTIC_ID"], os.environ["RINGFLOW_HOSTNAME"]
KILL, GROW = os.environ.get("KILL", ""), os.environ.get("GROW", "")


def wait_for_newcomer() -> None:
    """Rank 0, having listed a new host: hold the job (its peers wait in the next commit) until
    the newcomer asks to join, so that the test knows the step at which the world grows."""
    end = time.monotonic() + 60
    while not runtime.world().update_pending() and time.monotonic() < end:
        time.sleep(0.05)


def record(**fields: object) -> None:
    with open(os.path.join(OUT, f"steps-{WID}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


hvd.init()
torch.manual_seed(int(WID))  # every worker starts from other weights: sync() makes them equal
data = torch.randn(LENGTH, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
target = data.sum(1, keepdim=True)
model = torch.nn.Linear(4, 1).double()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(LENGTH), shuffle=True, seed=3)


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    g = runtime.world().generation
    while state.epoch < EPOCHS:
        mine = list(state.sampler)
        steps = math.ceil((LENGTH - state.sampler.processed_num) / hvd.size())
        for k in range(steps):
            sample = mine[k] if k < len(mine) else -1
            optimizer.zero_grad()
            out = model(data[max(sample, 0):max(sample, 0) + 1])
            loss = ((out - target[sample]) ** 2).sum() if sample >= 0 else out.sum() * 0
            loss.backward()
            rec = dict(gen=g, size=hvd.size(), step=state.step, epoch=state.epoch,
                       processed=state.sampler.processed_num, sample=sample)
            if f"{HOST}:{state.step}" == KILL:
                record(**rec)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            record(**rec)
            state.sampler.record_batch(k, 1)
            state.step += 1
            if GROW and hvd.rank() == 0:
                path, step, line = GROW.split(":", 2)
                with open(path) as f:
                    listed = f.read().split()
                if int(step) == state.step and line not in listed:
                    with open(path, "a") as f:
                        f.write(line + "\n")
                    wait_for_newcomer()
            time.sleep(SLEEP)
            state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0))
momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
with open(os.path.join(OUT, f"final-{WID}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(),
               "params": [p.detach().numpy().tobytes().hex() for p in model.parameters()],
               "momentum": [m.numpy().tobytes().hex() for m in momentum]}, f)
hvd.shutdown()
