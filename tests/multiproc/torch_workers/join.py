"""hvd.join between processes: every rank joins first in turn while the others run allreduce
and barrier (allgather and broadcast fail, as in Horovod, and the next operation works), under
names every rank negotiated before (cache bits) and under new names, then unnamed ones;
Horovod's test_horovod_join_allreduce, widened. Closed forms: rank r contributes r + 1. Prints
"PASS join: <n> checks" on every rank."""

from __future__ import annotations

import torch

import ringflow.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
checks = 0


def check(cond: bool, what: str) -> None:
    global checks
    if not cond:
        raise AssertionError(f"rank {r}: {what}")
    checks += 1


def ops(prefix: str | None, first: int | None) -> None:
    """allreduce, allgather, broadcast and barrier, named ``prefix.*`` (unnamed with None); rank
    ``first`` joined (None: nobody)."""
    others = n * (n + 1) // 2 - (0 if first is None else first + 1)  # a joined rank adds zeros
    root = 0 if first is None else (first + 1) % n  # every rank names the same root

    def name(kind: str) -> str | None:
        return None if prefix is None else f"{prefix}.{kind}"

    for dtype in (torch.int32, torch.float32):
        small = hvd.allreduce(torch.full((5,), r + 1, dtype=dtype), op=hvd.Sum,
                              name=name(f"small.{dtype}"))
        check(torch.equal(small, torch.full((5,), others, dtype=dtype)), f"{prefix} small {small}")
    big = hvd.allreduce(torch.full((70_001,), float(r + 1)), name=name("big"))  # Average
    check(torch.allclose(big, torch.full((70_001,), others / n)), f"{prefix} big {big[:3]}")
    def gather() -> torch.Tensor:
        return hvd.allgather(torch.full((r + 1, 2), float(r)), name=name("gather"))

    def bcast() -> torch.Tensor:
        return hvd.broadcast(torch.full((3,), float(r)), root, name=name("bcast"))

    if first is None:
        rows = gather()
        want = torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
        check(torch.equal(rows, want), f"{prefix} allgather {rows}")
        got = bcast()
        check(torch.equal(got, torch.full((3,), float(root))), f"{prefix} broadcast {got}")
    else:
        for kind, call in (("Allgather", gather), ("Broadcast", bcast)):
            try:
                call()
                check(False, f"{prefix}: {kind} after a join must fail")
            except RuntimeError as e:  # Horovod's tests catch RuntimeError
                check(f"{kind} is not supported with Join" in str(e), f"{kind} text: {e}")
    hvd.barrier()


for first in range(n):
    for warm in (False, True):
        if warm:  # every rank takes part: the next submissions are cache bits
            ops("cached", None)
        if r != first:
            ops("cached", first)
            ops(f"new.{first}.{warm}", first)
            ops(None, first)
        last = hvd.join()
        check(n == 1 or last != first, f"join returned the first rank to join ({last})")
        check(hvd.allgather_object(last) == [last] * n, "join returns one rank everywhere")
ops(None, None)  # unnamed operations pair up after the joins
print(f"PASS join: {checks} checks rank {r}/{n}")
