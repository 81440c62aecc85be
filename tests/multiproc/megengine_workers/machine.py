"""One machine of a MegEngine-style job: ``python machine.py SCENARIO WORLD N RANK_START MASTER_IP
PORT OUT.json``, the same program on every machine, as MegEngine users run it.

The launcher-decorated function runs on this machine's ranks (ringflow.init() already done) and
returns what it saw; the script writes ``{"results": [...]}`` (this machine's ranks, in order)
or ``{"error": TYPE, "text": ...}`` when the launcher raised, to OUT.json.

Scenarios:
* ``job``: placement, a Sum allreduce (closed form), and the key-value client: every rank's
  picklable value read by every rank, a get that waits for a late set, a get that times out.
* ``pipeline``: a WORLD-stage model-parallel net over remote_send/remote_recv, three SGD steps;
  every rank also replays the whole model in one process and returns the largest difference of
  the loss and of each of its parameters' gradients (exact: 0.0).
* ``mismatch``: rank 1 expects another shape than rank 0 sends; both report the error.
* ``raise``: the last rank raises; the others wait in an allreduce.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import ringflow
from ringflow.errors import RingflowTimeoutError

SCENARIO, WORLD, N, START, MASTER, PORT, OUT = sys.argv[1:8]
EXTRA = dict(arg.split("=", 1) for arg in sys.argv[8:])  # launcher keywords for error cases


def job() -> dict:
    r, n = ringflow.rank(), ringflow.size()
    total = ringflow.allreduce(np.full(5, r + 1.0), name="sum", op=ringflow.Sum)
    client = ringflow.get_client()
    client.user_set(f"from/{r}", {"rank": r, "array": np.arange(r + 1), "pair": (r, "x")})
    seen = []
    for q in range(n):
        value = client.user_get(f"from/{q}", timeout=60)
        seen.append(value["rank"] == q and value["array"].tolist() == list(range(q + 1))
                    and value["pair"] == (q, "x"))
    if r == n - 1:
        time.sleep(1.0)
        client.user_set("late", ["set", "after", 1.0, "s"])
    start = time.monotonic()
    late = client.user_get("late", timeout=60)
    waited = time.monotonic() - start
    start = time.monotonic()
    try:
        client.user_get("nobody/sets/this", timeout=0.5)
        timed_out = None
    except RingflowTimeoutError as exc:
        timed_out = [time.monotonic() - start, str(exc)]
    ringflow.barrier()  # nobody leaves while another still reads "late"
    return {"rank": r, "size": n, "local": [ringflow.local_rank(), ringflow.local_size()],
            "cross": [ringflow.cross_rank(), ringflow.cross_size()], "sum": total.tolist(),
            "seen": seen, "late": late, "waited": waited, "timed_out": timed_out}


def pipeline() -> dict:
    import torch

    import ringflow.torch as hvd

    r, n = hvd.rank(), hvd.size()
    widths = [5, 7, 4, 6, 3][: n + 1]
    torch.manual_seed(0)
    stages = [torch.nn.Linear(widths[i], widths[i + 1]) for i in range(n)]
    replay = [torch.nn.Linear(widths[i], widths[i + 1]) for i in range(n)]
    for mine, ref in zip(stages, replay, strict=True):
        ref.load_state_dict(mine.state_dict())
    # Each rank starts from other parameters; the broadcast of a generator (MegEngine's
    # bcast_list_) makes them rank 0's, the seeded ones.
    with torch.no_grad():
        for p in (p for stage in stages for p in stage.parameters()):
            p.add_(r)
    hvd.broadcast_parameters((p for stage in stages for p in stage.parameters()), root_rank=0)
    client = ringflow.get_client()
    opt = torch.optim.SGD(stages[r].parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for s in replay for p in s.parameters()], lr=0.1)
    diffs, losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, widths[0], generator=g)
        target = torch.randn(8, widths[-1], generator=g)
        # The whole model on one process: the reference.
        h = x
        for i, stage in enumerate(replay):
            h = stage(h) if i == n - 1 else torch.tanh(stage(h))
        ref_loss = ((h - target) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        # This rank's stage.
        opt.zero_grad()
        if r == 0:
            h = x
        elif r % 2:  # shape and dtype from the message
            h = hvd.remote_recv(r - 1)
        else:  # MegEngine's example: shape and dtype through the client, dtype by name
            h = hvd.remote_recv(r - 1, shape=client.user_get(f"shape/{step}/{r}", timeout=60),
                                dtype=client.user_get(f"dtype/{step}/{r}", timeout=60))
        out = stages[r](h)
        if r < n - 1:
            out = torch.tanh(out)
            if (r + 1) % 2 == 0:
                client.user_set(f"shape/{step}/{r + 1}", out.shape)
                client.user_set(f"dtype/{step}/{r + 1}", np.dtype("float32").name)
            token = hvd.remote_send(out, dest_rank=r + 1)
            token.backward()  # MegEngine's gm.backward([])
            loss = None
        else:
            loss = ((out - target) ** 2).mean()
            loss.backward()
            losses.append([loss.item(), ref_loss.item()])
        grads = [(p.grad - q.grad).abs().max().item()
                 for p, q in zip(stages[r].parameters(), replay[r].parameters(), strict=True)]
        params = [(p - q).abs().max().item()
                  for p, q in zip(stages[r].parameters(), replay[r].parameters(), strict=True)]
        diffs.append({"grads": grads, "params": params,
                      "loss": None if loss is None else abs(loss.item() - ref_loss.item())})
        opt.step()
        ref_opt.step()
    return {"rank": r, "size": n, "diffs": diffs, "losses": losses}


def mismatch() -> dict:
    import torch

    import ringflow.torch as hvd

    r = hvd.rank()
    try:
        if r == 0:
            hvd.remote_send(torch.arange(4.0), dest_rank=1)
        elif r == 1:
            hvd.remote_recv(0, shape=(5,), dtype="float32")
        return {"rank": r, "error": None}
    except ringflow.errors.RingflowError as exc:
        return {"rank": r, "error": [type(exc).__name__, str(exc)]}


def fail() -> dict:
    r, n = ringflow.rank(), ringflow.size()
    if r == n - 1:
        raise KeyError(f"rank {r} fails on purpose")
    ringflow.allreduce(np.ones(3), name="never")
    return {"rank": r}


def main() -> None:
    body = {"job": job, "pipeline": pipeline, "mismatch": mismatch, "raise": fail}[SCENARIO]
    kwargs: dict = {"world_size": int(WORLD), "n_gpus": int(N), "rank_start": int(START),
                    "master_ip": MASTER, "port": int(PORT), "timeout": 240}
    for key, value in EXTRA.items():
        kwargs[key] = float(value) if key.endswith("timeout") else value
    try:
        results = ringflow.launcher(**kwargs)(body)()
        data = {"results": results}
    except Exception as exc:
        data = {"error": type(exc).__name__, "text": str(exc)}
    with open(OUT, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    main()
