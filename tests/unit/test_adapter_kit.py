"""The adapter kit's framework-free pieces (ringflow._adapter); its gradient rules and object
helpers run through both adapters in tests/multiproc/test_conformance_*.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ringflow import _adapter as kit
from ringflow.compression import Compression
from ringflow.errors import TensorError
from ringflow.ops import ReduceOp


def test_resolve_op_follows_horovod() -> None:
    assert kit.resolve_op(None, None) == ReduceOp.AVERAGE
    assert kit.resolve_op(ReduceOp.MAX, None) == ReduceOp.MAX
    assert kit.resolve_op(1, None) is ReduceOp.SUM
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        kit.resolve_op(ReduceOp.SUM, True)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert kit.resolve_op(None, False) == ReduceOp.SUM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert kit.resolve_op(None, True) == ReduceOp.AVERAGE


def test_names() -> None:
    assert kit.op_name("allreduce", "w") == "allreduce.w"
    assert kit.op_name("broadcast", None) is None
    assert kit.grad_name("allreduce.w") == "allreduce.w.grad"
    assert kit.grad_name(None) is None


def test_compressed_hands_core_compressors_to_the_engine_and_wraps_others() -> None:
    seen = []

    def run(xs, core):
        seen.append(core)
        return [x * 2 for x in xs]

    assert kit.compressed(Compression.fp16, [np.ones(2)], run)[0].tolist() == [2.0, 2.0]
    assert seen[-1] is Compression.fp16

    class Halve:  # a Horovod-style compressor: compress -> (tensor, ctx), decompress(tensor, ctx)
        @staticmethod
        def compress(t):
            return t / 2, "ctx"

        @staticmethod
        def decompress(t, ctx):
            assert ctx == "ctx"
            return t + 1

    assert kit.compressed(Halve, [np.full(2, 4.0)], run)[0].tolist() == [5.0, 5.0]
    assert seen[-1] is Compression.none


class _Set:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_sparse_scale() -> None:
    assert kit.sparse_scale(ReduceOp.SUM, 1.0, 1.0, _Set(4), "e") == 1.0
    assert kit.sparse_scale(ReduceOp.AVERAGE, 2.0, 3.0, _Set(4), "e") == 1.5
    with pytest.raises(TensorError, match="sparse tensor e supports op Sum or Average, not MAX"):
        kit.sparse_scale(ReduceOp.MAX, 1.0, 1.0, _Set(2), "e")


def test_invalid_raises_its_reason_when_converted() -> None:
    with pytest.raises(TypeError, match="a CUDA tensor"):
        np.asarray(kit.Invalid("a CUDA tensor"))


def test_every_differentiable_collective_has_one_rule() -> None:
    assert set(kit.GRADIENTS) == {"allreduce", "allgather", "broadcast", "alltoall",
                                  "reducescatter"}


class _P2P:
    """Records what the point-to-point rules ask of a framework."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def send(self, x: object, dst: int, tag: object) -> None:
        self.calls.append(("send", x, dst, tag))

    def recv(self, src: int, tag: object, like: object) -> object:
        self.calls.append(("recv", src, tag, like))
        return "gradient"


def test_point_to_point_gradients_travel_back_on_the_forward_message_tag() -> None:
    ops = _P2P()
    like = ((2, 3), "float64")
    dx = kit.P2P_GRADIENTS["send"](ops, ["dtoken"], kit.P2PSpec("send", 2, 7, 41, like))
    assert dx == ["gradient"] and ops.calls == [("recv", 2, (7, 41), like)]
    ops.calls.clear()
    assert kit.P2P_GRADIENTS["recv"](ops, ["dy"], kit.P2PSpec("recv", 0, 7, 41)) == []
    assert ops.calls == [("send", "dy", 0, (7, 41))]
    assert kit.grad_tag(7, 41) != 7  # a gradient tag is never a user's (an int)
