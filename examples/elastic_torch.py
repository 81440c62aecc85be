"""Elastic training with ringflow.torch (Horovod's ``hvd.elastic``): the job goes on when
workers leave (a killed process, a host gone from the list) or join (a host added to it).

    ringflow-run --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/elastic_torch.py

``hosts.sh`` prints the hosts that may run workers now, one ``HOST[:SLOTS]`` a line. The model,
the optimizer (with its momentum), the sampler's place in the epoch and the epoch counter are
committed after every step; a worker that joins gets them from its peers.
"""

from __future__ import annotations

import math
import os

import torch

import ringflow.torch as hvd

EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCH = 16
BASE_LR = 0.01

hvd.init()
torch.manual_seed(0)
data = torch.randn(512, 8)
target = data @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.9),
    named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(len(data)), seed=1)


def scale_lr() -> None:
    """After each reset: the learning rate follows the number of workers."""
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * hvd.size()


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    while state.epoch < EPOCHS:
        indices = list(state.sampler)  # this rank's share of what is left of the epoch
        steps = math.ceil((len(data) - state.sampler.processed_num) / (hvd.size() * BATCH))
        for k in range(steps):  # the same number of steps on every rank
            batch = indices[k * BATCH:(k + 1) * BATCH]
            optimizer.zero_grad()
            if batch:
                loss = torch.nn.functional.mse_loss(model(data[batch]), target[batch])
            else:  # this rank's share ran out in the epoch's last step: a zero gradient
                loss = model(data[:1]).sum() * 0
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(k, BATCH)
            state.commit()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: loss {loss.item():.4f} on {hvd.size()} workers",
                  flush=True)
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
state.register_reset_callbacks([scale_lr])
train(state)
