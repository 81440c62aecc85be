"""The two NCCL providers' host side, as threads (issue 33).

* cupy's binding: the unique id in both of cupy's forms (13: a tuple of signed chars, 14:
  bytes), against the stand-in's Cython-style type checks (tests/standins), so that a change of
  cupy's API fails here and not on a user's GPU;
* torch's ProcessGroupNCCL: :class:`~ringflow.algorithms.nccl_torch.TorchNccl` built over
  ``ProcessGroupGloo`` (the same store, the same calls), with ringflow's store behind torch's
  ``Store`` interface, running every composed collective of :mod:`ringflow.algorithms.device`
  on torch tensors at 1-4 ranks against closed forms.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringflow.algorithms import nccl
from ringflow.ops import ReduceOp
from ringflow.rendezvous import MemoryStore

pytestmark = pytest.mark.timeout(120)

STANDINS = str(Path(__file__).resolve().parents[1] / "standins")


def _threads(n: int, fn: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # re-raised below with its rank
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 60 s"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("api", [12, 13, 14])
def test_the_unique_id_survives_the_store_in_each_of_cupys_forms(api: int) -> None:
    raw = bytes((i * 37) % 256 for i in range(128))
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    for uid in (raw, signed):
        text = nccl.encode_unique_id(uid)
        assert text == raw.hex().encode()
        assert nccl.decode_unique_id(text, api) == (raw if api >= 14 else signed)
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.encode_unique_id(raw[:5])


@pytest.fixture(params=["13.6.0", "14.2.0"])
def standin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
            tmp_path: Path) -> Iterator[Any]:
    """The cupy stand-in of one API generation, imported for this test only."""
    monkeypatch.setenv("CUPY_STANDIN_VERSION", request.param)
    monkeypatch.setenv("CUPY_STANDIN_DEVICES", "4")
    monkeypatch.setenv("CUPY_STANDIN_NCCL_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(STANDINS)
    saved = {k: v for k, v in sys.modules.items() if k == "cupy" or k.startswith("cupy.")}
    for k in saved:
        del sys.modules[k]
    importlib.invalidate_caches()
    import cupy

    assert getattr(cupy, "STANDIN", False)
    yield cupy
    for k in [k for k in sys.modules if k == "cupy" or k.startswith("cupy.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_the_stand_in_refuses_the_other_generations_unique_id(standin: Any) -> None:
    from cupy.cuda import nccl as binding

    uid = binding.get_unique_id()
    other = tuple(uid) if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)
    with pytest.raises(TypeError, match="Argument 'commId' has incorrect type"):
        binding.NcclCommunicator(1, other, 0)
    comm = binding.NcclCommunicator(1, uid, 0)
    with pytest.raises(TypeError, match="an integer is required"):
        comm.allReduce(1.5, 0, 1, binding.NCCL_FLOAT32, binding.NCCL_SUM, 0)
    with pytest.raises(OverflowError):
        comm.allReduce(0, 0, -1, binding.NCCL_FLOAT32, binding.NCCL_SUM, 0)
    comm.destroy()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cupy_nccl_primitives_as_threads(standin: Any, n: int) -> None:
    cp = standin
    store = MemoryStore()

    def rank(r: int) -> list[float]:
        cp.cuda.Device(r).use()
        comm = nccl.CupyNccl(r, n, store, "t/", r, 30.0)
        x = cp.full(5, r + 1, np.float32)
        comm.allreduce(x, ReduceOp.SUM)
        comm.wait("allreduce")
        y = cp.empty(5 * n, np.float32)
        comm.allgather(cp.full(5, r, np.float32), y)
        comm.wait("allgather")
        b = cp.full(3, r, np.int64)
        comm.broadcast(b, n - 1)
        comm.wait("broadcast")
        assert b.get().tolist() == [n - 1] * 3
        comm.close()
        return [*x.get().tolist(), *y.get().tolist()]

    for got in _threads(n, rank):
        assert got[:5] == [n * (n + 1) / 2] * 5
        assert got[5:] == [float(k) for k in range(n) for _ in range(5)]


# --- torch's provider over gloo ----------------------------------------------------------------


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class _Asked:
    """A gloo work that reports completion only inside ``wait()``: asked, it waits."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def is_completed(self) -> bool:
        return bool(self._work.wait())

    def wait(self) -> bool:
        return True


