"""Compression casts by a framework's kernels (ringflow/devices/casts.py) give numpy's bits.

Each kernel (torch's, TensorFlow's) is checked on its own against numpy / ml_dtypes: every
16-bit pattern widened, and float32 narrowed (random bit patterns and the rounding boundaries),
NaNs apart; then :func:`cast_into` as the executor calls it, NaNs included, must equal numpy's
bits exactly, with and without prescale, across chunks. The engine test compares fp16 and bf16
allreduces with the kernels against the same allreduces with numpy's casts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

import ringflow
from ringflow.devices import casts
from ringflow.ops import scale_into
from ringflow.testing import run_engines

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
pytestmark = pytest.mark.timeout(300)


def _framework(name: str) -> None:
    pytest.importorskip(name)


@contextlib.contextmanager
def only(name: str | None) -> Iterator[list[tuple[int, np.dtype, np.dtype]]]:
    """Casts through kernel ``name`` alone (None: numpy's), counting the chunks it cast."""
    saved = list(casts._KERNELS)
    calls: list[tuple[int, np.dtype, np.dtype]] = []
    chosen = [k for k in saved if k.name == name]
    try:
        casts._KERNELS[:] = []
        for k in chosen:
            def counting(factory=k.factory):  # type: ignore[no-untyped-def]
                kernel = factory()

                def cast(dst: np.ndarray, src: np.ndarray) -> None:
                    calls.append((len(src), src.dtype, dst.dtype))
                    kernel(dst, src)
                return cast
            casts.register(k.name, k.module, counting, k.pairs)
        yield calls
    finally:
        casts._KERNELS[:] = saved
        casts._BUILT.clear()


def _numpy(dst_dtype: np.dtype, src: np.ndarray, prescale: float = 1.0) -> np.ndarray:
    out = np.empty(src.shape, dst_dtype)
    with np.errstate(all="ignore"):
        if prescale != 1.0:
            scale_into(src, prescale, out)
        else:
            np.copyto(out, src, casting="unsafe")
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.itemsize])


def _float32_patterns(n: int, seed: int = 0) -> np.ndarray:
    """Random float32 bit patterns (NaNs, infinities and subnormals among them) and the values
    next to every float16 and bfloat16 rounding boundary that matters."""
    rng = np.random.default_rng(seed)
    random = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    halves = np.arange(0, 2**16, dtype=np.uint32)
    f16_mid = (_bits(halves.astype(np.uint16).view(F16).astype(F32)) + (1 << 12)) & 0xFFFFFFFF
    bf16_mid = (halves << 16) + (1 << 15)
    edges = np.concatenate([f16_mid, bf16_mid]).astype(np.uint32)
    near = np.concatenate([edges - 1, edges, edges + 1]).astype(np.uint32)
    return np.concatenate([random, near]).view(F32)


KERNELS = [("torch", F32, F16), ("torch", F32, BF16), ("torch", F16, F32),
           ("tensorflow", F32, F16), ("tensorflow", F16, F32)]


@pytest.mark.parametrize(("name", "src", "dst"), KERNELS, ids=lambda v: str(v))
def test_each_kernel_rounds_every_non_nan_value_as_numpy(name: str, src: np.dtype,
                                                         dst: np.dtype) -> None:
    _framework(name)
    with only(name):
        found = casts.kernel_for(src, dst)
    assert found is not None and found[0] == name
    kernel = found[1]
    if src == F32:
        x = _float32_patterns(1 << 20)
    else:  # every 16-bit pattern
        x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(src)
    got = np.empty(x.shape, dst)
    kernel(got, x)
    want = _numpy(dst, x)
    real = ~np.isnan(x.astype(F32))
    np.testing.assert_array_equal(_bits(got)[real], _bits(want)[real])
    assert np.isnan(got[~real].astype(F32)).all()


