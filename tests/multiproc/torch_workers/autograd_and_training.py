"""Gradients of the collectives, DistributedOptimizer, broadcast_* helpers, SyncBatchNorm, sampler.

Run under ringflow-run with any number of ranks. Prints
"PASS autograd_and_training: <n> checks" on success.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import ringflow.torch as hvd

warnings.simplefilter("ignore", DeprecationWarning)
hvd.init()
r, n = hvd.rank(), hvd.size()
S = n * (n + 1) / 2
checks = 0


def check(cond: bool, what: str) -> None:
    global checks
    if not cond:
        raise AssertionError(f"rank {r}: {what}")
    checks += 1


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    check(a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    check(torch.allclose(a.double(), b.double(), atol=atol, rtol=1e-4),
          f"{what}: max diff {(a.double() - b.double()).abs().max()}")


w = float(r + 1)  # this rank's loss weight

# autograd of every collective (closed forms; see ringflow/torch/mpi_ops.py) ----------------------
for name, op, expect in [("ar.sum", hvd.Sum, S), ("ar.avg", hvd.Average, S / n)]:
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, op=op, name=name) * w).sum().backward()
    close(x.grad, torch.full((3,), expect), f"allreduce grad {name}")
x = torch.ones(3, requires_grad=True)
(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0) * w).sum().backward()  # anonymous
close(x.grad, torch.full((3,), 2 * S), "allreduce grad with prescale (anonymous names)")
xs = [torch.ones(2, requires_grad=True), torch.ones(1, 4, requires_grad=True)]
outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="gar")
(sum(o.sum() for o in outs) * w).backward()
close(xs[1].grad, torch.full((1, 4), S), "grouped allreduce grad")
x = torch.ones(r + 1, 2, requires_grad=True)
(hvd.allgather(x, name="ag") * w).sum().backward()
close(x.grad, torch.full((r + 1, 2), S / n), "allgather grad (Horovod: averaged)")
xs = [torch.ones(r + 1, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
outs = hvd.grouped_allgather(xs, name="gag")
(sum(o.sum() for o in outs) * w).backward()
close(xs[0].grad, torch.full((r + 1,), S / n), "grouped allgather grad")
for root in range(n):
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, root, name=f"bc{root}") * w).sum().backward()
    close(x.grad, torch.full((2,), S / n if r == root else 0.0), f"broadcast grad root {root}")
x = torch.ones(2 * n, requires_grad=True)
(hvd.alltoall(x, name="a2a") * w).sum().backward()
close(x.grad, torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2), "alltoall grad")
splits = torch.tensor([1] * n)
x = torch.ones(n, 3, requires_grad=True)
out, recv = hvd.alltoall(x, splits=splits, name="a2av")
check(not recv.requires_grad, "received splits are not differentiable")
(out * w).sum().backward()
close(x.grad, torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1).expand(n, 3),
      "alltoallv grad")
rows = [2 * n // n] * n
# Horovod's rule: allgather of the output gradients, times the set size for Sum.
for op, mult in [(hvd.Sum, n), (hvd.Average, 1)]:
    x = torch.ones(2 * n, 2, requires_grad=True)
    (hvd.reducescatter(x, op=op, name=f"rs{int(op)}") * w).sum().backward()
    close(x.grad, torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2)
          .unsqueeze(1).expand(2 * n, 2) * mult, f"reducescatter grad op {op.name}")
xs = [torch.ones(n, requires_grad=True), torch.ones(n, 2, requires_grad=True)]
outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="grs")
(sum(o.sum() for o in outs) * w).backward()
close(xs[1].grad, torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1).expand(n, 2) * n,
      "grouped reducescatter grad")

# DistributedOptimizer: n ranks x batch B == one process x batch nB ---------------------------
B = 4
g = torch.Generator().manual_seed(0)
data = torch.randn(6, B * n, 10, generator=g)
target = torch.randn(6, B * n, 3, generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def train(model: nn.Module, opt: torch.optim.Optimizer, lo: int, hi: int, passes: int = 1) -> None:
    for step in range(data.shape[0]):
        opt.zero_grad()
        for part in range(passes):
            sl = slice(lo + part * (hi - lo) // passes, lo + (part + 1) * (hi - lo) // passes)
            loss = nn.functional.mse_loss(model(data[step, sl]), target[step, sl])
            (loss / passes).backward()
        opt.step()


for kind, kwargs in [
    ("sgd", {}),
    ("sgd-groups", {"groups": 2}),
    ("sgd-list-groups", "list"),
    ("sgd-predivide", {"gradient_predivide_factor": 2.0}),
    ("adam-bpps2", {"backward_passes_per_step": 2}),
    ("sgd-fp16", {"compression": hvd.Compression.fp16}),
]:
    ref = make_model()
    mine = copy.deepcopy(ref)
    make = (lambda p: torch.optim.Adam(p, lr=0.01)) if kind.startswith("adam") else \
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01))
    ref_opt = make(ref.parameters())
    base = make(mine.parameters())
    if kwargs == "list":
        kwargs = {"groups": [[mine[0].weight, mine[2].weight]]}
    opt = hvd.DistributedOptimizer(base, named_parameters=mine.named_parameters(), **kwargs)
    check(isinstance(opt, type(base)), f"{kind}: isinstance of the user's class")
    passes = kwargs.get("backward_passes_per_step", 1)
    train(ref, ref_opt, 0, B * n, passes)
    train(mine, opt, r * B, (r + 1) * B, passes)
    atol = 2e-3 if "fp16" in kind else 1e-5
    for (pn, a), b in zip(mine.named_parameters(), ref.parameters(), strict=False):
        close(a.detach(), b.detach(), f"{kind}: {pn} equals single-process batch {B * n}", atol)

# sparse gradients: allgathered (default) or densified (sparse_as_dense)
for dense in (False, True):
    torch.manual_seed(2)
    ref = nn.Embedding(10, 3, sparse=True)
    mine = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.5),
                                   named_parameters=mine.named_parameters(),
                                   sparse_as_dense=dense)
    idx = torch.tensor([[q % 10, (3 * q + 1) % 10] for q in range(n)])
    ref(idx).pow(2).sum().div(n).backward()
    ref_opt.step()
    mine(idx[r:r + 1]).pow(2).sum().backward()
    opt.step()
    close(mine.weight.detach(), ref.weight.detach(), f"sparse gradient sparse_as_dense={dense}")

# a parameter without a gradient on some ranks still takes part
model = nn.ModuleDict({"a": nn.Linear(2, 1, bias=False), "b": nn.Linear(2, 1, bias=False)})
nn.init.ones_(model["a"].weight)
nn.init.ones_(model["b"].weight)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters())
x = torch.ones(1, 2)
loss = model["a"](x).sum() + (model["b"](x).sum() if r == 0 else 0)
loss.backward()
opt.step()
close(model["b"].weight.detach(), torch.full((1, 2), 1 - 1 / n), "unused parameter averaged")
close(model["a"].weight.detach(), torch.zeros(1, 2), "used parameter")

# misuse errors (Horovod's texts)
if n > 1:
    opt.zero_grad()
    model["a"](x).sum().backward()
    try:
        opt.zero_grad()
        check(False, "zero_grad after backward must raise")
    except AssertionError as e:
        check("zero_grad() was called after loss.backward()" in str(e), f"zero_grad text: {e}")
    try:
        model["a"](x).sum().backward()
        check(False, "second backward must raise")
    except AssertionError as e:
        check("more than backward_passes_per_step" in str(e), f"bpps text: {e}")
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
for bad, text in [({"backward_passes_per_step": 0}, "must be > 0"),
                  ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "op != Average")]:
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), **bad)
        check(False, f"{bad} must raise")
    except ValueError as e:
        check(text in str(e), f"message {e}")
try:
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                             named_parameters=[("a", model["a"].weight)])
    check(False, "unnamed parameter must raise")
except ValueError as e:
    check("were not named" in str(e), "unnamed message")

# broadcast_parameters / broadcast_optimizer_state / objects ----------------------------------
torch.manual_seed(100 + r)
net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
torch.manual_seed(100)
net0 = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
for (k, a), b in zip(net.state_dict().items(), net0.state_dict().values(), strict=False):
    close(a.double(), b.double(), f"broadcast_parameters {k}")
hvd.broadcast_parameters(list(net.named_parameters()), root_rank=n - 1)
# Any iterable (MegEngine's bcast_list_(net.parameters())): generators, a tuple, a ParameterList.
for form in (lambda: net.parameters(), lambda: net.named_parameters(),
             lambda: tuple(net.parameters()), lambda: nn.ParameterList(net.parameters())):
    with torch.no_grad():
        for p in net.parameters():
            p.add_(r)
    hvd.broadcast_parameters(form(), root_rank=n - 1)
    for p, b in zip(net.parameters(), net0.parameters(), strict=True):
        close(p.detach().double(), b.detach().double() + (n - 1), "iterable broadcast")
    with torch.no_grad():
        for p in net.parameters():
            p.sub_(n - 1)
for bad, fragment in ((next(net.parameters()), "single tensor"), (3, "invalid params"),
                      ([net[0]], "entry 0 of params is a Linear")):
    try:
        hvd.broadcast_parameters(bad, root_rank=0)
        check(False, f"{fragment} must raise")
    except ValueError as e:
        check(fragment in str(e), f"broadcast_parameters message: {e}")
before = [p.detach().clone() for p in net.parameters()]
adam = torch.optim.Adam(net.parameters(), lr=0.001 * (r + 1), betas=(0.9, 0.99 - 0.01 * r),
                        weight_decay=0.1)
hvd.broadcast_optimizer_state(adam, root_rank=0)
check(adam.param_groups[0]["lr"] == 0.001 and adam.param_groups[0]["betas"] == (0.9, 0.99),
      f"options broadcast: {adam.param_groups[0]['lr']} {adam.param_groups[0]['betas']}")
check(len(adam.state) == len(before), "empty state initialized")
for p, b in zip(net.parameters(), before, strict=False):
    close(p.detach(), b, "init step leaves parameters alone")
check(all(p.grad is not None and not p.grad.any() for p in net.parameters()),
      "the init step leaves zero gradients where there were none (Horovod's)")
# Horovod's test_broadcast_state_no_grad: a frozen parameter keeps no gradient; the others'
# zero gradients can be broadcast; a gradient that existed is kept.
frozen = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
free = nn.Parameter(torch.rand(4))
had = nn.Parameter(torch.rand(2))
had.grad = torch.full((2,), float(r + 1))
nesterov = torch.optim.SGD([frozen, free, had], lr=0.001, weight_decay=1e-6, momentum=0.9,
                           nesterov=True)
hvd.broadcast_optimizer_state(nesterov, root_rank=0)
check(frozen.grad is None, "a frozen parameter gets no gradient")
close(hvd.broadcast(free.grad, root_rank=0), torch.zeros(4), "the zero gradient broadcasts")
close(had.grad, torch.full((2,), float(r + 1)), "a gradient that existed is kept")
sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
for p in net.parameters():
    p.grad = torch.full_like(p, float(r + 1))
sgd.step()
sgd.param_groups[0]["lr"] = 0.5 + r
hvd.broadcast_optimizer_state(sgd, root_rank=0)
for p in net.parameters():
    close(sgd.state[p]["momentum_buffer"], torch.ones_like(p), "momentum buffer from root")
check(sgd.param_groups[0]["lr"] == 0.5, "lr from root")
adam.step()
for st in adam.state.values():
    st["step"] = torch.tensor(float(10 + r))
hvd.broadcast_optimizer_state(adam, root_rank=n - 1)
check(all(float(st["step"]) == 10 + n - 1 for st in adam.state.values()), "step from root")
obj = {"rank": r, "f": (lambda v: v + r)}
got = hvd.broadcast_object(obj, root_rank=n - 1)
check(got["rank"] == n - 1 and got["f"](1) == n, "broadcast_object with a lambda")
check(hvd.broadcast_object(None) is None, "broadcast_object(None)")
allg = hvd.allgather_object({"r": r, "pad": "x" * r})
check([o["r"] for o in allg] == list(range(n)), "allgather_object")

# SyncBatchNorm vs BatchNorm over the concatenated batch ------------------------------------------
counts = [q + 2 for q in range(n)]
gen = torch.Generator().manual_seed(5)
xg = torch.randn(sum(counts), 3, 4, 5, generator=gen, dtype=torch.float64).float() * 3 + 1
dy = torch.randn(sum(counts), 3, 4, 5, generator=gen)
lo = sum(counts[:r])
sl = slice(lo, lo + counts[r])
ref_bn = nn.BatchNorm2d(3, momentum=0.3)
with torch.no_grad():
    ref_bn.weight.uniform_(0.5, 1.5, generator=gen)
    ref_bn.bias.uniform_(-0.5, 0.5, generator=gen)
sbn = hvd.SyncBatchNorm(3, momentum=0.3)
sbn.load_state_dict(ref_bn.state_dict())
xr = xg.clone().requires_grad_(True)
ref_out = ref_bn(xr)
(ref_out * dy).sum().backward()
xm = xg[sl].clone().requires_grad_(True)
out = sbn(xm)
(out * dy[sl]).sum().backward()
close(out.detach(), ref_out.detach()[sl], "SyncBatchNorm forward", atol=1e-5)
close(xm.grad, xr.grad[sl], "SyncBatchNorm input grad", atol=1e-5)
close(hvd.allreduce(sbn.weight.grad, op=hvd.Sum), ref_bn.weight.grad, "weight grad summed")
close(hvd.allreduce(sbn.bias.grad, op=hvd.Sum), ref_bn.bias.grad, "bias grad summed")
close(sbn.running_mean, ref_bn.running_mean, "running mean")
close(sbn.running_var, ref_bn.running_var, "running var")
sbn.eval()
ref_bn.eval()
close(sbn(xg[sl]).detach(), ref_bn(xg[sl]).detach(), "eval uses running stats")
try:
    sbn(torch.zeros(3))
    check(False, "1-D input must raise")
except ValueError as e:
    check("expected at least 2D input" in str(e), "SyncBatchNorm dim message")

# DistributedSampler ---------------------------------------------------------------------------
dataset = list(range(11))
sampler = hvd.DistributedSampler(dataset, shuffle=True, seed=3)
sampler.set_epoch(2)
mine = list(sampler)
everyone = hvd.allgather_object(mine)
flat = sorted(i for part in everyone for i in part)
check(len(mine) == -(-11 // n) and set(flat) == set(range(11)), "sampler covers the dataset")
check(isinstance(sampler, torch.utils.data.DistributedSampler), "sampler isinstance")
print(f"PASS autograd_and_training: {checks} checks rank {r}/{n}")
hvd.shutdown()
