"""torch.distributed's own API on backend="ringflow", every rank checking closed forms.

    python collectives.py                          # env:// (ringflow-run, torchrun)
    python collectives.py --init tcp://127.0.0.1:PORT --rank R --size N
    python collectives.py --init file:///tmp/x --rank R --size N
    python collectives.py --ringflow-first         # hvd.init() before init_process_group

Rank r contributes values built from r, so every result has a closed form in (n, r). Lengths
cover 0, 1, odd and larger; dtypes the integer, float, half and bool families. Prints
``PASS rank r/n <checks> checks via <init>`` (``... after hvd.init()`` with ``--ringflow-first``)
on success; any failure raises, naming the rank.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

import ringflow
import ringflow.torch  # registers backend "ringflow"
from ringflow.errors import MismatchError, TensorError

LENGTHS = (0, 1, 7, 1001)
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.uint8)
CHECKS = [0]


def expect(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    CHECKS[0] += 1
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got} want {want}")


def ok(cond: bool, what: str) -> None:
    CHECKS[0] += 1
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def ar(length: int, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    return (torch.arange(length) + start).to(dtype)


def all_reduce(n: int, r: int) -> None:
    tri = n * (n + 1) // 2
    for length in LENGTHS:
        for dtype in DTYPES:
            small = length if dtype not in (torch.uint8, torch.float16, torch.bfloat16) else (
                min(length, 7))  # values stay exact in 8-bit and half types
            x = ar(small, dtype, r + 1)
            dist.all_reduce(x)  # SUM by default, in place
            expect(x, (n * torch.arange(small) + tri).to(dtype), f"all_reduce {dtype} {small}")
            x = ar(small, dtype, r)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            expect(x, ar(small, dtype, n - 1), f"all_reduce MAX {dtype}")
            x = ar(small, dtype, r)
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
            expect(x, ar(small, dtype), f"all_reduce MIN {dtype}")
        x = torch.full((length,), float(r + 2), dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
        prod = float(torch.arange(2, n + 2, dtype=torch.float64).prod())
        expect(x, torch.full((length,), prod, dtype=torch.float64), "all_reduce PRODUCT")
        x = torch.full((length,), 2.0 * (r + 1))  # sum n(n+1): AVG n + 1, exact
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        expect(x, torch.full((length,), float(n + 1)), "all_reduce AVG")
    b = torch.tensor([r == 0, r == 1, False])
    dist.all_reduce(b)  # bool SUM is a logical or
    expect(b, torch.tensor([True, n > 1, False]), "all_reduce bool")
    s = torch.tensor(float(r))  # 0-dim
    dist.all_reduce(s)
    expect(s, torch.tensor(float(n * (n - 1) // 2)), "all_reduce 0-dim")
    base = torch.arange(12, dtype=torch.float32).view(3, 4) * (r + 1)
    view = base.t()  # non-contiguous: the result lands in the caller's view
    dist.all_reduce(view)
    expect(base, torch.arange(12, dtype=torch.float32).view(3, 4) * tri, "all_reduce of a view")
    for dtype in (torch.float32, torch.int64):
        x = ar(5, dtype, r)
        work = dist.all_reduce(x, async_op=True)
        ok(work.wait() is True, "work.wait() returns True")
        ok(work.is_completed() and work.is_success() and work.exception() is None, "work state")
        value = work.get_future().wait()
        ok(isinstance(value, list) and value[0] is x, "future value is [tensor]")
        expect(x, (n * torch.arange(5) + n * (n - 1) // 2).to(dtype), f"async all_reduce {dtype}")
    # several in flight at once, waited in reverse
    xs = [torch.full((3,), float(r * k)) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    for k, x in enumerate(xs):
        expect(x, torch.full((3,), float(k * n * (n - 1) // 2)), "in-flight all_reduces")
    futs = [dist.all_reduce(torch.ones(2), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2) for _ in range(3)]
    for f in futs:
        expect(f.wait(), torch.full((2,), 2.0 * n), "future.then")


def coalesced(n: int, r: int) -> None:
    """torch's coalescing manager: all_reduce, all_gather_into_tensor and reduce_scatter_tensor
    blocks become one grouped ringflow operation; with a device, the block's Works become one."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    tri = n * (n + 1) // 2
    for device in (None, torch.device("cpu")):
        xs = [torch.full((k,), float(r + 1)) for k in (0, 1, 5)]
        with _coalescing_manager(device=device, async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x)
        cm.wait()
        for x in xs:
            expect(x, torch.full((x.numel(),), float(tri)), "coalesced all_reduce")
        outs = [torch.empty(n * k) for k in (1, 3)]
        with _coalescing_manager(device=device):
            for k, out in zip((1, 3), outs, strict=True):
                dist.all_gather_into_tensor(out, torch.full((k,), float(r)))
        for k, out in zip((1, 3), outs, strict=True):
            expect(out, torch.arange(n).repeat_interleave(k).float(), "coalesced all_gather")
        outs = [torch.empty(k) for k in (2, 3)]
        with _coalescing_manager(device=device):
            for k, out in zip((2, 3), outs, strict=True):
                dist.reduce_scatter_tensor(out, torch.full((n * k,), float(r + 1)))
        for k, out in zip((2, 3), outs, strict=True):
            expect(out, torch.full((k,), float(tri)), "coalesced reduce_scatter_tensor")


