"""The device path of the core, on CPU, through real processes: the numpy API on the stand-in.

Every rank is a process started by ``ringflow.run`` (as ``ringflow-run -np n`` starts them) and
hands the core arrays of the ``fake`` device (:mod:`ringflow.devices.fake`): numpy refuses them,
so any step that forgot to stage would fail. Each check is a closed form (rank r contributes
r + 1), the result must come back as an array on the input's device, and the namespace's copy
counters must show the staging the design promises: one copy of the fused buffer each way per
allreduce item, one per input and output for the staged collectives, and none of the
coordinator's eager path (which would copy on the submitting thread).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ringflow.testing import spawn_ranks

pytestmark = pytest.mark.timeout(180)

SIZES = [1, 2, 3, 4]


def _start(transport: str) -> tuple[int, int]:
    import ringflow as rf

    os.environ["RINGFLOW_TRANSPORT"] = transport
    rf.init()
    return rf.rank(), rf.size()


def _counts() -> dict[str, int]:
    from ringflow.devices import fake

    return dict(fake.COUNTS)


def allreduce_on_the_device(transport: str) -> list[str]:
    import ringflow as rf
    from ringflow.devices import fake
    from ringflow.devices.fake import FakeArray, asnumpy, to_fake

    r, n = _start(transport)
    done = []
    total = n * (n + 1) // 2
    for length in sorted({0, 1, max(n - 1, 1), 100_003}):
        for dtype in (np.float32, np.int32, np.float16, np.float64):
            x = to_fake(np.full(length, r + 1, dtype))
            fake.reset_counts()
            y = rf.allreduce(x, name=f"sum.{length}.{np.dtype(dtype).name}", op=rf.Sum)
            assert isinstance(y, FakeArray) and y.device == "fake:0" and y.dtype == dtype
            np.testing.assert_array_equal(asnumpy(y), np.full(length, total, dtype))
            c = _counts()
            nbytes = length * np.dtype(dtype).itemsize
            assert (c["to_host"], c["from_host"]) == (1, 1), c
            assert c.get("to_host_bytes", 0) == c.get("from_host_bytes", 0) == nbytes, c
            assert c["fence"] == 1 and c["ready"] == 1, c
            done.append("sum")
    # Average with scale factors, Min/Max, in place through out=
    x = to_fake(np.arange(7, dtype=np.float64) * (r + 1))
    y = rf.allreduce(x, name="avg", op=rf.Average, prescale_factor=2.0, postscale_factor=3.0)
    np.testing.assert_allclose(asnumpy(y), np.arange(7) * total * 6.0 / n)
    y = rf.allreduce(to_fake(np.array([r, -r], np.int64)), name="max", op=rf.Max)
    np.testing.assert_array_equal(asnumpy(y), [n - 1, 0])
    x = to_fake(np.full((2, 3), r + 1, np.float32))
    y = rf.allreduce(x, name="inplace", op=rf.Sum, out=x)
    assert y is x
    np.testing.assert_array_equal(asnumpy(x), np.full((2, 3), total, np.float32))
    done.append("scaled, min/max, in place")
    # a group is fused on the device and staged once, 16 bits each way (fp16 compression)
    xs = [to_fake(np.full(5, r + 1, np.float32)), to_fake(np.full((2, 3), r + 1, np.float32)),
          to_fake(np.zeros(0, np.float32))]
    fake.reset_counts()
    ys = rf.grouped_allreduce(xs, name="group", op=rf.Sum, compression=rf.Compression.fp16)
    c = _counts()
    assert (c["to_host"], c["from_host"], c["to_host_bytes"]) == (1, 1, 11 * 2), c
    for x, y in zip(xs, ys, strict=True):
        assert isinstance(y, FakeArray) and y.dtype == np.float32 and y.shape == x.shape
        np.testing.assert_array_equal(asnumpy(y), np.full(x.shape, total, np.float32))
    done.append("fused fp16 group")
    # small cached allreduces stay off the coordinator's eager path on a device
    for _ in range(3):
        y = rf.allreduce(to_fake(np.full(4, r + 1, np.float32)), name="small", op=rf.Sum)
        np.testing.assert_array_equal(asnumpy(y), np.full(4, total, np.float32))
    assert rf.stats()["eager"] == 0, rf.stats()
    rf.shutdown()
    return done


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_allreduce_is_fused_and_staged_on_the_stand_in(n: int, transport: str) -> None:
    results = spawn_ranks(n, allreduce_on_the_device, args=(transport,))
    assert all(res == results[0] for res in results) and results[0][-1] == "fused fp16 group"


def staged_collectives() -> int:
    import ringflow as rf
    from ringflow.devices import fake
    from ringflow.devices.fake import FakeArray, asnumpy, to_fake

    r, n = _start("auto")
    checks = 0

    def staged_once(c: dict[str, int], inputs: int, outputs: int) -> None:
        assert (c["to_host"], c["from_host"]) == (inputs, outputs), c

    # allgather: rank r contributes r + 1 rows of value r
    fake.reset_counts()
    y = rf.allgather(to_fake(np.full((r + 1, 2), r, np.int16)), name="gather")
    staged_once(_counts(), 1, 1)
    want = np.concatenate([np.full((k + 1, 2), k, np.int16) for k in range(n)])
    assert isinstance(y, FakeArray)
    np.testing.assert_array_equal(asnumpy(y), want)
    checks += 1
    # broadcast from the last rank, in place
    x = to_fake(np.full(6, r, np.float32))
    fake.reset_counts()
    y = rf.broadcast(x, n - 1, name="bcast", out=x)
    staged_once(_counts(), 1, 1)
    assert y is x
    np.testing.assert_array_equal(asnumpy(x), np.full(6, n - 1, np.float32))
    checks += 1
    # alltoall: rank r sends d + 1 rows of value 10 r + d to rank d
    rows = np.concatenate([np.full(d + 1, 10 * r + d, np.int32) for d in range(n)])
    got, splits = rf.alltoall(to_fake(rows), splits=[d + 1 for d in range(n)], name="a2a")
    assert isinstance(got, FakeArray) and list(splits) == [r + 1] * n
    np.testing.assert_array_equal(
        asnumpy(got), np.concatenate([np.full(r + 1, 10 * s + r, np.int32) for s in range(n)]))
    checks += 1
    # reducescatter: n + 1 rows; lower ranks take the remainder
    y = rf.reducescatter(to_fake(np.full((n + 1, 3), r + 1, np.float64)), name="rs", op=rf.Sum)
    mine = 2 if r == 0 else 1
    np.testing.assert_array_equal(asnumpy(y), np.full((mine, 3), n * (n + 1) / 2))
    checks += 1
    # Adasum is staged too (a power of two ranks only)
    if n & (n - 1) == 0:
        y = rf.allreduce(to_fake(np.ones(8, np.float32)), name="adasum", op=rf.Adasum)
        assert isinstance(y, FakeArray)
        np.testing.assert_allclose(asnumpy(y), np.ones(8))  # equal vectors: Adasum keeps one
        checks += 1
    # a process set of the even ranks
    evens = rf.add_process_set(list(range(0, n, 2)))
    if evens.included():
        y = rf.allreduce(to_fake(np.full(3, r + 1, np.float32)), name="evens", op=rf.Sum,
                         process_set=evens)
        np.testing.assert_array_equal(asnumpy(y), np.full(3, sum(range(1, n + 1, 2))))
    rf.remove_process_set(evens)
    checks += 1
    rf.shutdown()
    return checks


@pytest.mark.parametrize("n", SIZES)
def test_other_collectives_are_staged_on_the_stand_in(n: int) -> None:
    results = spawn_ranks(n, staged_collectives)
    assert len(set(results)) == 1 and results[0] >= 5


def joined_rank_takes_part_with_zeros_on_the_device() -> int:
    import ringflow as rf
    from ringflow.devices.fake import asnumpy, to_fake

    r, n = _start("auto")
    if r != n - 1:  # the last rank joins at once: it never had a tensor of its own, so its
        # zeros are allocated through the registry (devices.joined_like)
        y = rf.allreduce(to_fake(np.full(5, r + 1, np.float32)), name="with_joined", op=rf.Sum)
        np.testing.assert_array_equal(asnumpy(y), np.full(5, (n - 1) * n / 2, np.float32))
    last = rf.join()
    rf.shutdown()
    return last


@pytest.mark.parametrize("n", [2, 3])
def test_a_joined_rank_contributes_zeros_to_a_device_allreduce(n: int) -> None:
    lasts = spawn_ranks(n, joined_rank_takes_part_with_zeros_on_the_device)
    assert len(set(lasts)) == 1


def device_errors() -> list[str]:
    import ringflow as rf
    from ringflow.devices.fake import to_fake
    from ringflow.errors import MismatchError, TensorError

    r, _ = _start("auto")
    seen = []
    # one rank's tensor on the host, the others' on the device
    x = np.ones(3, np.float32) if r == 0 else to_fake(np.ones(3, np.float32))
    with pytest.raises(MismatchError) as err:
        rf.allreduce(x, name="mixed")
    seen.append(str(err.value))
    # the same kind of device, another index
    rf.allreduce(to_fake(np.ones(2, np.float32)), name="first")
    with pytest.raises(TensorError) as err:
        rf.allreduce(to_fake(np.ones(2, np.float32), "fake:1"), name="second")
    seen.append(str(err.value).replace(f"rank {r}:", "rank R:"))
    # an output on the host for an input on the device
    with pytest.raises(TensorError) as err:
        rf.allreduce(to_fake(np.ones(2, np.float32)), name="out", out=np.empty(2, np.float32))
    seen.append(str(err.value).replace(f"rank {r}:", "rank R:"))
    rf.allreduce(to_fake(np.ones(2, np.float32)), name="after")  # the job goes on
    rf.shutdown()
    return seen


def test_device_errors_reach_every_rank_and_name_the_devices() -> None:
    results = spawn_ranks(2, device_errors)
    mixed, second, out = results[0]
    assert "ranks disagree on device of tensor 'mixed'" in mixed
    assert "'cpu' on rank 0" in mixed and "'fake' on rank 1" in mixed
    assert "is on fake:1, but this process already moves tensors on fake:0" in second
    assert "must be a contiguous array of shape (2,) on fake:0" in out
    assert results[1][0] == mixed  # the same texts on every rank


def one_rank_device_allreduce_in_the_caller() -> list[str]:
    """A job of one rank completes a cached device allreduce in the submitting thread (no
    plan, no communicator, no staging), with the bits of the plan path."""
    import ringflow as rf
    from ringflow.devices import fake
    from ringflow.devices.fake import FakeArray, asnumpy, to_fake

    rf.init()
    cases = [(np.float32, rf.Sum, 1.0, 1.0, rf.Compression.none),
             (np.float32, rf.Average, 2.0, 0.3, rf.Compression.fp16),
             (np.int32, rf.Average, 3.0, 0.7, rf.Compression.none),
             (np.uint8, rf.Average, 1.0, 2.0, rf.Compression.none),
             (np.float16, rf.Sum, 0.5, 1.0, rf.Compression.bf16)]
    done = []
    for i, (dtype, op, pre, post, compression) in enumerate(cases):
        x = to_fake((np.arange(-50, 250) * 1.7).astype(dtype))
        kw = dict(name=f"c{i}", op=op, prescale_factor=pre, postscale_factor=post,
                  compression=compression)
        planned = rf.allreduce(x, **kw)  # the first call negotiates (and caches the name)
        before = rf.stats()["lane"]
        fake.reset_counts()
        solo = rf.allreduce(x, **kw)
        assert rf.stats()["lane"] == before + 1, rf.stats()
        # No wait: the work is queued, and ordered before the device's default stream (ready:
        # once at submission, once after it).
        assert fake.COUNTS["to_host"] == 0 and fake.COUNTS["fence"] == 0, fake.COUNTS
        assert fake.COUNTS["ready"] == 2, fake.COUNTS
        assert isinstance(solo, FakeArray) and solo.dtype == dtype
        np.testing.assert_array_equal(asnumpy(solo), asnumpy(planned))
        done.append(np.dtype(dtype).name)
    y = to_fake(np.full(4, 3, np.float32))
    rf.allreduce(y, name="in place", op=rf.Sum, out=y)
    assert rf.allreduce(y, name="in place", op=rf.Sum, out=y) is y
    np.testing.assert_array_equal(asnumpy(y), np.full(4, 3, np.float32))
    rf.shutdown()
    return done


def test_one_rank_completes_a_cached_device_allreduce_in_the_caller() -> None:
    (done,) = spawn_ranks(1, one_rank_device_allreduce_in_the_caller)
    assert done == ["float32", "float32", "int32", "uint8", "float16"]
