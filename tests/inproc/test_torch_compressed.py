"""torch's DistributedOptimizer with the compressors with state, ranks as threads (run_engines).

Per step, with several buckets (a 1 KiB bucket cap): each compressed gradient that comes back is
``c * sum_w (D_w - e_w')`` computed from the ranks' own gradients and errors (1-bit: plus its
server errors), every rank gets the same bits, and the compressor's state survives
``state_dict()`` / ``load_state_dict()`` so that a restored optimizer continues identically.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringflow.torch as hvd  # noqa: E402
from ringflow.config import Config  # noqa: E402
from ringflow.testing import run_engines  # noqa: E402

pytestmark = pytest.mark.timeout(180)

KINDS = {
    "powersgd": hvd.Compression.powersgd(rank=2, min_elements=64),
    "randomk": hvd.Compression.randomk(fraction=0.25, min_elements=64),
    "onebit": hvd.Compression.onebit(min_elements=64),
}
CONFIG = Config(timeout_s=120, bucket_bytes=1024)  # several buckets per backward pass


def _template() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


TEMPLATE = _template()  # built once: rank threads seeding torch's one generator would race


def model() -> Any:
    return copy.deepcopy(TEMPLATE)


def batch(r: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(r: int, options: Any, steps: int, net: Any = None, opt_state: Any = None,
          first: int = 0, opt: Any = None) -> tuple[Any, Any, list]:
    net = net or model()
    if opt is None:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=net.named_parameters(),
                                       compression=options)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    records = []
    for step in range(first, first + steps):
        x, y = batch(r, step)
        opt.zero_grad()
        before = {k: torch.as_tensor(np.asarray(v)).clone()
                  for k, v in opt._exchange.errors.items()}  # random-k, 1-bit: new at start
        with opt.skip_synchronize():  # hold every bucket until the gradients are recorded
            torch.nn.functional.cross_entropy(net(x), y).backward()
        raw = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        opt.synchronize()
        after = {k: torch.as_tensor(np.asarray(v)).clone() for k, v in opt._exchange.errors.items()}
        server = {k: v.copy() for k, v in opt._exchange.server.items()}
        reduced = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        records.append((raw, before, after, server, reduced))
        with opt.skip_synchronize():
            opt.step()
    return net, opt, records


def server_error(out: list, step: int, name: str, shape: Any) -> Any:
    flat = np.concatenate([o[1][step][3][name] for o in out])[:int(np.prod(shape))]
    return torch.as_tensor(flat).reshape(shape).double()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_optimizer_result_is_the_closed_form(n: int, kind: str) -> None:
    def body(r: int, rf: Any) -> Any:
        net, _, records = train(r, KINDS[kind], 3)
        return [p.detach().clone() for p in net.parameters()], records

    out = run_engines(n, body, CONFIG, deadline=120)
    for params in zip(*(o[0] for o in out), strict=True):
        for p in params[1:]:
            torch.testing.assert_close(p, params[0], rtol=0, atol=0)
    compressed = set(out[0][1][0][2])
    if n == 1:  # one rank exchanges nothing (Horovod's rule): the gradients stay exact
        assert not compressed
        for raw, _, _, _, reduced in out[0][1]:
            for name in raw:
                torch.testing.assert_close(reduced[name], raw[name], rtol=0, atol=0)
        return
    assert compressed == {"0.weight", "2.weight"}  # 4.weight (48) and biases are below 64
    for step in range(3):
        for name in compressed:
            shape = out[0][1][step][0][name].shape
            total = torch.zeros(shape, dtype=torch.float64)
            for r in range(n):
                raw, before, after, _, _ = out[r][1][step]
                d = raw[name].double() + (before[name].reshape(shape).double()
                                          if name in before else 0)
                total += d - after[name].reshape(shape).double()
            expected = total / n
            if kind == "onebit":  # the server errors: rank r holds chunk r of the flat tensor
                now = server_error(out, step, name, shape)
                was = server_error(out, step - 1, name, shape) if step else 0
                expected = expected + was - now
            got = out[0][1][step][4][name].double()
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_restores_the_compressor(kind: str) -> None:
    def body(r: int, rf: Any) -> Any:
        net, opt, _ = train(r, KINDS[kind], 2)
        saved_net, saved = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
        assert saved["ringflow_compression"]["errors"], "error feedback saved"
        net_a, _, _ = train(r, KINDS[kind], 2, net=net, first=2, opt=opt)
        fresh = model()
        fresh.load_state_dict(saved_net)
        net_b, _, _ = train(r, KINDS[kind], 2, net=fresh, opt_state=saved, first=2)
        return [(a.detach(), b.detach()) for a, b in zip(net_a.parameters(), net_b.parameters(),
                                                         strict=True)]

    for pairs in run_engines(2, body, CONFIG, deadline=120):
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_configured_compression_applies_where_the_call_left_none() -> None:
    def body(r: int, rf: Any) -> Any:
        net = model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters())
        return opt._exchange.options.spec()

    config = Config(timeout_s=120, compression="randomk:fraction=0.5")
    assert run_engines(2, body, config, deadline=60) == ["randomk:fraction=0.5"] * 2


def test_plain_collectives_refuse_a_compressor_with_state() -> None:
    def body(r: int, rf: Any) -> Any:
        with pytest.raises(ValueError, match="DistributedOptimizer"):
            hvd.allreduce(torch.ones(4), name="x", compression=hvd.Compression.powersgd())
        return True

    assert run_engines(2, body, CONFIG, deadline=60) == [True, True]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_process_set_members_only(kind: str) -> None:
    def body(r: int, rf: Any) -> Any:
        ps = hvd.add_process_set([0, 2])
        net = model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters(),
                                       compression=KINDS[kind], process_set=ps)
        for step in range(2):
            x, y = batch(r, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()], sorted(opt._exchange.errors)

    out = run_engines(3, body, CONFIG, deadline=120)
    assert out[0][1] == out[2][1] == ["0.weight", "2.weight"] and out[1][1] == []
    for a, b in zip(out[0][0], out[2][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
