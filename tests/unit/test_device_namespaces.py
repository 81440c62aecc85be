"""ringflow.devices: the registry, the namespaces' arithmetic, and how backends pick a device
implementation (NCCL, or host staging around the CPU one)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from ringflow import backends, devices
from ringflow.devices import fake
from ringflow.devices.fake import FakeArray, FakeNamespace, asnumpy, to_fake
from ringflow.devices.host import HOST
from ringflow.errors import ConfigError
from ringflow.ops import BFLOAT16, ReduceOp, scale_into
from ringflow.rendezvous import MemoryStore
from ringflow.testing import run_commands

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64, np.int32, np.int64, np.uint8]


def test_host_arrays_have_no_namespace_and_device_arrays_find_theirs() -> None:
    assert devices.namespace_of(np.ones(3)) is None
    assert devices.namespace_of([1, 2]) is None
    assert isinstance(devices.namespace_of(to_fake(np.ones(3))), FakeNamespace)


def test_the_stand_in_refuses_numpy_everywhere() -> None:
    x = to_fake(np.arange(4.0))
    with pytest.raises(TypeError, match="cannot be read as a numpy array"):
        np.asarray(x)
    with pytest.raises(TypeError):
        np.add(x, 1)
    with pytest.raises(TypeError):
        np.copyto(np.empty(4), x)
    assert isinstance(x[1:3], FakeArray) and isinstance(x.reshape(2, 2), FakeArray)


@pytest.mark.processes
def test_a_registered_library_is_looked_at_only_once_imported() -> None:
    code = ("import sys, numpy as np, ringflow; from ringflow import devices; "
            "devices.namespace_of(np.ones(2)); "
            "print(sorted(m for m in ('torch', 'cupy', 'tensorflow') if m in sys.modules))")
    out = run_commands([[sys.executable, "-c", code]], timeout=60, merge_stderr=False)[0].stdout
    assert out.strip() == "[]"


def test_a_missing_library_fails_with_the_install_command() -> None:
    class Thing:
        pass

    def factory() -> devices.ArrayNamespace:
        raise ImportError("No module named 'thinglib'")

    sys.modules["fake_thing_module"] = type(sys)("fake_thing_module")
    sys.modules["fake_thing_module"].Thing = Thing  # type: ignore[attr-defined]
    try:
        devices.register("thing", "fake_thing_module", "Thing", factory, install="pip install x")
        with pytest.raises(ConfigError, match="pip install x"):
            devices.namespace_of(Thing())
    finally:
        devices._LIBRARIES[:] = [lib for lib in devices._LIBRARIES if lib.name != "thing"]
        devices._BY_TYPE.clear()
        del sys.modules["fake_thing_module"]


def test_one_device_per_kind_and_process() -> None:
    devices.forget()
    ns = FakeNamespace()
    a, b = to_fake(np.ones(2), "fake:0"), to_fake(np.ones(2), "fake:1")
    assert devices.claim(ns, a, "fake:0", "tensor 'a'") == ""
    assert devices.claim(ns, a, "fake:0", "tensor 'a'") == ""
    assert "already moves tensors on fake:0" in devices.claim(ns, b, "fake:1", "tensor 'b'")
    like_ns, like = devices.joined_like("fake")
    assert like_ns is ns and like.device == "fake:0"
    devices.forget()
    assert devices.joined_like("nothing")[0] is HOST


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wire", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("factor", [1.0, 0.1, 3.0])
def test_namespaces_cast_and_scale_with_the_cpu_arithmetic(dtype, wire, factor) -> None:
    src = (np.arange(-7, 50) * 1.37).astype(dtype)
    want = np.empty(src.size, wire)
    if factor != 1.0:
        scale_into(src, factor, want)
    else:
        np.copyto(want, src, casting="unsafe")
    host = np.empty(src.size, wire)
    HOST.copy(host, src, factor)
    dev = FakeNamespace().empty((src.size,), np.dtype(wire), None)
    FakeNamespace().copy(dev, to_fake(src), factor)
    np.testing.assert_array_equal(host, want)
    np.testing.assert_array_equal(asnumpy(dev), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factor", [1.0, 0.1, 3.0])
def test_the_torch_namespace_has_the_same_bits(dtype, factor) -> None:
    torch = pytest.importorskip("torch")
    from ringflow.devices.torch_tensors import TorchNamespace, host_view

    src = (np.arange(-7, 50) * 1.37).astype(dtype)
    for wire in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(dtype)):
        want = np.empty(src.size, wire)
        if factor != 1.0:
            scale_into(src, factor, want)
        else:
            np.copyto(want, src, casting="unsafe")
        ns = TorchNamespace()
        like = torch.empty(0)
        out = ns.empty((src.size,), wire, like)
        ns.copy(out, host_view(src.copy()), factor)
        got = np.empty(src.size, wire)
        ns.to_host(out, got)
        np.testing.assert_array_equal(got, want)


def test_device_items_take_staging_around_the_cpu_implementation() -> None:
    class Link:
        rank, size = 0, 1

    b = backends._over(Link())  # type: ignore[arg-type]
    f32 = np.dtype(np.float32)
    assert b.allreduce_for(0, f32, ReduceOp.SUM, "cpu").name == "ring"
    staged = b.allreduce_for(0, f32, ReduceOp.SUM, "fake")
    assert staged.name == "staging+ring" and b.allreduce_for(0, f32, ReduceOp.SUM, "cuda") \
        is staged
    fake.reset_counts()
    x = to_fake(np.arange(5, dtype=np.float32))
    out = FakeNamespace().empty((5,), f32, x)
    staged.allreduce(Link(), x, out, ReduceOp.SUM, 2.0)  # type: ignore[arg-type]
    np.testing.assert_array_equal(asnumpy(out), np.arange(5) * 2.0)
    assert (fake.COUNTS["to_host"], fake.COUNTS["from_host"]) == (1, 1)


def test_nccl_takes_its_dtypes_and_ops_only() -> None:
    from ringflow.algorithms import nccl

    assert nccl.takes(np.dtype(np.float32), ReduceOp.AVERAGE)
    assert nccl.takes(BFLOAT16, ReduceOp.SUM)  # by pointer: no cupy dtype needed
    assert nccl.takes(np.dtype(np.bool_), ReduceOp.MIN) and nccl.takes(np.dtype(np.bool_))
    assert not nccl.takes(np.dtype(np.int16), ReduceOp.SUM)  # NCCL has no 16-bit integers
    assert not nccl.takes(np.dtype(np.uint16))
    assert not nccl.takes(np.dtype(np.float32), ReduceOp.ADASUM)


def test_every_rank_stages_unless_all_share_an_nccl_provider(monkeypatch) -> None:
    """Each rank publishes the providers it can run; the job takes the first that every rank
    has (cupy before torch), or none: one rank on NCCL and another staging would hang."""
    local = threading.local()
    have: dict[int, dict[str, str]] = {}
    monkeypatch.setattr(backends, "nccl_providers", lambda: have[local.rank])

    class Info:
        size = 2

        def __init__(self, rank: int) -> None:
            self.rank = rank

    class Config:
        timeout_s = 5.0

    class Link:
        rank, size = 0, 2

        def check_peers(self, ranks: object = None) -> None: ...

    chosen: dict[int, str | None] = {}

    def rank(r: int, store: MemoryStore) -> None:
        local.rank = r
        b = backends._with_nccl(backends._over(Link()), Info(r), store, Config(), "p/")
        chosen[r] = None if b.nccl is None else b.nccl.provider
        assert [i.name for i in b.allreduce] == ["ring"]  # CPU buffers keep their order

    def job() -> dict[int, str | None]:
        store = MemoryStore()
        threads = [threading.Thread(target=rank, args=(r, store)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return dict(chosen)

    have.update({0: {"cupy": "", "torch": "no"}, 1: {"cupy": "no CUDA device", "torch": ""}})
    assert job() == {0: None, 1: None}
    have[0]["torch"] = ""
    assert job() == {0: "torch", 1: "torch"}
    have[1]["cupy"] = ""
    assert job() == {0: "cupy", 1: "cupy"}
