"""Elastic recovery against torchrun (issue 30): a worker SIGKILLed in the middle of a step, the
time until the next step completes, and what saving the state every step costs.

    python benchmarks/elastic_vs_torchrun.py [--rounds 3] [--model mlp] [--steps 14] [--kill-at 6]

Three workers on this machine train ``examples/pytorch_synthetic_benchmark.py``'s model (``mlp``:
25.2 M parameters; SGD with momentum; a synthetic batch of ``--batch-size`` a rank), alternating
rounds of the peers, each launcher with its defaults except what the comparison needs:

- ``ringflow``: ``ringflow-run --min-np 2 --max-np 3 --host-discovery-script`` (the script lists
  ``localhost:3``), ``DistributedOptimizer``, ``hvd.elastic.TorchState(model, optimizer, step)``
  and ``state.commit()`` after every step. The victim's death rolls the survivors back to the last
  commit in memory; they go on at size 2 in the same processes.
- ``torchrun``: ``torchrun --standalone --nproc-per-node 3 --max-restarts 3`` (one agent, its
  store on loopback), DDP on gloo (``GLOO_SOCKET_IFNAME=lo``: loopback only), a checkpoint every
  step (rank 0, ``torch.save`` of the model, the optimizer and the step, then a rename). The
  victim's death makes the agent restart every worker, which load the checkpoint (torchrun's
  documented way).
- ``torchrun-nnodes``: its elastic form, three agents of one worker each (three "nodes" on this
  machine), ``--nnodes 2:3 --max-restarts 3 --rdzv-backend c10d`` on a loopback endpoint
  (``--rdzv-conf last_call_timeout=2``: the default 30 s would only add waiting), the same worker.
  The victim's agent restarts its worker, and every agent restarts its own at the new
  rendezvous; all load the checkpoint.

Both torchrun forms run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default (torch 2.13)
the workers of every restart rendezvous in the agent's one TCPStore under the same keys
(``torch/distributed/rendezvous.py``: "We create a new TCPStore for every retry so no need to
add prefix", while ``dynamic_rendezvous.py`` keeps one shared server for the whole run), so
gloo's full mesh may read a dead worker's address: "Gloo connectFullMesh failed ...
Connection refused" until the restarts ran out, or a hang (0 of 4 recoveries here on
2026-11-27). With sharing off, each rendezvous round names a fresh store.

At ``--kill-at`` the worker of rank 1 writes the time and SIGKILLs itself after its backward pass.
Measured: from that time to the first step completed by the next world (the next generation; the
restarted workers) (``kill_to_step_s``); each step's duration and each save's (``commit()``,
which also agrees on host updates, an allreduce; or rank 0's checkpoint), before the kill:
``save_cost`` is the median save over the median step without it. A job that does not end
well (an exit code, or ``--timeout``) is a failed recovery, counted and shown with its last
error line. The record (``benchmarks/records.py``, benchmark ``elastic_vs_torchrun``) has both
per peer (medians over the recovered runs, ``recovered`` of ``runs``, and every round's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import records  # this directory's (a script's first path)

from ringflow.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("ringflow", "torchrun", "torchrun-nnodes")


# --- the workers -------------------------------------------------------------------------------
def _training(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F
    from pytorch_synthetic_benchmark import build_model, synthetic_batch

    torch.manual_seed(0)
    model = build_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = synthetic_batch(args.model, args.batch_size)
    return model, opt, (x, y), F.cross_entropy


def _log(out: Path, who: str, **fields: Any) -> None:
    with open(out / f"log-{who}.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")


def _die(out: Path, step: int) -> None:
    (out / "kill.json").write_text(json.dumps({"t": time.time(), "step": step}))
    os.kill(os.getpid(), signal.SIGKILL)


def ringflow_worker(args: argparse.Namespace) -> None:
    import ringflow.torch as hvd
    from ringflow import runtime

    out = Path(args.out)
    me = os.environ["RINGFLOW_ELASTIC_ID"]
    hvd.init()
    model, opt, (x, y), loss_fn = _training(args)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < args.steps:
            t0 = time.time()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if hvd.rank() == 1 and state.step == args.kill_at and not (out / "kill.json").exists():
                _die(out, state.step)
            opt.step()
            state.step += 1
            t1 = time.time()
            state.commit()
            _log(out, me, step=state.step, size=hvd.size(), start=t0, done=t1,
                 save=time.time() - t1, world=runtime.world().generation)

    train(state)
    hvd.shutdown()


def torchrun_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    # This process's start marks its world: after a failure every worker is a new process
    # (an agent that only saw the membership change keeps its restart count).
    world = time.time()
    model, opt, (x, y), loss_fn = _training(args)
    ckpt = out / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    while step < args.steps:
        t0 = time.time()
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        if rank == 1 and step == args.kill_at and not (out / "kill.json").exists():
            _die(out, step)
        opt.step()
        step += 1
        t1 = time.time()
        save = None
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", ckpt)
            save = time.time() - t1
        _log(out, f"{rank}-{os.getpid()}", step=step, size=size, start=t0, done=t1, save=save,
             world=world)
    dist.destroy_process_group()


# --- the jobs ----------------------------------------------------------------------------------
def _worker_argv(args: argparse.Namespace, peer: str, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--out", str(out),
            "--model", args.model, "--steps", str(args.steps), "--kill-at", str(args.kill_at),
            "--batch-size", str(args.batch_size)]


def job(args: argparse.Namespace, peer: str, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rf-elastic-bench-") as tmp:
        out = Path(tmp)
        if peer == "ringflow":
            script = out / "hosts.sh"
            script.write_text("#!/bin/sh\necho localhost:3\n")
            script.chmod(0o755)
            procs = [subprocess.Popen(
                [sys.executable, "-m", "ringflow.runner", "--min-np", "2", "--max-np", "3",
                 "--host-discovery-script", str(script), *_worker_argv(args, peer, out)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True)]
        else:
            env = dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see the module doc
            run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3"]
            worker = _worker_argv(args, "torchrun", out)[1:]
            if peer == "torchrun":
                commands = [[*run, "--standalone", "--nproc-per-node", "3", *worker]]
            else:
                endpoint = f"127.0.0.1:{free_port()}"
                commands = [[*run, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend",
                             "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", out.name,
                             "--local-addr", "127.0.0.1", "--rdzv-conf", "last_call_timeout=2",
                             *worker]] * 3
            procs = []
            for command in commands:
                procs.append(subprocess.Popen(
                    command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    text=True, start_new_session=True))
                time.sleep(1.0 if len(procs) == 1 and len(commands) > 1 else 0)  # its store
        try:
            errs = [p.communicate(timeout=args.timeout)[1] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher
            _kill_workers(out)  # torchrun's workers are not in its process group
            return _failed(peer, f"the job did not end within {args.timeout:g} s")
        codes = [p.returncode for p in procs]
        if any(codes):
            lines = [line for e in errs for line in e.splitlines() if "Error:" in line
                     and "ChildFailedError" not in line]  # the worker's, not the agent's
            return _failed(peer, f"exit codes {codes}: {(lines or ['?'])[0][-300:]}")
        kill = json.loads((out / "kill.json").read_text())
        logs = [json.loads(line) for path in out.glob("log-*.jsonl")
                for line in path.read_text().splitlines()]
    before = [r for r in logs if r["done"] < kill["t"]]
    # The next world's first step (a survivor may still complete the victim's step, where its
    # exchange was over before the kill: that is not a recovery).
    world = max(r["world"] for r in before)
    after = [r["done"] for r in logs if r["done"] > kill["t"] and r["world"] > world]
    step_s = statistics.median(r["done"] - r["start"] for r in before)
    save_s = statistics.median(r["save"] for r in before if r["save"] is not None)
    got = {"kill_to_step_s": min(after) - kill["t"], "step_s": step_s, "save_s": save_s,
           "save_cost": save_s / step_s, "sizes_after": sorted({r["size"] for r in logs
                                                               if r["world"] > world})}
    print(f"  {peer}: kill -> next step {got['kill_to_step_s']:.2f} s; step {step_s:.3f} s, "
          f"save {save_s * 1e3:.1f} ms ({got['save_cost']:.1%}); size after "
          f"{got['sizes_after']}", file=sys.stderr, flush=True)
    return got


def _kill_workers(out: Path) -> None:
    """SIGKILL every process whose command line names ``out`` (the job's workers)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(out).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def _failed(peer: str, why: str) -> dict[str, Any]:
    print(f"  {peer}: failed: {why}", file=sys.stderr, flush=True)
    return {"failed": why}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "ringflow":
        ringflow_worker(args)
        return 0
    if args.worker in ("torchrun", "torchrun-nnodes"):
        torchrun_worker(args)
        return 0
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    peers = tuple(args.peers)
    runs: dict[str, list[dict[str, Any]]] = {peer: [] for peer in peers}
    for r in range(args.rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            runs[peer].append(job(args, peer, env))
    figures: dict[str, Any] = {"peers": list(peers), "model": args.model, "rounds": args.rounds,
                               "steps": args.steps,
                               "kill_at": args.kill_at, "batch_size": args.batch_size}
    for peer, got in runs.items():
        done = [g for g in got if "failed" not in g]
        f = figures[peer] = {key: statistics.median(g[key] for g in done) if done else None
                             for key in ("kill_to_step_s", "step_s", "save_s", "save_cost")}
        f.update(all=got, recovered=len(done), runs=len(got))
        if done:
            print(f"{peer}: recovered {len(done)} of {len(got)}; kill -> next step "
                  f"{f['kill_to_step_s']:.2f} s (median), saving every step "
                  f"{f['save_cost']:.1%} of a step", flush=True)
        else:
            print(f"{peer}: recovered 0 of {len(got)}", flush=True)
    records.append("elastic_vs_torchrun", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