@pytest.mark.parametrize("name", ["torch", "tensorflow"])
@pytest.mark.parametrize("prescale", [1.0, 0.125, 1 / 3])
def test_cast_into_gives_numpys_bits_nans_included(name: str, prescale: float) -> None:
    _framework(name)
    n = 3 * casts.CHUNK + 12345
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(n) * np.float32(3e4)).astype(F32)  # float16 overflows too
    x[5:20] = np.array([np.inf, -np.inf, 0.0, -0.0, 65504, 65520, 65519.99, 6e-8, -6e-8, 1e-45,
                        3.4e38, -3.4e38, 2.0**-24, 2.0**-25, 2.0**-14], F32)
    nans = _bits(x[casts.CHUNK + 100:casts.CHUNK + 104])  # NaNs in the second chunk only
    nans[:] = [0x7F800001, 0xFFC00000, 0x7FBFFFFF, 0xFFFFFFFF]
    with only(name) as calls:
        pairs = [(F32, w) for w in (F16, BF16) if casts.kernel_for(F32, w)]
        for _, wire in pairs:
            calls.clear()
            narrow = np.empty(n, wire)
            casts.cast_into(narrow, x, prescale)
            np.testing.assert_array_equal(_bits(narrow), _bits(_numpy(wire, x, prescale)))
            # every chunk but the one with NaNs went through the kernel
            assert [c[0] for c in calls] == [casts.CHUNK, casts.CHUNK, 12345]
            if prescale == 1.0 and casts.kernel_for(wire, F32):
                calls.clear()
                wide = np.empty(n, F32)
                casts.cast_into(wide, narrow)
                np.testing.assert_array_equal(_bits(wide), _bits(_numpy(F32, narrow)))
                assert [c[0] for c in calls] == [n]  # then numpy again on the NaN chunk
    assert pairs
    clean = np.nan_to_num(x, nan=1.5)
    with only(name) as calls:
        narrow = np.empty(n, F16)
        casts.cast_into(narrow, clean)
        np.testing.assert_array_equal(_bits(narrow), _bits(_numpy(F16, clean)))
        assert [c[0] for c in calls] == [n]  # no NaN: one call over the whole array


def test_small_casts_and_other_pairs_stay_numpys() -> None:
    _framework("torch")
    with only("torch") as calls:
        x = np.linspace(-3, 3, casts.MIN_ELEMENTS - 1, dtype=F32)
        out = np.empty(x.shape, F16)
        casts.cast_into(out, x)
        np.testing.assert_array_equal(_bits(out), _bits(_numpy(F16, x)))
        y = np.linspace(-3, 3, casts.MIN_ELEMENTS * 2)  # float64: torch would round twice
        out16 = np.empty(y.shape, F16)
        casts.cast_into(out16, y)
        np.testing.assert_array_equal(_bits(out16), _bits(_numpy(F16, y)))
        assert calls == []
        assert casts.kernel_for(np.dtype(np.float64), F16) is None
        assert casts.kernel_for(BF16, F32) is None  # ml_dtypes widens as fast


def test_a_kernel_is_used_only_once_its_framework_is_imported() -> None:
    built: list[str] = []

    def factory() -> casts.HostCast:
        built.append("built")
        return lambda dst, src: np.copyto(dst, src, casting="unsafe")

    with only(None):
        casts.register("nowhere", "ringflow_test_not_imported_module", factory)
        assert casts.kernel_for(F32, F16) is None
        casts.register("numpy-as-framework", "numpy", factory)
        found = casts.kernel_for(F32, F16)
        assert found is not None and found[0] == "numpy-as-framework" and built == ["built"]
        casts.kernel_for(F32, F16)
        assert built == ["built"]  # built once


@pytest.mark.parametrize("shm", [False, True], ids=["ring", "shm"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_compressed_allreduce_bits_equal_numpys_casts(n: int, shm: bool) -> None:
    """The whole path (pack, reduce, unpack; reducescatter's casts): kernels against numpy."""
    _framework("torch")
    length = casts.CHUNK + 4097

    def body(rank: int, rf) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(rank)
        x = rng.standard_normal(length).astype(F32) * np.float32(1000 * (rank + 1))
        x[rank * 7] = np.nan if rank == n - 1 else x[rank * 7]
        small = np.arange(5, dtype=F32) * (rank + 1)
        outs = []
        for comp in (rf.Compression.fp16, rf.Compression.bf16):
            outs += rf.grouped_allreduce([x, small], name=f"g.{comp.name}", op=rf.Average,
                                         compression=comp)
            outs.append(rf.allreduce(x, name=f"p.{comp.name}", op=rf.Sum, compression=comp,
                                     prescale_factor=0.5))
            outs.append(rf.reducescatter(x, name=f"rs.{comp.name}", compression=comp))
        return outs

    with only("torch") as calls:
        fast = run_engines(n, body, shm=shm)
        assert calls
    with only(None):
        slow = run_engines(n, body, shm=shm)
    for a_rank, b_rank in zip(fast, slow, strict=True):
        for a, b in zip(a_rank, b_rank, strict=True):
            assert a.dtype == b.dtype == F32
            np.testing.assert_array_equal(_bits(a), _bits(b))
    assert ringflow.Compression.fp16.wire == F16
