"""A tour of torch.distributed's point-to-point and collective API on backend "ringflow".

    torchrun --standalone --nproc-per-node 3 examples/torch_distributed_tour.py
    ringflow-run -np 3 python examples/torch_distributed_tour.py

Every call is torch's own; ringflow's engine runs it. Each step prints what rank 0 got and checks
every rank's result against its closed form (rank r contributes r + 1, so a sum over n ranks is
n(n+1)/2). Ranks passed to torch are global ranks, in groups too. Needs 2 ranks or more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringflow.torch  # noqa: F401 - registers torch.distributed's backend "ringflow"


def show(what: str, got: torch.Tensor | list, want: torch.Tensor | list) -> None:
    same = (got == want) if isinstance(got, list) else torch.equal(got, want)
    if not same:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got}, want {want}")
    if dist.get_rank() == 0:
        print(f"{what:<40} {got}", flush=True)


def main() -> None:
    dist.init_process_group("ringflow")
    r, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        raise SystemExit("run it on 2 ranks or more (torchrun --nproc-per-node 3 ...)")
    tri = n * (n + 1) // 2
    nxt, prv = (r + 1) % n, (r - 1) % n

    # point to point ---------------------------------------------------------------------------
    got = torch.empty(3)
    works = [dist.isend(torch.full((3,), float(r)), dst=nxt), dist.irecv(got, src=prv)]
    for w in works:
        w.wait()  # a send completes once its receiver has the data
    show("isend/irecv around the ring", got, torch.full((3,), float(prv)))
    if r == 0:
        dist.send(torch.tensor([42.0]), dst=1, tag=5)
    elif r == 1:
        msg = torch.empty(1)
        dist.recv(msg, src=0, tag=5)
        print(f"rank 1 received {msg.item()} from rank 0 with tag 5", flush=True)
    left = torch.empty(1)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([float(r)]), nxt),
                                   dist.P2POp(dist.irecv, left, prv)])
    for req in reqs:
        req.wait()
    show("batch_isend_irecv", left, torch.tensor([float(prv)]))

    # collectives (in place, SUM by default) ----------------------------------------------------
    x = torch.tensor([float(r + 1)] * 2)
    dist.all_reduce(x)
    show("all_reduce (SUM)", x, torch.tensor([float(tri)] * 2))
    x = torch.tensor([float(r + 1)])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    show("all_reduce (MAX)", x, torch.tensor([float(n)]))
    x = torch.tensor([float(r)])
    dist.broadcast(x, src=n - 1)
    show(f"broadcast from rank {n - 1}", x, torch.tensor([float(n - 1)]))
    x = torch.tensor([float(r + 1)])
    dist.reduce(x, dst=0)
    show("reduce to rank 0", x, torch.tensor([float(tri if r == 0 else r + 1)]))
    outs = [torch.empty(1) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([float(r)]))
    show("all_gather", torch.cat(outs), torch.arange(n, dtype=torch.float32))
    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.tensor([float(r)] * 2))
    show("all_gather_into_tensor", flat, torch.arange(n).repeat_interleave(2).float())
    pieces = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([float(r * r)]), pieces, dst=0)
    if r == 0:
        show("gather to rank 0", torch.cat(pieces), torch.arange(n).float() ** 2)
    mine = torch.empty(1)
    dist.scatter(mine, [torch.tensor([10.0 * q]) for q in range(n)] if r == 0 else None, src=0)
    show("scatter from rank 0", mine, torch.tensor([10.0 * r]))
    mine = torch.empty(1)
    dist.reduce_scatter(mine, [torch.tensor([float(q + 1)]) for q in range(n)])
    show("reduce_scatter", mine, torch.tensor([float(n * (r + 1))]))
    out = torch.empty(n)
    dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + 10 * r)
    show("all_to_all_single", out, torch.arange(n, dtype=torch.float32) * 10 + r)
    box = [{"hello": "from rank 0"} if r == 0 else None]
    dist.broadcast_object_list(box, src=0)
    show("broadcast_object_list", box, [{"hello": "from rank 0"}])
    dist.barrier()

    # asynchronous work ---------------------------------------------------------------------------
    x = torch.ones(4)
    work = dist.all_reduce(x, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    work.wait()
    show("all_reduce(async_op=True) + future", doubled.wait(), torch.full((4,), 2.0 * n))

    # groups: ranks stay global ------------------------------------------------------------------
    ends = dist.new_group([0, n - 1])  # every rank calls new_group
    if r in (0, n - 1):
        x = torch.tensor([float(r)])
        dist.all_reduce(x, group=ends)
        show(f"all_reduce in group [0, {n - 1}]", x, torch.tensor([float(n - 1)]))
        dist.broadcast(x, src=n - 1, group=ends)

    dist.destroy_process_group()
    if r == 0:
        print("tour done", flush=True)


if __name__ == "__main__":
    main()
