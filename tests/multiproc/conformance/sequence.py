"""One long-lived process per rank: 50 operations through ringflow.torch, 12 of which fail on
purpose (mismatch, bad root, duplicate name, bad splits, sparse Max, Adasum reducescatter, a
joined rank). Every other operation must give the exact result; every failure must be the
expected error on every rank that took part. Prints ``PASS <ops> ops <failures> failures``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import ringflow.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
tri = n * (n + 1) / 2
start = time.monotonic()
ops = failures = 0


def ok(name: str, got: torch.Tensor, want: np.ndarray) -> None:
    global ops
    ops += 1
    assert np.array_equal(got.numpy(), want), (name, got, want)


def fails(name: str, kind: type, fragment: str, fn) -> None:
    global ops, failures
    ops += 1
    try:
        fn()
    except kind as exc:
        assert isinstance(exc, hvd.HorovodInternalError) and fragment in str(exc), (name, exc)
        failures += 1
        return
    raise AssertionError(f"{name} did not fail")


x = torch.full((7,), r + 1.0)
for i in range(4):
    ok(f"ar{i}", hvd.allreduce(x, op=hvd.Sum, name=f"ar{i}"), np.full(7, tri))
fails("mismatch1", ValueError, "shape", lambda: hvd.allreduce(torch.ones(3 + r), name="mm1"))
ok("ag", hvd.allgather(torch.full((1, 2), r), name="ag"), np.repeat(np.arange(n), 2).reshape(-1, 2))
fails("badroot1", ValueError, "outside", lambda: hvd.broadcast(x, n, name="br1"))
for root in range(n):
    ok(f"bc{root}", hvd.broadcast(torch.full((3,), 10.0 * r), root, name=f"bc{root}"),
       np.full(3, 10.0 * root))
# Each rank in turn submits dup{q} and then again while it is surely in flight: the others
# submit theirs only after a barrier that follows the duplicate calls.
firsts = {}
for q in range(n):
    if r != q:
        hvd.barrier()
    firsts[q] = (hvd.allreduce_async(x, name=f"dup{q}", op=hvd.Sum),
                 hvd.grouped_allreduce_async([x, x], name=f"gdup{q}", op=hvd.Sum))
    if r == q:
        fails("dup1", ValueError, "in flight", lambda q=q: hvd.allreduce_async(x, name=f"dup{q}"))
        fails("dup2", ValueError, "in flight",
              lambda q=q: hvd.grouped_allreduce_async([x, x], name=f"gdup{q}"))
        hvd.barrier()
for q, (h, g) in firsts.items():
    if q == r:
        ok("dup.first", hvd.synchronize(h), np.full(7, tri))
        ok("gdup.first", hvd.synchronize(g)[1], np.full(7, tri))
    else:
        assert hvd.synchronize(h).tolist() == [tri] * 7 and hvd.synchronize(g)[0][0] == tri
rs = hvd.reducescatter(torch.ones(2 * n, 3) * (r + 1), op=hvd.Sum, name="rs")
ok("rs", rs, np.full((2, 3), tri))
fails("adasum.rs1", ValueError, "only supports AVERAGE and SUM",
      lambda: hvd.reducescatter(torch.ones(2 * n, 3), op=hvd.Adasum, name="ars1"))
fails("adasum.rs2", ValueError, "only supports AVERAGE and SUM",
      lambda: hvd.grouped_reducescatter([torch.ones(2 * n)], op=hvd.Adasum, name="ars2"))
fails("splits", ValueError, "one per rank",
      lambda: hvd.alltoall(torch.ones(n + 1), splits=[1] * (n + 1), name="a2a.bad"))
got, recv = hvd.alltoall(torch.arange(n, dtype=torch.float32) + 10 * r, splits=[1] * n,
                         name="a2a")
ok("a2a", got, np.arange(n) * 10.0 + r)
sp = torch.sparse_coo_tensor([[r % 3]], torch.ones(1, 2), (3, 2), check_invariants=True)
fails("sparse.max", ValueError, "Sum or Average", lambda: hvd.allreduce(sp, op=hvd.Max, name="sp"))
dense = np.zeros((3, 2))
for q in range(n):
    dense[q % 3] += 1
ok("sparse.sum", hvd.allreduce(sp, op=hvd.Sum, name="sps").to_dense(), dense)
fails("mismatch2", ValueError, "dtype",
      lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if r else torch.float64),
                            name="mm2"))
fails("badroot2", ValueError, "outside", lambda: hvd.broadcast(x, -1, name="br2"))
if n & (n - 1) == 0:
    got = hvd.allreduce(torch.full((4,), 2.0), op=hvd.Adasum, name="adasum")
    ok("adasum", got, np.full(4, 2.0))  # parallel vectors average
else:
    ok("adasum.skipped", torch.zeros(1), np.zeros(1))
fails("mismatch3", ValueError, "op", lambda: hvd.allreduce(
    torch.ones(2), op=hvd.Sum if r else hvd.Max, name="mm3"))
while ops < 45:  # plain operations, so that the sequence has 50
    k = ops
    ok(f"fill{k}", hvd.allreduce(torch.full((k,), float(r)), op=hvd.Max, name=f"fill{k}"),
       np.full(k, n - 1.0))
# join: rank 0 joins first; the others reduce once more (one failing op on rank 0's side: none)
if r == 0:
    last = hvd.join()
    ops += 2
else:
    ok("join.sum", hvd.allreduce(torch.full((2,), r + 1.0), op=hvd.Sum, name="js"),
       np.full(2, tri - 1))
    if r == n - 1:
        time.sleep(0.2)  # the last to join
    last = hvd.join()
    ops += 1
ok("join.last", torch.tensor([last]), np.array([n - 1 if n > 1 else 0]))
fails("joined.gather.mismatch", ValueError, "shape",
      lambda: hvd.allgather(torch.ones(1, 2 + r), name="jg"))
ok("end", hvd.allreduce(x, op=hvd.Sum, name="end"), np.full(7, tri))
hvd.shutdown()
print(f"PASS {ops} ops {failures} failures in {time.monotonic() - start:.1f} s (rank {r})",
      flush=True)
