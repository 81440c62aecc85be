"""TorchState's optimizer sync (ringflow.torch.elastic._broadcast_state), ranks as threads
(run_engines): rank 0's state dict on every rank bit for bit -- Adam's moments and 0-dim step
counts, nested lists, plain values -- whether the other ranks' optimizers stepped or not."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ringflow.torch as hvd  # noqa: E402
from ringflow.testing import run_engines  # noqa: E402
from ringflow.torch.elastic import _broadcast_state  # noqa: E402


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_equal(x, y) for x, y in zip(a, b, strict=True)))
    return a == b


@pytest.mark.parametrize("n", [1, 2, 3])
def test_rank0s_optimizer_state_reaches_every_rank_bit_for_bit(n: int) -> None:
    def rank(r: int, _rf) -> bool:
        torch.manual_seed(r)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        for _ in range(2 - r if r < 2 else 0):  # rank 0 stepped twice, 1 once, the rest never
            model(torch.randn(4, 5)).sum().backward()
            opt.step()
        own = opt.state_dict()
        own["extra"] = [1, ("two", torch.arange(3))]  # nested, plain values beside tensors
        got = _broadcast_state(own)
        want = hvd.broadcast_object(own if r == 0 else None, 0)  # pickled whole
        return _equal(got, want) and _equal(want["state"][0]["step"], torch.tensor(2.0))

    assert run_engines(n, rank, deadline=60) == [True] * n
