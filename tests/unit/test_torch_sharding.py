"""Sharding without repeats (DistributedSampler(pad=False), auto mode's batch shares) and
SyncBatchNorm.convert_sync_batchnorm, in one process."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import ringflow.torch as hvd  # noqa: E402
from ringflow.torch._auto.loader import share  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def lengths(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), n + 1, 10, 101})


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_false_gives_every_sample_to_exactly_one_rank(n: int, shuffle: bool) -> None:
    for length in lengths(n):
        dataset = list(range(length))
        for epoch in (0, 1):
            shards = []
            for r in range(n):
                sampler = hvd.DistributedSampler(dataset, num_replicas=n, rank=r,
                                                 shuffle=shuffle, seed=7, pad=False)
                sampler.set_epoch(epoch)
                shard = list(sampler)
                assert len(sampler) == len(shard)
                shards.append(shard)
            assert sorted(i for s in shards for i in s) == dataset, (length, shards)
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
            # torch's order, without the padding: each shard is a prefix of the padded one
            for r, shard in enumerate(shards):
                padded = hvd.DistributedSampler(dataset, num_replicas=n, rank=r,
                                                shuffle=shuffle, seed=7)
                padded.set_epoch(epoch)
                assert list(padded)[:len(shard)] == shard


def test_padding_repeats_samples_and_pad_false_does_not() -> None:
    dataset = list(range(7))
    padded = [i for r in range(3) for i in hvd.DistributedSampler(dataset, 3, r, shuffle=False)]
    exact = [i for r in range(3)
             for i in hvd.DistributedSampler(dataset, 3, r, shuffle=False, pad=False)]
    assert len(padded) == 9 and len(set(padded)) == 7  # two samples counted twice
    assert sorted(exact) == dataset


def test_pad_false_with_drop_last_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pad=False keeps every sample once, drop_last=True"):
        hvd.DistributedSampler(list(range(5)), 2, 0, pad=False, drop_last=True)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_batch_shares_are_contiguous_and_even(n: int) -> None:
    for length in range(12):
        batch = list(range(100, 100 + length))
        parts = [share(batch, n, r) for r in range(n)]
        assert [i for p in parts for i in p] == batch
        sizes = [len(p) for p in parts]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=None),
                                      nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6),
                                  nn.SyncBatchNorm(6, affine=False), nn.Linear(6, 3),
                                  nn.BatchNorm1d(3, track_running_stats=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_results() -> None:
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    before = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.head[2].eval()
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model  # children replaced in place
    norms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 3 and all(type(m) is hvd.SyncBatchNorm for m in norms)
    assert {name: p for name, p in converted.named_parameters()} == before  # the same objects
    assert all(b is buffers[name] for name, b in converted.named_buffers())
    assert not converted.head[2].training and converted.features[1].training
    assert (converted.features[1].momentum, converted.head[4].track_running_stats) == (None, False)
    assert optimizer.param_groups[0]["params"] == list(converted.parameters())
    reference.head[2].eval()
    x = torch.randn(5, 2, 6, 6)
    for mode in ("train", "eval"):
        getattr(converted, mode)()
        getattr(reference, mode)()
        assert torch.allclose(converted(x), reference(x), atol=1e-6)
    assert torch.allclose(converted.features[1].running_var, reference.features[1].running_var)


def test_a_bare_batchnorm_is_returned_converted() -> None:
    bn = nn.BatchNorm1d(3)
    out = hvd.SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(out) is hvd.SyncBatchNorm and out.weight is bn.weight
    with pytest.raises(TypeError, match="process_set must be a ringflow ProcessSet"):
        hvd.SyncBatchNorm.convert_sync_batchnorm(bn, object())


def test_torch_sync_batchnorm_alone_trains_locally_without_a_warning() -> None:
    layer = nn.SyncBatchNorm(3)
    x = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(layer(x), nn.BatchNorm1d(3)(x))  # one process: nothing to warn
