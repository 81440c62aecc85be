"""Every collective of ringflow.torch in sync, async and in-place forms, checked in closed form.

Run under ringflow-run with any number of ranks; rank r contributes values built from r + 1.
Prints "PASS collectives: <n> checks" on success; any failure raises (the launcher reports the
rank).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

import ringflow.torch as hvd
from ringflow.errors import RingflowError

hvd.init()
r, n = hvd.rank(), hvd.size()
S = n * (n + 1) / 2  # sum over ranks of (r + 1)
checks = 0


def check(cond: bool, what: str) -> None:
    global checks
    if not cond:
        raise AssertionError(f"rank {r}: {what}")
    checks += 1


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-6) -> None:
    check(a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs "
          f"{b.shape}/{b.dtype}")
    check(torch.allclose(a.double(), b.double(), atol=atol, rtol=1e-3), f"{what}: {a} vs {b}")


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]

# basics ---------------------------------------------------------------------------------------
check(hvd.is_initialized(), "is_initialized")
check(hvd.local_rank() == r and hvd.local_size() == n, "local rank/size on one host")
check(hvd.cross_rank() == 0 and hvd.cross_size() == 1, "cross rank/size on one host")
check(not hvd.gloo_built() and hvd.cuda_built() == (torch.cuda.is_available() or hvd.nccl_built()),
      "built flags")
check(hvd.is_homogeneous(), "homogeneous")

# allreduce: every dtype, sum and average, sync / async / in place -----------------------------
for dtype in FLOATS + INTS:
    x = torch.full((3, 5), r + 1, dtype=dtype)
    close(hvd.allreduce(x, op=hvd.Sum, name=f"s.{dtype}"), torch.full((3, 5), S, dtype=dtype),
          f"allreduce sum {dtype}")
    if dtype.is_floating_point:
        close(hvd.allreduce(x, name=f"a.{dtype}"), torch.full((3, 5), S / n, dtype=dtype),
              f"allreduce average {dtype}", atol=1e-2)
    h = hvd.allreduce_async(x, op=hvd.Max, name=f"m.{dtype}")
    close(hvd.synchronize(h), torch.full((3, 5), n, dtype=dtype), f"async max {dtype}")
    check(hvd.poll(h), "poll after synchronize")
    y = x.clone()
    out = hvd.allreduce_(y, op=hvd.Min, name=f"i.{dtype}")
    check(out is y and bool((y == 1).all()), f"in-place min {dtype}")
    check(bool((x == r + 1).all()), "input untouched by out-of-place allreduce")
b = torch.tensor([r == 0, True, False])
close(hvd.allreduce(b, op=hvd.Sum, name="bool"), torch.tensor([True, True, False]), "bool or")
close(hvd.allreduce(b, op=hvd.Product, name="bool.and"), torch.tensor([n == 1, True, False]),
      "bool and")
# scale factors, Average with integers, deprecated average=
x = torch.full((4,), float(r + 1))
close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled"),
      torch.full((4,), S), "pre/postscale")
close(hvd.allreduce(x, average=False, name="avgflag"), torch.full((4,), S), "average=False")
try:
    hvd.allreduce(x, average=True, op=hvd.Sum)
    check(False, "op and average together must raise")
except ValueError as e:
    check("supersedes" in str(e), "op/average message")
# non-contiguous (a transposed view) and zero-size, in and out of place
base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
nc = base.t()
check(not nc.is_contiguous(), "view is non-contiguous")
expect = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * S
close(hvd.allreduce(nc, op=hvd.Sum, name="nc"), expect.contiguous(), "non-contiguous")
hvd.allreduce_(nc, op=hvd.Sum, name="nc.inplace")
close(base, (torch.arange(12, dtype=torch.float32).reshape(3, 4) * S), "non-contiguous in place")
for shape in [(0,), (0, 3), (2, 0)]:
    z = torch.zeros(shape)
    close(hvd.allreduce(z, name=f"zero{shape}"), torch.zeros(shape), f"zero-size {shape}")
    close(hvd.allgather(z, name=f"gz{shape}"), torch.zeros((shape[0] * n, *shape[1:])),
          f"allgather zero-size {shape}")
    close(hvd.broadcast(z, 0, name=f"bz{shape}"), torch.zeros(shape), f"broadcast zero {shape}")
close(hvd.allreduce(torch.tensor(float(r + 1)), op=hvd.Sum, name="scalar"),
      torch.tensor(S), "0-dim")
# compression: fp16 and bf16 in the engine, a Horovod-style custom compressor around it
for comp in [hvd.Compression.fp16, hvd.Compression.bf16]:
    x = torch.full((1000,), 0.25 * (r + 1))
    close(hvd.allreduce(x, compression=comp, name=f"c.{comp.name}"),
          torch.full((1000,), 0.25 * S / n), f"compression {comp.name}", atol=1e-2)


class Halve:
    @staticmethod
    def compress(t):
        return t * 0.5, 2.0

    @staticmethod
    def decompress(t, ctx):
        return t * ctx


close(hvd.allreduce(torch.ones(3) * (r + 1), op=hvd.Sum, compression=Halve, name="custom"),
      torch.full((3,), S), "custom compressor")
c16, ctx = hvd.Compression.fp16.compress(torch.ones(2))
check(c16.dtype == torch.float16 and hvd.Compression.fp16.decompress(c16, ctx).dtype ==
      torch.float32, "Compression.fp16 on tensors")

# grouped allreduce -------------------------------------------------------------------------
ts = [torch.full((i + 1, 2), float(r + 1)) for i in range(4)]
outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="g")
for i, o in enumerate(outs):
    close(o, torch.full((i + 1, 2), S), f"grouped {i}")
outs = hvd.synchronize(hvd.grouped_allreduce_async(ts, name="ga"))
close(outs[3], torch.full((4, 2), S / n), "grouped async average")
res = hvd.grouped_allreduce_(ts, op=hvd.Sum, name="gi")
check(all(a is b for a, b in zip(res, ts, strict=True)) and bool((ts[0] == S).all()),
      "grouped in place")

ts = [torch.full((2,), float(r + 1)), torch.full((3, 1), float(r + 1)).t()]
res = hvd.synchronize(hvd.grouped_allreduce_async_(ts, op=hvd.Sum, name="gai"))
check(res[1] is ts[1] and bool((ts[1] == S).all()) and bool((ts[0] == S).all()),
      "grouped_allreduce_async_ with a non-contiguous member")

# allgather -----------------------------------------------------------------------------------
for dtype in FLOATS + INTS + [torch.bool]:
    x = torch.full((r + 1, 2), r + 1).to(dtype)
    g = hvd.allgather(x, name=f"ag.{dtype}")
    expect = torch.cat([torch.full((q + 1, 2), q + 1).to(dtype) for q in range(n)])
    close(g, expect, f"allgather {dtype}")
g = hvd.synchronize(hvd.allgather_async(torch.tensor([r]), name="aga"))
close(g, torch.arange(n), "allgather async")
gs = hvd.grouped_allgather([torch.full((r + 1,), r), torch.full((1, 3), r)], name="gag")
close(gs[1], torch.arange(n).repeat_interleave(3).reshape(n, 3), "grouped allgather")
check(gs[0].numel() == n * (n + 1) // 2, "grouped allgather ragged")
gs = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([r]), torch.ones(1, 2)], name="gaa"))
close(gs[0], torch.arange(n), "grouped_allgather_async")

# broadcast -----------------------------------------------------------------------------------
for root in range(n):
    for dtype in [torch.bfloat16, torch.float32, torch.int64, torch.bool]:
        x = torch.full((3,), r + 1).to(dtype)
        close(hvd.broadcast(x, root, name=f"b.{root}.{dtype}"),
              torch.full((3,), root + 1).to(dtype), f"broadcast {root} {dtype}")
    y = torch.full((2, 2), float(r))
    check(hvd.broadcast_(y, root, name=f"bi.{root}") is y and bool((y == root).all()),
          "broadcast_")
    y = torch.full((2, 2), float(r))
    hvd.synchronize(hvd.broadcast_async_(y, root, name=f"bai.{root}"))
    check(bool((y == root).all()), "broadcast_async_")
h = hvd.broadcast_async(torch.full((2,), float(r)), n - 1, name="ba")
close(hvd.synchronize(h), torch.full((2,), float(n - 1)), "broadcast_async")
nc = torch.full((4, 3), float(r)).t()
hvd.broadcast_(nc, n - 1, name="bnc")
check(bool((nc == n - 1).all()), "broadcast_ non-contiguous")

# alltoall ------------------------------------------------------------------------------------
x = torch.arange(n * 2, dtype=torch.float32) + 100 * r  # 2 rows to each rank
out = hvd.alltoall(x, name="a2a")
expect = torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * q
                    for q in range(n)])
close(out, expect, "alltoall even")
splits = torch.tensor([q + 1 for q in range(n)], dtype=torch.int32)  # q+1 rows to rank q
x = torch.full((int(splits.sum()), 2), float(r))
out, recv = hvd.alltoall(x, splits=splits, name="a2av")
close(recv, torch.full((n,), r + 1, dtype=torch.int32), "alltoall received splits")
close(out, torch.arange(n, dtype=torch.float32).repeat_interleave(r + 1).unsqueeze(1)
      .expand(-1, 2).contiguous(), "alltoallv rows")
out, recv = hvd.synchronize(hvd.alltoall_async(x, splits=splits.tolist(), name="a2aa"))
check(out.shape[0] == n * (r + 1), "alltoall async")

# reducescatter -------------------------------------------------------------------------------
rows = 2 * n + 1
x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
mine = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
start = sum(mine[:r])
full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
close(hvd.reducescatter(x, op=hvd.Sum, name="rs"), full[start:start + mine[r]] * S,
      "reducescatter sum")
close(hvd.reducescatter(x, name="rsa"), full[start:start + mine[r]] * S / n,
      "reducescatter average")
close(hvd.synchronize(hvd.reducescatter_async(x, name="rsas", op=hvd.Sum)),
      full[start:start + mine[r]] * S, "reducescatter async")
outs = hvd.synchronize(hvd.grouped_reducescatter_async([x], op=hvd.Sum, name="grsa"))
close(outs[0], full[start:start + mine[r]] * S, "grouped_reducescatter_async")
outs = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum, name="grs")
close(outs[1], full[start:start + mine[r]] * S * 2, "grouped reducescatter")

# errors reach every rank -----------------------------------------------------------------------
bad = torch.zeros(3, dtype=torch.complex64) if r == 0 else torch.zeros(3)
try:
    hvd.allreduce(bad, name="bad.dtype")
    check(False, "complex dtype on rank 0 must fail everywhere")
except RingflowError as e:
    check("complex64" in str(e) and "supported" in str(e), f"dtype message: {e}")
# Horovod's rules, checked on every rank with one text (a TensorError is a ValueError): a 0-dim
# tensor cannot be reduce-scattered, alone or in a group; alltoall without splits needs a first
# dimension that is a multiple of the set's size.
fails = [("reducescatter", lambda: hvd.reducescatter(torch.tensor(float(r)), name="rs0"),
          "reducescatter of 'reducescatter.rs0' splits the first dimension"),
         ("grouped", lambda: hvd.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(1.0)],
                                                       name="grs0"),
          "reducescatter of 'grouped_reducescatter.grs0.1' splits the first dimension")]
if n > 1:
    fails.append(("alltoall", lambda: hvd.alltoall(torch.empty(n + 1), name="a2a.len"),
                  f"alltoall of 'alltoall.a2a.len': splits not provided, but the first "
                  f"dimension of the tensor ({n + 1}) is not an even multiple"))
for what, call, fragment in fails:
    try:
        call()
        check(False, f"{what} must fail")
    except ValueError as e:
        check(isinstance(e, RingflowError) and fragment in str(e), f"{what} message: {e}")
mis = torch.zeros(3 + r)
try:
    hvd.allreduce(mis, name="bad.shape")
    check(n == 1, "shape mismatch must fail")
except Exception as e:
    check("shape" in str(e).lower(), f"mismatch message: {e}")
try:
    hvd.allreduce([1, 2, 3], name="not.tensor")
    check(False, "a list must fail")
except Exception as e:
    check("torch.Tensor" in str(e), f"not-a-tensor message: {e}")
timeline = os.path.join(tempfile.mkdtemp(), "timeline.json")
hvd.start_timeline(timeline)
hvd.allreduce(torch.ones(3), name="traced")
hvd.stop_timeline()
hvd.barrier()  # the engine handled the stop before this barrier's request
if r == 0:  # one file, rank 0's, with every rank's track (ringflow.timeline)
    with open(timeline) as f:
        events = json.load(f)
    check({"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= {e["name"] for e in events}, "timeline events")
    check({e["pid"] for e in events if e["name"] == "ALLREDUCE"} == set(range(n)),
          "every rank's track in the timeline")

# process sets, barrier, join ---------------------------------------------------------------------
if n >= 2:
    ps = hvd.add_process_set([0, 1])
    if r in (0, 1):
        close(hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, process_set=ps,
                            name="ps"), torch.tensor([3.0]), "process set allreduce")
        close(hvd.broadcast(torch.tensor([r]), 1, process_set=ps, name="psb"),
              torch.tensor([1]), "process set broadcast root 1")
    hvd.remove_process_set(ps)
hvd.barrier()
if r == 0 and n > 1:  # the other ranks joined already: they contribute zeros
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="uneven"), torch.ones(2), "after join")
last = hvd.join()
check(last == 0 or n == 1, f"join returns the last rank to join ({last})")
print(f"PASS collectives: {checks} checks rank {r}/{n}")
hvd.shutdown()