def rooted(n: int, r: int) -> None:
    for q in range(n):
        for length in (0, 1, 7):
            x = torch.full((length,), float(r))
            dist.broadcast(x, src=q)
            expect(x, torch.full((length,), float(q)), f"broadcast from {q}")
            x = ar(length, torch.int64, r)
            dist.reduce(x, dst=q)
            want = (n * torch.arange(length) + n * (n - 1) // 2) if r == q else ar(length,
                                                                                  torch.int64, r)
            expect(x, want, f"reduce to {q} (elsewhere unchanged)")
            x = ar(length, torch.float32, r)
            dist.reduce(x, dst=q, op=dist.ReduceOp.MAX)
            expect(x, ar(length, torch.float32, n - 1 if r == q else r), "reduce MAX")
            gathered = [torch.empty(length, 2) for _ in range(n)] if r == q else None
            dist.gather(ar(2 * length, torch.float32, 100 * r).view(length, 2), gathered, dst=q)
            if r == q:
                for i, g in enumerate(gathered):
                    expect(g, ar(2 * length, torch.float32, 100 * i).view(length, 2),
                           f"gather piece {i}")
            out = torch.empty(length, dtype=torch.int32)
            pieces = [ar(length, torch.int32, 10 * i + q) for i in range(n)] if r == q else None
            dist.scatter(out, pieces, src=q)
            expect(out, ar(length, torch.int32, 10 * r + q), f"scatter from {q}")
        work = dist.broadcast(torch.full((4,), float(r)), src=q, async_op=True)
        ok(work.wait() and work.get_future().wait()[0].eq(q).all().item(), "async broadcast")
    if n > 1:
        b = torch.tensor([r == 1], dtype=torch.bool)
        dist.broadcast(b, src=1)
        expect(b, torch.tensor([True]), "broadcast bool")


def gathers(n: int, r: int) -> None:
    for length in LENGTHS:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            mine = ar(min(length, 7) if dtype == torch.bfloat16 else length, dtype, 100 * r)
            outs = [torch.empty_like(mine) for _ in range(n)]
            dist.all_gather(outs, mine)
            for i, o in enumerate(outs):
                expect(o, ar(mine.numel(), dtype, 100 * i), f"all_gather {dtype} piece {i}")
            flat = torch.empty(n * mine.numel(), dtype=dtype)
            dist.all_gather_into_tensor(flat, mine)
            expect(flat, torch.cat([ar(mine.numel(), dtype, 100 * i) for i in range(n)]),
                   "all_gather_into_tensor")
            stacked = torch.empty(n, mine.numel(), dtype=dtype)
            dist.all_gather_into_tensor(stacked, mine)
            expect(stacked, flat.view(n, -1), "all_gather_into_tensor stacked")
    outs = [torch.empty((), dtype=torch.int64) for _ in range(n)]
    dist.all_gather(outs, torch.tensor(r))
    expect(torch.stack(outs), torch.arange(n), "all_gather 0-dim")
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    ok(objs == [{"rank": i} for i in range(n)], "all_gather_object")
    box = [f"from {r}"]
    dist.broadcast_object_list(box, src=n - 1)
    ok(box == [f"from {n - 1}"], "broadcast_object_list")


