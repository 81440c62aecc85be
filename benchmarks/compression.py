"""Gradient compression on slow links (issue 27): steps/s between rate-limited namespace hosts.

    sudo python benchmarks/compression.py                      # 100mbit and 1gbit, mlp, 2 rounds
    sudo python benchmarks/compression.py --rates 100mbit --rounds 3 --model cnn
    python benchmarks/compression.py --accuracy                # accuracy only (loopback)
    python benchmarks/compression.py --no-hosts --peers ringflow ringflow-auto --rounds 8

Training steps of ``examples/pytorch_synthetic_benchmark.py``'s models (``mlp``: 25.2 M
parameters, ~100 MB of float32 gradients a step; ``cnn``: 0.4 M) on scikit-learn's digits
(upsampled to the model's input), 2 ranks, SGD, through these peers:

- ``ringflow``: ``DistributedOptimizer`` under ``ringflow-run``, uncompressed;
- ``ringflow-powersgd``, ``ringflow-auto``: the same under ``ringflow-run --compression
  powersgd:rank=4`` / ``auto`` (:mod:`ringflow.compressed`);
- ``ddp-fp16``: ``DistributedDataParallel`` on gloo with torch's ``fp16_compress_hook``;
- ``ddp-powersgd``: the same with torch's ``powerSGD_hook`` (rank 4, one bucket: with two or
  more it fails on gloo, issue 27); a failure is recorded as such.

Where: (1) 2 namespace hosts, one rank each, every link limited by ``tc`` to each ``--rates``
value (``tests/multihost/netns_cluster.py``, as ``benchmarks/multihost.py``); (2) loopback: both
ranks on this host (ringflow on shared memory, gloo on 127.0.0.1). Each round runs every peer
once, the order reversed every other round; the median steps/s per peer and its ratio to
``ringflow`` are printed. Then (3) accuracy: ``--epochs`` epochs on loopback, uncompressed and
PowerSGD, the final test accuracy of each (compression does not depend on the link): with
``--accuracy`` only, as a record of its own (``part``: ``speed`` or ``accuracy``).

The record (``benchmarks/records.py``, benchmark ``compression``) has ``steps_per_s`` per place
and peer (medians), ``ratio`` to ``ringflow`` there, ``mb_sent_per_step`` (rank 0's link's
``tx_bytes`` over the timed steps; on loopback, everything on ``lo``), ``accuracy`` per peer,
``round_ratio`` per peer (the median over rounds of its steps/s over that round's
``ringflow``: drift between rounds cancels), and ``shared_host``: the host was shared with other
developers' jobs, so compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import netns_cluster  # noqa: E402
import records  # noqa: E402  (this directory's)

PEERS = ("ringflow", "ringflow-powersgd", "ringflow-auto", "ddp-fp16", "ddp-powersgd")
COMPRESSION = {"ringflow": "none", "ringflow-powersgd": "powersgd:rank=4",
               "ringflow-auto": "auto"}
PORT = 29517


# the worker (one rank) -------------------------------------------------------------------------
def data(model: str, rank: int, size: int) -> tuple:
    """This rank's shard of digits' training set and the whole test set, shaped for ``model``."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.kron(digits.images / 16.0, np.ones((4, 4)))  # 8x8 -> 32x32
    x = torch.tensor(images, dtype=torch.float32)
    x = x.reshape(len(x), 1024) if model == "mlp" else x[:, None].expand(-1, 3, -1, -1)
    y = torch.tensor(digits.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0)
    return x_tr[rank::size].contiguous(), y_tr[rank::size], x_te, y_te


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from pytorch_synthetic_benchmark import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model)
    if args.peer.startswith("ddp"):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        os.environ.update(RANK=os.environ["RINGFLOW_RANK"],
                          WORLD_SIZE=os.environ["RINGFLOW_SIZE"], MASTER_ADDR=args.master,
                          MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=args.interface)
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        one_bucket = args.peer == "ddp-powersgd"
        model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=1024 if one_bucket else 25)
        if one_bucket:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
        barrier = dist.barrier
    else:
        import ringflow.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * size,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters())

        def barrier() -> None:
            hvd.allreduce(torch.zeros(1), name="bench.barrier")

    x, y, x_te, y_te = data(args.model, rank, size)
    batches = [(x[i:i + args.batch_size], y[i:i + args.batch_size])
               for i in range(0, len(x) - args.batch_size + 1, args.batch_size)]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()

    result: dict = {"peer": args.peer}
    if args.epochs:
        for _ in range(args.epochs):
            for xb, yb in batches:
                step(xb, yb)
        with torch.no_grad():
            result["accuracy"] = float((model(x_te).argmax(1) == y_te).float().mean())
    else:
        counter = f"/sys/class/net/{args.interface}/statistics/tx_bytes"  # this host's link

        def sent() -> int:
            with open(counter) as f:
                return int(f.read())

        for i in range(args.warmup):
            step(*batches[i % len(batches)])
        barrier()
        t0, tx0 = time.perf_counter(), sent()
        for i in range(args.steps):
            step(*batches[i % len(batches)])
        barrier()
        result["steps_per_s"] = args.steps / (time.perf_counter() - t0)
        result["mb_sent_per_step"] = (sent() - tx0) / args.steps / 1e6
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