class _Gloo:
    """ProcessGroupGloo, whose reduce-scatter (an emulation in gloo), send and recv complete
    only inside ``wait()`` (their ``is_completed()`` stays False, unlike NCCL's): the first is
    waited for at the call, the others when asked. Everything else is gloo's own."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        import torch.distributed as dist

        self._pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def _reduce_scatter_base(self, out: Any, inp: Any, opts: Any) -> _Done:
        self._pg._reduce_scatter_base(out, inp, opts).wait()
        return _Done()

    def send(self, tensors: Any, peer: int, tag: int) -> _Asked:
        return _Asked(self._pg.send(tensors, peer, tag))

    def recv(self, tensors: Any, peer: int, tag: int) -> _Asked:
        return _Asked(self._pg.recv(tensors, peer, tag))


_gloo = _Gloo


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_provider_runs_every_composed_collective(n: int) -> None:
    torch = pytest.importorskip("torch")
    from ringflow.algorithms import device
    from ringflow.algorithms.nccl_torch import TorchNccl
    from ringflow.devices.torch_tensors import TorchNamespace

    store = MemoryStore()
    ns = TorchNamespace()
    total = n * (n + 1) // 2

    def rank(r: int) -> str:
        comm = TorchNccl(r, n, store, "g/", 0, 30.0, group=_gloo)
        for length in sorted({0, 1, 1001}):
            x = torch.full((length,), float(r + 1))
            device.allreduce(comm, ns, x, ReduceOp.AVERAGE, 2.0, "avg")
            torch.testing.assert_close(x, torch.full((length,), 2.0 * total / n))
        x = torch.full((4,), r + 1, dtype=torch.int32)
        device.allreduce(comm, ns, x, ReduceOp.SUM, 1.0, "int")
        assert x.tolist() == [total] * 4
        got = device.allgather(comm, ns, torch.full((r + 1, 2), float(r)), list(range(1, n + 1)),
                               "ragged")
        assert got.tolist() == [[float(k)] * 2 for k in range(n) for _ in range(k + 1)]
        out = torch.full((3,), float(r))
        device.broadcast(comm, ns, out, n - 1, "bcast")
        assert out.tolist() == [float(n - 1)] * 3
        mine = device.reducescatter(comm, ns, torch.full((n + 1, 2), float(r + 1)),
                                    ReduceOp.SUM, 1.0, 1.0, np.dtype(np.float32), "rs")
        assert mine.tolist() == [[float(total)] * 2] * (2 if r == 0 else 1)
        rows = torch.cat([torch.full((d + 1,), 10 * r + d) for d in range(n)])
        got = device.alltoall(comm, ns, rows, [d + 1 for d in range(n)], [r + 1] * n, "a2a")
        assert got.tolist() == [10 * s + r for s in range(n) for _ in range(r + 1)]
        got = device.gather(comm, ns, torch.full((r + 1,), r), list(range(1, n + 1)), 0, "g")
        if r == 0:
            assert got.tolist() == [k for k in range(n) for _ in range(k + 1)]
        comm.close()
        return "ok"

    assert _threads(n, rank) == ["ok"] * n


def test_torch_provider_stops_waiting_when_the_job_fails() -> None:
    """Rank 1 never joins the allreduce; when the job fails (a peer lost), rank 0's wait ends
    with the job's own error, not after the timeout."""
    torch = pytest.importorskip("torch")
    from ringflow.algorithms.nccl_torch import TorchNccl
    from ringflow.errors import PeerError

    store = MemoryStore()
    failed = threading.Event()

    def check() -> None:
        if failed.is_set():
            raise PeerError("lost rank 1: the connection was closed")

    def rank(r: int) -> str:
        comm = TorchNccl(r, 2, store, "f/", 0, 30.0, check, group=_gloo)
        if r == 1:
            return "absent"
        comm.allreduce(torch.ones(3), ReduceOp.SUM)
        failed.set()
        with pytest.raises(PeerError, match="lost rank 1"):
            comm.wait("allreduce")
        return "failed"

    assert _threads(2, rank) == ["failed", "absent"]
