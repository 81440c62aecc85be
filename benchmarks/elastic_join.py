"""A worker joins a running elastic job (issue 30): the time from its request to the first step
at the larger size, against the goal of 1 s plus the state's size over loopback bandwidth.

    python benchmarks/elastic_join.py [--rounds 3] [--model mlp] [--steps 30] [--add-at 4]

``ringflow-run --min-np 2 --max-np 3 --host-discovery-script S`` trains
``examples/pytorch_synthetic_benchmark.py``'s model (``mlp``: 25.2 M parameters; SGD with
momentum; a synthetic batch of ``--batch-size`` a rank) with ``DistributedOptimizer``,
``hvd.elastic.TorchState(model, optimizer, step)`` and ``commit()`` after every step. S lists
``localhost:2``; after step ``--add-at`` rank 0 adds ``127.0.0.1:1`` (this machine under a
second name: a host of its own, so the newcomer's links are TCP on loopback, not shared memory).
The newcomer starts as users' scripts do (``hvd.init()`` first, then the model), receives the
parameters and the optimizer's momentum from its peers (``sync()``), and trains.

Measured per run: ``join_s``, from the newcomer's request (the time just before its
``hvd.init()``) to the first step completed at size 3; ``state_bytes`` (parameters and momentum);
and once, ``loopback_gbps``: one TCP stream of 256 MiB through 127.0.0.1 in this process. The
goal is ``join_s <= 1 + state_bytes / loopback bandwidth``. The record (``benchmarks/records.py``,
benchmark ``elastic_join``) has the medians and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import records  # this directory's (a script's first path)

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F
    from pytorch_synthetic_benchmark import build_model, synthetic_batch

    import ringflow.torch as hvd

    out = Path(args.out)
    me = os.environ["RINGFLOW_ELASTIC_ID"]
    asked = time.time()
    hvd.init()
    placed = time.time()
    torch.manual_seed(0)
    model = build_model(args.model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = synthetic_batch(args.model, args.batch_size)
    state = hvd.elastic.TorchState(model, opt, step=0)
    (out / f"ask-{me}.json").write_text(json.dumps({"t": asked, "placed": placed,
                                                    "built": time.time()}))

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < args.steps:
            start = time.time()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            with open(out / f"log-{me}.jsonl", "a") as f:
                f.write(json.dumps({"step": state.step, "size": hvd.size(), "start": start,
                                    "done": time.time()}) + "\n")
            if hvd.rank() == 0 and state.step == args.add_at:
                with open(out / "hosts", "a") as f:
                    f.write("127.0.0.1:1\n")
            state.commit()

    train(state)
    if hvd.rank() == 0:
        momentum = sum(s["momentum_buffer"].numel() * s["momentum_buffer"].element_size()
                       for s in opt.state.values() if s.get("momentum_buffer") is not None)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        (out / "state.json").write_text(json.dumps({"bytes": params + momentum}))
    hvd.shutdown()


def job(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rf-elastic-join-") as tmp:
        out = Path(tmp)
        (out / "hosts").write_text("localhost:2\n")
        script = out / "hosts.sh"
        script.write_text(f"#!/bin/sh\ncat {out / 'hosts'}\n")
        script.chmod(0o755)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringflow.runner", "--min-np", "2", "--max-np", "3",
             "--host-discovery-script", str(script), sys.executable, str(Path(__file__)),
             "--worker", "--out", str(out), "--model", args.model, "--steps", str(args.steps),
             "--add-at", str(args.add_at), "--batch-size", str(args.batch_size)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"failed": f"the job did not end within {args.timeout:g} s"}
        if proc.returncode:
            return {"failed": f"exit code {proc.returncode}: {err.strip().splitlines()[-1:]}"}
        asks = sorted((json.loads(p.read_text()) for p in out.glob("ask-*.json")),
                      key=lambda a: a["t"])
        logs = [json.loads(line) for p in out.glob("log-*.jsonl")
                for line in p.read_text().splitlines()]
        state_bytes = json.loads((out / "state.json").read_text())["bytes"]
    if len(asks) != 3:
        return {"failed": f"{len(asks)} workers started, not 3"}
    first = min((r for r in logs if r["size"] == 3), key=lambda r: r["done"], default=None)
    if first is None:
        return {"failed": "the job ended before the newcomer joined (more --steps)"}
    new = asks[-1]
    # The parts: waiting for the members' next commit and the new generation; the script's own
    # model and optimizer (built after hvd.init(), as users' scripts do); sync(); the step.
    parts = {"generation": new["placed"] - new["t"], "build": new["built"] - new["placed"],
             "sync": first["start"] - new["built"], "step": first["done"] - first["start"]}
    got = {"join_s": first["done"] - new["t"], "state_bytes": state_bytes, "parts_s": parts}
    print(f"  join -> first step at size 3: {got['join_s']:.2f} s (state "
          f"{state_bytes / 2**20:.0f} MiB; " + ", ".join(f"{k} {v:.2f} s" for k, v in
                                                       got["parts_s"].items()) + ")",
          file=sys.stderr, flush=True)
    return got


def loopback_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes a second through one TCP stream on 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    got = [0]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            while got[0] < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got[0] += n

    reader = threading.Thread(target=drain)
    reader.start()
    chunk = bytes(1 << 20)
    with socket.create_connection(server.getsockname()) as conn:
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            conn.sendall(chunk)
        reader.join()
        seconds = time.perf_counter() - start
    server.close()
    return nbytes / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--add-at", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    bandwidth = loopback_bandwidth()
    runs = [job(args, env) for _ in range(args.rounds)]
    done = [r for r in runs if "failed" not in r]
    figures: dict[str, Any] = {"model": args.model, "rounds": args.rounds, "steps": args.steps,
                               "add_at": args.add_at, "batch_size": args.batch_size,
                               "loopback_gbps": bandwidth * 8 / 1e9, "runs": runs,
                               "joined": len(done)}
    if done:
        state_bytes = done[0]["state_bytes"]
        goal = 1.0 + state_bytes / bandwidth
        join = statistics.median(r["join_s"] for r in done)
        figures.update(join_s=join, join_max_s=max(r["join_s"] for r in done),
                       state_bytes=state_bytes, goal_s=goal)
        print(f"joined {len(done)} of {len(runs)}: request -> first step at size 3 "
              f"{join:.2f} s median, {figures['join_max_s']:.2f} s max; goal {goal:.2f} s "
              f"(1 s + {state_bytes / 2**20:.0f} MiB at {bandwidth * 8 / 1e9:.1f} Gbit/s)")
    else:
        print(f"joined 0 of {len(runs)}: {runs[0]['failed']}")
    records.append("elastic_join", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