# the driver ------------------------------------------------------------------------------------
def job(args: argparse.Namespace, peer: str, launcher: list[str], master: str, interface: str,
        env: dict[str, str], timeout: float, epochs: int = 0) -> dict | None:
    """One job of ``peer``; its rank 0's result, or None when it failed (reported)."""
    with tempfile.TemporaryDirectory(prefix="ringflow-bench-") as out:
        os.chmod(out, 0o755)
        flags = ["--compression", COMPRESSION[peer]] if peer in COMPRESSION else []
        cmd = [*launcher[:3], *flags, *launcher[3:], sys.executable, os.path.abspath(__file__),
               "--worker", "--peer", peer, "--model", args.model, "--out", out, "--master",
               master, "--interface", interface, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--epochs", str(epochs), "--lr", str(args.lr)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {peer}: timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
            return None
        path = os.path.join(out, "result.json")
        if proc.returncode or not os.path.exists(path):
            tail = (proc.stderr or proc.stdout)[-1500:]
            print(f"  {peer}: failed (code {proc.returncode}):\n{tail}", file=sys.stderr,
                  flush=True)
            return None
        with open(path) as f:
            return json.load(f)


def rounds(args: argparse.Namespace, place: str, launcher: list[str], master: str,
           interface: str, env: dict[str, str], timeout: float) -> dict:
    runs: dict[str, list[float]] = {}
    sent: dict[str, list[float]] = {}
    failed: set[str] = set()
    peers = tuple(args.peers)
    for r in range(args.rounds):
        order = peers if r % 2 == 0 else peers[::-1]
        for peer in order:
            if peer in failed:
                continue
            got = job(args, peer, launcher, master, interface, env, timeout)
            if got is None:
                failed.add(peer)
                continue
            runs.setdefault(peer, []).append(got["steps_per_s"])
            sent.setdefault(peer, []).append(got["mb_sent_per_step"])
            print(f"  {place} round {r + 1} {peer}: {got['steps_per_s']:.3f} steps/s, "
                  f"{got['mb_sent_per_step']:.2f} MB sent per step by rank 0's host",
                  file=sys.stderr, flush=True)
    medians = {p: statistics.median(v) for p, v in runs.items()}
    base = medians.get("ringflow")
    ratio = {p: round(v / base, 3) for p, v in medians.items()} if base else {}
    # Each round's ratio to that round's uncompressed run: the host's drift between rounds (a
    # shared machine) cancels out of it.
    paired = {p: [a / b for a, b in zip(v, runs["ringflow"], strict=False)]
              for p, v in runs.items() if "ringflow" in runs and len(v) == len(runs["ringflow"])}
    print(f"{place}: " + ", ".join(f"{p} {v:.3f} steps/s ({ratio.get(p, 0):.2f}x)"
                                   for p, v in medians.items())
          + (f"; failed: {', '.join(sorted(failed))}" if failed else ""), flush=True)
    return {"steps_per_s": {p: round(v, 4) for p, v in medians.items()}, "ratio": ratio,
            "mb_sent_per_step": {p: round(statistics.median(v), 3) for p, v in sent.items()},
            "round_ratio": {p: round(statistics.median(v), 3) for p, v in paired.items()},
            "all": runs, "failed": sorted(failed)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="*", default=["100mbit", "1gbit"])
    p.add_argument("--no-hosts", action="store_true",
                   help="loopback only (a record of its own: part 'loopback')")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                   help="the peers to run (default: all)")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accuracy", action="store_true", help="the accuracy runs only")
    p.add_argument("--epochs", type=int, default=10, help="of the accuracy runs")
    p.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--interface", default="lo", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    print("note: this host is shared with other developers' jobs (2 CPUs): compare the ratios "
          "of one run, not figures of different runs", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    figures: dict = {"model": args.model, "shared_host": True,
                     "part": "accuracy" if args.accuracy else
                     "loopback" if args.no_hosts else "speed"}
    local = [sys.executable, "-m", "ringflow.runner", "-np", "2"]
    per_step = 10 if args.model == "mlp" else 2  # seconds a step may take at 100 Mbit/s
    timeout = 120 + per_step * (args.steps + args.warmup) * 2
    if not args.accuracy:
        figures.update(rounds=args.rounds, steps=args.steps)
        figures["loopback"] = rounds(args, "loopback", local, "127.0.0.1", "lo", env, timeout)
    if not args.no_hosts and not args.accuracy:
        reason = netns_cluster.unavailable()
        if reason is not None:
            print(f"namespace hosts skipped: {reason}", file=sys.stderr)
        else:
            with netns_cluster.cluster(2) as c:
                launcher = netns_cluster.ringflow_run(c, {0: 1, 1: 1})
                for rate in args.rates:
                    with netns_cluster.shaped(c, rate):
                        scale = 10 if rate.startswith("100m") else 1
                        figures[rate] = rounds(args, rate, launcher, c.addresses[0],
                                               c.interface, env, timeout * scale)
    if args.accuracy:
        figures["accuracy"] = {}
        figures["epochs"] = args.epochs
        for peer in ("ringflow", "ringflow-powersgd"):
            got = job(args, peer, local, "127.0.0.1", "lo", env, 300 + 60 * args.epochs,
                      epochs=args.epochs)
            if got is not None:
                figures["accuracy"][peer] = got["accuracy"]
                print(f"accuracy after {args.epochs} epochs, {peer}: {got['accuracy']:.4f}",
                      flush=True)
    with contextlib.suppress(OSError):
        records.append("compression", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