def scatters(n: int, r: int) -> None:
    for length in (0, 1, 7):
        for dtype in (torch.float32, torch.int32):
            out = torch.empty(length, dtype=dtype)
            dist.reduce_scatter(out, [ar(length, dtype, r + 10 * i) for i in range(n)])
            want = (n * torch.arange(length) + n * (n - 1) // 2 + 10 * n * r).to(dtype)
            expect(out, want, f"reduce_scatter {dtype}")
            out = torch.empty(length, dtype=dtype)
            dist.reduce_scatter_tensor(out, ar(n * length, dtype, r))
            want = (n * torch.arange(r * length, (r + 1) * length) + n * (n - 1) // 2).to(dtype)
            expect(out, want, "reduce_scatter_tensor")
            out = torch.empty(length, dtype=dtype)
            dist.reduce_scatter_tensor(out, ar(n * length, dtype, r), op=dist.ReduceOp.MAX)
            expect(out, ar(length, dtype, r * length + n - 1), "reduce_scatter_tensor MAX")
    # uneven pieces: rank q's output has q + 1 elements
    out = torch.empty(r + 1)
    dist.reduce_scatter(out, [torch.full((i + 1,), float(r + i)) for i in range(n)])
    expect(out, torch.full((r + 1,), float(n * (n - 1) // 2 + n * r)), "reduce_scatter uneven")
    # all_to_all_single: even split, then rank i sends i + 1 rows to every rank
    x = torch.arange(2 * n, dtype=torch.float32).view(n, 2) + 100 * r
    out = torch.empty(n, 2)
    dist.all_to_all_single(out, x)
    expect(out, torch.stack([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * i for i in range(n)]),
           "all_to_all_single")
    send = [r + 1] * n
    recv = [i + 1 for i in range(n)]
    x = torch.full((n * (r + 1), 3), float(r))
    out = torch.empty(sum(recv), 3)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    expect(out, torch.cat([torch.full((i + 1, 3), float(i)) for i in range(n)]),
           "all_to_all_single with splits")
    outs = [torch.empty(i + 1, dtype=torch.int64) for i in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), 10 * r + i) for i in range(n)])
    for i, o in enumerate(outs):
        expect(o, torch.full((i + 1,), 10 * i + r), f"all_to_all piece {i}")
    dist.barrier()
    ok(dist.barrier(async_op=True).wait(), "async barrier")


def point_to_point(n: int, r: int) -> None:
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    for length in LENGTHS:
        got = torch.empty(length, dtype=torch.int64)
        works = [dist.isend(ar(length, torch.int64, 1000 * r), nxt),
                 dist.irecv(got, prv)]
        for w in works:
            ok(w.wait() is True, "p2p wait")
            ok(w.is_completed(), "p2p is_completed")
        expect(got, ar(length, torch.int64, 1000 * prv), f"isend/irecv ring {length}")
    # blocking send/recv between 0 and 1; tags keep two messages apart
    if r == 0:
        dist.send(torch.tensor([1.0]), 1, tag=7)
        dist.send(torch.tensor([2.0]), 1, tag=8)
        back = torch.empty(3)
        dist.recv(back, src=1)
        expect(back, torch.tensor([3.0, 4.0, 5.0]), "recv from 1")
    elif r == 1:
        a, b = torch.empty(1), torch.empty(1)
        w8 = dist.irecv(b, src=0, tag=8)
        w7 = dist.irecv(a, src=0, tag=7)
        w8.wait()
        w7.wait()
        expect(torch.cat([a, b]), torch.tensor([1.0, 2.0]), "tags")
        dist.send(torch.tensor([3.0, 4.0, 5.0]), 0)
    # batch_isend_irecv: a ring in both directions
    left, right = torch.empty(2), torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), nxt),
           dist.P2POp(dist.isend, torch.full((2,), float(-r)), prv),
           dist.P2POp(dist.irecv, left, prv),
           dist.P2POp(dist.irecv, right, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    expect(left, torch.full((2,), float(prv)), "batch_isend_irecv from the left")
    expect(right, torch.full((2,), float(-nxt)), "batch_isend_irecv from the right")
    # a non-contiguous receive buffer
    buf = torch.zeros(3, 2)
    works = [dist.isend(torch.arange(3.0) + r, nxt), dist.irecv(buf.t()[0], prv)]
    for w in works:
        w.wait()
    expect(buf[:, 0], torch.arange(3.0) + prv, "irecv into a view")


def groups(n: int, r: int) -> None:
    world = dist.new_group()  # every rank: a group of its own, sequence apart
    x = torch.ones(2)
    dist.all_reduce(x, group=world)
    expect(x, torch.full((2,), float(n)), "new_group() of everyone")
    ends = dist.new_group([0, n - 1]) if n > 1 else dist.new_group([0])
    members = sorted({0, n - 1})
    if r in members:
        ok(dist.get_rank(ends) == members.index(r) and dist.get_world_size(ends) == len(members),
           "group rank and size")
        ok(dist.get_process_group_ranks(ends) == members, "group ranks")
        x = torch.full((3,), float(r + 1))
        dist.all_reduce(x, group=ends)
        expect(x, torch.full((3,), float(sum(m + 1 for m in members))), "all_reduce in a group")
        x = torch.full((2,), float(r))
        dist.broadcast(x, src=n - 1, group=ends)  # src is a global rank
        expect(x, torch.full((2,), float(n - 1)), "broadcast in a group, global src")
        outs = [torch.empty(1) for _ in members]
        dist.all_gather(outs, torch.tensor([float(r)]), group=ends)
        expect(torch.cat(outs), torch.tensor([float(m) for m in members]), "all_gather in group")
        g = [torch.empty(1) for _ in members] if r == n - 1 else None
        dist.gather(torch.tensor([float(r)]), g, dst=n - 1, group=ends)
        if g is not None:
            expect(torch.cat(g), torch.tensor([float(m) for m in members]), "gather in group")
        if len(members) == 2:  # p2p inside the group, on the group's own tag space
            other = members[1 - members.index(r)]
            got = torch.empty(1)
            works = [dist.isend(torch.tensor([float(r)]), other, group=ends),
                     dist.irecv(got, other, group=ends)]
            for w in works:
                w.wait()
            expect(got, torch.tensor([float(other)]), "p2p in a group")
        dist.barrier(group=ends)
    else:
        ok(ends == dist.GroupMember.NON_GROUP_MEMBER, "non-members get NON_GROUP_MEMBER")
    if n > 2:  # a group without rank 0 (ringflow's coordinator)
        rest = dist.new_group(list(range(1, n)))
        if r > 0:
            x = torch.full((2,), float(r))
            dist.all_reduce(x, group=rest)
            expect(x, torch.full((2,), float(sum(range(1, n)))), "group without rank 0")
    subs, _ = dist.new_subgroups_by_enumeration([[i] for i in range(n)])
    x = torch.full((1,), float(r))
    dist.all_reduce(x, group=subs)
    expect(x, torch.full((1,), float(r)), "subgroups of one rank")
    x = torch.full((2,), float(r + 1))
    dist.all_reduce(x)  # the default group's order is untouched by the groups' operations
    expect(x, torch.full((2,), float(n * (n + 1) // 2)), "default group after groups")


def errors(n: int, r: int) -> None:
    if n == 1:
        return
    # ranks that call different collectives at the same point: one MismatchError everywhere
    try:
        if r == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)
        raise AssertionError(f"rank {r}: mismatched collectives did not fail")
    except MismatchError as exc:
        ok("ranks disagree on collective" in str(exc), f"mismatch text: {exc}")
    try:
        dist.all_reduce(torch.ones(3 + (r == 1)))
        raise AssertionError(f"rank {r}: mismatched shapes did not fail")
    except MismatchError as exc:
        ok("ranks disagree on shape" in str(exc), f"shape mismatch text: {exc}")
    work = dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND,
                           async_op=True)
    try:
        work.wait()
        raise AssertionError(f"rank {r}: BAND did not fail")
    except TensorError as exc:
        ok("ReduceOp" in str(exc) and "not supported" in str(exc), f"BAND text: {exc}")
    ok(work.is_completed() and not work.is_success() and work.exception() is not None,
       "a failed work's state")
    try:
        work.get_future().wait()
        raise AssertionError("the future of a failed work did not raise")
    except TensorError:
        CHECKS[0] += 1
    try:  # a dtype ringflow does not move, on one rank: every rank fails alike
        dist.all_reduce(torch.ones(2, dtype=torch.uint32 if r == 1 else torch.int64))
        raise AssertionError(f"rank {r}: uint32 did not fail")
    except TensorError as exc:
        ok("uint32" in str(exc), f"dtype text: {exc}")
    try:
        dist.recv(torch.empty(1))
        raise AssertionError("recv from any source did not raise")
    except NotImplementedError as exc:
        ok("pass src=" in str(exc), "any-source text")
    x = torch.full((2,), float(r))
    dist.all_reduce(x)  # and the job goes on
    expect(x, torch.full((2,), float(n * (n - 1) // 2)), "all_reduce after errors")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", default="env://")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--size", type=int)
    parser.add_argument("--ringflow-first", action="store_true")
    args = parser.parse_args()
    kwargs = {} if args.rank is None else {"rank": args.rank, "world_size": args.size}
    if args.ringflow_first:
        ringflow.torch.init()  # the backend then runs on this engine
    dist.init_process_group("ringflow", init_method=args.init,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    n, r = dist.get_world_size(), dist.get_rank()
    ok(dist.get_backend() == "ringflow" and (ringflow.rank(), ringflow.size()) == (r, n),
       "ringflow runs as torch's rank and size")
    for part in (all_reduce, coalesced, rooted, gathers, scatters, point_to_point, groups, errors):
        part(n, r)
    # the trap of a literal port: Horovod-style allreduce averages, torch's all_reduce sums
    x = torch.ones(2)
    dist.all_reduce(x)
    expect(x, torch.full((2,), float(n)), "torch's all_reduce sums")
    expect(ringflow.torch.allreduce(torch.ones(2)), torch.ones(2), "hvd.allreduce averages")
    dist.destroy_process_group()
    ok(ringflow.is_initialized() == args.ringflow_first,
       "destroy_process_group shuts ringflow down if (and only if) the backend started it")
    ringflow.shutdown()
    first = " after hvd.init()" if args.ringflow_first else ""
    print(f"PASS rank {r}/{n} {CHECKS[0]} checks via {args.init.split(':')[0]}{first}", flush=True)


if __name__ == "__main__":
    main()
