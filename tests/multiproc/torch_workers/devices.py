"""ringflow.torch on a non-CPU device, on CPU: the stand-in tensors (tests/multiproc/
test_torch_devices.py says what they are and what this checks). Closed forms: rank r contributes
r + 1. Prints "PASS devices: <n> checks (rank r)", then the stand-in model's weights after
DistributedOptimizer training (equal to training on the CPU, checked here), for the test to
compare across ranks."""

from __future__ import annotations

import json

import torch

import ringflow.torch as hvd
from ringflow.torch.fake_device import COPIES, DEVICE_TYPE, reset_copies, to_cpu, to_fake

hvd.init()
r, n = hvd.rank(), hvd.size()


def collectives() -> int:
    total = n * (n + 1) / 2
    checks = 0

    def on_device(t: torch.Tensor) -> None:
        assert t.device.type == DEVICE_TYPE, t.device

    # allreduce (Average), out of place: one staging copy each way
    x = to_fake(torch.full((3, 4), float(r + 1)))
    reset_copies()
    y = hvd.allreduce(x, name="devices.avg")
    assert (COPIES["to_host"], COPIES["from_host"]) == (1, 1), COPIES
    on_device(y)
    assert torch.equal(to_cpu(y), torch.full((3, 4), total / n))
    checks += 1
    # in place, Sum, integers
    x = to_fake(torch.full((5,), r + 1, dtype=torch.int32))
    out = hvd.allreduce_(x, name="devices.sum_", op=hvd.Sum)
    assert out is x and torch.equal(to_cpu(x), torch.full((5,), int(total), dtype=torch.int32))
    checks += 1
    # a group fused on the device with fp16 compression (float32 and float64 both travel as
    # float16, so they share one buffer): one copy each way, 16 bits an element
    xs = [to_fake(torch.full((4,), float(r + 1))),
          to_fake(torch.full((2, 2), float(r + 1))),
          to_fake(torch.full((3,), float(r + 1), dtype=torch.float64))]
    reset_copies()
    ys = hvd.grouped_allreduce(xs, name="devices.group", op=hvd.Sum,
                               compression=hvd.Compression.fp16)
    assert (COPIES["to_host"], COPIES["from_host"]) == (1, 1), COPIES
    assert COPIES["to_host_bytes"] == 11 * 2, COPIES
    for x, y in zip(xs, ys, strict=True):
        on_device(y)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(to_cpu(y), torch.full(x.shape, total, dtype=x.dtype))
    y = hvd.allreduce(to_fake(torch.full((3,), float(r + 1), dtype=torch.bfloat16)),
                      name="devices.bf16", op=hvd.Sum)
    assert y.dtype == torch.bfloat16 and torch.equal(to_cpu(y).float(), torch.full((3,), total))
    checks += 1
    # allgather (rank r: r + 1 rows), broadcast, alltoall, reducescatter: staged
    y = hvd.allgather(to_fake(torch.full((r + 1, 2), float(r))), name="devices.gather")
    on_device(y)
    want = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
    assert torch.equal(to_cpu(y), want)
    x = to_fake(torch.full((3,), float(r)))
    hvd.broadcast_(x, root_rank=n - 1, name="devices.bcast")
    assert torch.equal(to_cpu(x), torch.full((3,), float(n - 1)))
    rows = torch.cat([torch.full((d + 1,), float(10 * r + d)) for d in range(n)])
    got, splits = hvd.alltoall(to_fake(rows), splits=[d + 1 for d in range(n)], name="devices.a2a")
    on_device(got)
    assert splits.tolist() == [r + 1] * n
    assert torch.equal(to_cpu(got),
                       torch.cat([torch.full((r + 1,), float(10 * s + r)) for s in range(n)]))
    y = hvd.reducescatter(to_fake(torch.full((n, 2), float(r + 1))), name="devices.rs", op=hvd.Sum)
    on_device(y)
    assert torch.equal(to_cpu(y), torch.full((1, 2), total))
    checks += 4
    # autograd through collectives on the device
    p = to_fake(torch.full((4,), float(r + 1))).requires_grad_(True)
    hvd.allreduce(p * 2.0, name="devices.grad", op=hvd.Sum).sum().backward()
    on_device(p.grad)
    assert torch.equal(to_cpu(p.grad), torch.full((4,), 2.0 * n))
    q = to_fake(torch.full((r + 1, 2), 1.0)).requires_grad_(True)
    hvd.allgather(q, name="devices.gather_grad").sum().backward()
    assert torch.equal(to_cpu(q.grad), torch.ones(r + 1, 2))
    checks += 2
    return checks


def training() -> list[float]:
    def train(device_tensors: bool, tag: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        if device_tensors:
            for mod in model.modules():
                for name, param in list(mod.named_parameters(recurse=False)):
                    setattr(mod, name, torch.nn.Parameter(to_fake(param.data)))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[(f"{tag}.{k}", v) for k, v in
                                                         model.named_parameters()])
        hvd.broadcast_parameters({f"{tag}.{k}": v for k, v in model.state_dict().items()}, 0)
        gen = torch.Generator().manual_seed(100 + r)
        for _ in range(3):
            data, target = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
            if device_tensors:
                data, target = to_fake(data), to_fake(target)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data), target).backward()
            opt.step()
        return model

    cpu = train(False, "devices.cpu")
    dev = train(True, "devices.dev")
    for (_, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters(), strict=True):
        assert b.device.type == DEVICE_TYPE
        torch.testing.assert_close(to_cpu(b), a.detach(), rtol=1e-6, atol=1e-7)
    return [float(v) for p in dev.parameters() for v in to_cpu(p).reshape(-1)]


print(f"PASS devices: {collectives()} checks (rank {r})")
print(f"PASS devices training (rank {r}): {json.dumps(training())}")
