"""An elastic worker under torchrun (tests/multiproc/test_elastic.py): steps.py's arithmetic in
a ``TorchState`` -- the model is one float64 parameter ``w`` (exact: every value stays below
2**53), the rest plain values -- committed after every step.

Environment: ``OUT``, ``LENGTH``, ``EPOCHS``, ``KILL_STEP`` (rank 1 of torchrun's first attempt
SIGKILLs itself in the middle of that step). Each rank logs its steps to
``steps-<attempt>-<rank>.jsonl`` (``gen`` is torchrun's attempt) and its end to
``final-<rank>.json``; the first step of each attempt is in ``start-<attempt>-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import signal

import torch

import ringflow.torch as hvd
from ringflow import elastic as core

P, SEED = 1_000_003, 11  # steps.py's
OUT = os.environ["OUT"]
LENGTH, EPOCHS = int(os.environ["LENGTH"]), int(os.environ["EPOCHS"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))


def dump(name: str, fields: dict, mode: str = "w") -> None:
    with open(os.path.join(OUT, name), mode) as f:
        f.write(json.dumps(fields) + "\n")


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> int:
    dump(f"start-{ATTEMPT}-{hvd.rank()}.json", {"step": state.step, "epoch": state.epoch})
    (w,) = state.model.parameters()
    while state.epoch < EPOCHS:
        mine = core.shard(LENGTH, state.epoch, SEED, True, state.processed, hvd.rank(),
                          hvd.size())
        k = 0
        while state.processed < LENGTH:
            sample = mine[k] if k < len(mine) else -1
            handle = hvd.allreduce_async(torch.tensor([sample + 1], dtype=torch.int64),
                                         name="step", op=hvd.Sum)
            if ATTEMPT == 0 and hvd.rank() == 1 and state.step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            total = int(hvd.synchronize(handle)[0])
            with torch.no_grad():
                w.copy_((w * 3 + total) % P)
            dump(f"steps-{ATTEMPT}-{hvd.rank()}.jsonl",
                 {"gen": ATTEMPT, "rank": hvd.rank(), "size": hvd.size(), "step": state.step,
                  "epoch": state.epoch, "processed": state.processed, "sample": sample}, "a")
            state.processed = min(LENGTH, state.processed + hvd.size())
            state.step += 1
            k += 1
            state.commit()
        state.epoch += 1
        state.processed = 0
        state.commit()
    return int(w.item())


hvd.init()
model = torch.nn.Module()
model.w = torch.nn.Parameter(torch.tensor([7.0 if hvd.rank() == 0 else -5.0], dtype=torch.float64),
                             requires_grad=False)
result = train(hvd.elastic.TorchState(model, epoch=0, processed=0, step=0))
dump(f"final-{hvd.rank()}.json", {"w": result, "rank": hvd.rank(), "attempt": ATTEMPT})
hvd.shutdown()
