"""One rank of a job started by some engine (torchrun, srun, mpirun, Ray, Spark, ...).

    python job.py [--init auto|torch-first|explicit] [--init-method URL] [--size N] [--train]
                  [--die-once MARKER]

Checks, on every rank: the world has ``--size`` ranks; allreduces of lengths 0, 1, 7 and
100,003 are exact in closed form (rank r contributes r + 1); broadcast from the last rank;
the job's key-value client carries rank 0's object to every rank; with ``--train``, five SGD
steps of ``ringflow.torch.DistributedOptimizer`` on a shard of the global batch leave the same
parameters as one process training on the whole global batch (to 1e-5). Prints ``PASS rank
r/n local lr/ls cross cr/cs via DETECTOR`` and exits 0, or raises. With ``--die-once``, the
process of global rank 1 (``RANK``) SIGKILLs itself before ``init()`` if ``MARKER`` does not
exist yet, creating it: a launcher that restarts its workers runs the job once more.
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np


def train_matches_one_process(rf) -> None:
    import torch

    import ringflow.torch as hvd

    torch.manual_seed(0)
    r, n = rf.rank(), rf.size()
    data = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(1))
    target = data @ torch.arange(8.0) + 1.0

    def model() -> torch.nn.Module:
        torch.manual_seed(2)
        return torch.nn.Linear(8, 1)

    def step(m, opt, x, y) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x).squeeze(1), y).backward()
        opt.step()

    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    mine = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.05),
                                   named_parameters=mine.named_parameters())
    hvd.broadcast_parameters(mine.state_dict(), root_rank=0)
    for _ in range(5):
        step(ref, ref_opt, data, target)
        step(mine, opt, data[4 * r:4 * r + 4], target[4 * r:4 * r + 4])
    for (name, a), b in zip(mine.named_parameters(), ref.parameters(), strict=True):
        if not torch.allclose(a, b, atol=1e-5):
            raise AssertionError(f"rank {r}: {name} differs from one process on the global "
                                 f"batch: {a.detach().numpy()} vs {b.detach().numpy()}")


def checks(rf, size: int | None = None, train: bool = False) -> str:
    """Every check of the module doc on this rank of the initialised job ``rf`` (ringflow); the
    PASS line, or raises. Engines that run a function rather than this file (Ray Train, Spark)
    call it from there."""
    r, n = rf.rank(), rf.size()
    if size is not None and n != size:
        raise AssertionError(f"rank {r}: the job has {n} ranks, expected {size}")
    for length in (0, 1, 7, 100_003):
        got = rf.allreduce(np.full(length, r + 1.0), name=f"sum.{length}", op=rf.Sum)
        if not np.array_equal(got, np.full(length, n * (n + 1) / 2)):
            raise AssertionError(f"rank {r}: allreduce of {length} gave {got[:3]}")
    got = rf.broadcast(np.arange(5.0) + r, root_rank=n - 1, name="bcast")
    if not np.array_equal(got, np.arange(5.0) + n - 1):
        raise AssertionError(f"rank {r}: broadcast gave {got}")
    client = rf.get_client()
    if r == 0:
        client.user_set("hello", {"from": 0, "size": n})
    if client.user_get("hello") != {"from": 0, "size": n}:
        raise AssertionError(f"rank {r}: the key-value client gave {client.user_get('hello')}")
    # Rank 0 may host the store (the env:// contract without torch): it must not leave before
    # every rank has read the key (seen under load: rank 1's get met a closed store).
    rf.barrier()
    if train:
        train_matches_one_process(rf)
    return (f"PASS rank {r}/{n} local {rf.local_rank()}/{rf.local_size()} cross "
            f"{rf.cross_rank()}/{rf.cross_size()} via {rf.runtime.info().detector}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init", default="auto", choices=("auto", "torch-first", "explicit"))
    p.add_argument("--init-method", default=None)
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--train", action="store_true")
    p.add_argument("--die-once", default=None)
    args = p.parse_args()
    if args.die_once and os.environ.get("RANK") == "1" and not os.path.exists(args.die_once):
        open(args.die_once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    import ringflow as rf

    if args.init == "torch-first":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rf.init()
    elif args.init == "explicit":
        rf.init(rank=int(os.environ["JOB_RANK"]), size=int(os.environ["JOB_SIZE"]),
                init_method=args.init_method)
    else:
        rf.init()
    print(checks(rf, args.size, args.train), flush=True)
    rf.shutdown()
    if args.init == "torch-first":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
