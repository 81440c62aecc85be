"""The compressed gradient exchange (ringflow.compressed) at the thread tier, on numpy arrays.

Closed forms, at 1-4 ranks, several tensors in several batches (buckets), several steps: each
step's result is ``c * sum_w (D_w - e_w')`` (plus the server's ``E - E'`` for 1-bit), so over T
steps the sum of the results plus what still waits in the errors is exactly the sum of the
gradients (to float rounding); every rank gets the same bits; and the exact special cases
(PowerSGD of matrices inside its rank, random-k of everything, 1-bit of equal magnitudes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ringflow.compressed import Exchange, auto_decision
from ringflow.compression import Compression, parse
from ringflow.errors import ConfigError
from ringflow.ops import Average, Sum
from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(120)

SIZES = [1, 2, 3, 4]
SHAPES = {"w1": (40, 30), "w2": (17, 9, 3), "w3": (64, 5), "v": (101,)}
KINDS = {
    "powersgd": Compression.powersgd(rank=2, min_elements=1),
    "randomk": Compression.randomk(fraction=0.1, min_elements=1),
    "onebit": Compression.onebit(min_elements=1),
}
STEPS = 4


def grad(name: str, rank: int, step: int) -> np.ndarray:
    seed = [sum(map(ord, name)), rank, step]
    return np.random.default_rng(seed).standard_normal(SHAPES[name]).astype(np.float32)


def run_steps(n: int, options: Any, op: Any = Average, ranks: list[int] | None = None) -> list:
    """Every rank runs STEPS steps of two batches; returns per rank the results per step and
    the final errors (server errors too)."""

    def body(r: int, rf: Any) -> Any:
        ps = rf.global_process_set if ranks is None else rf.add_process_set(ranks)
        if not ps.included():
            return None
        ex = Exchange(options, op=op, process_set=ps)
        results = []
        for step in range(STEPS):
            tensors = {k: grad(k, r, step) for k in SHAPES}
            names = [k for k, t in tensors.items() if ex.compresses(t, str(t.dtype))]
            # two batches in an order that depends on the rank: buckets need not agree
            first, second = (names[:2], names[2:]) if r % 2 else (names[2:], names[:2])
            batches = [ex.start(b, [tensors[k] for k in b]) for b in (first, second)]
            for items in batches:
                ex.middle(items)
            for items in batches:
                ex.end(items)
            results.append({k: tensors[k].copy() for k in names})
        return results, {k: np.array(v) for k, v in ex.errors.items()}, dict(ex.server)

    return run_engines(n, body, deadline=60)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_accumulated_residual_is_what_was_not_sent(n: int, kind: str) -> None:
    out = run_steps(n, KINDS[kind])
    results = [o[0] for o in out]
    for step in range(STEPS):  # the same bits on every rank
        for k in results[0][step]:
            for r in range(1, n):
                np.testing.assert_array_equal(results[r][step][k], results[0][step][k])
    names = list(results[0][0])
    assert names == (["w1", "w2", "w3", "v"] if kind != "powersgd" else ["w1", "w2", "w3"])
    for k in names:
        total = sum(results[0][s][k].astype(np.float64) for s in range(STEPS))
        sent_all = sum(grad(k, r, s).astype(np.float64) for r in range(n) for s in range(STEPS))
        waiting = sum(out[r][1][k].reshape(SHAPES[k]).astype(np.float64) for r in range(n)) / n
        if kind == "onebit":  # the server's errors, each rank's chunk of the flat tensor
            flat = np.concatenate([out[r][2][k] for r in range(n)])[:np.prod(SHAPES[k])]
            waiting += flat.reshape(SHAPES[k])
        np.testing.assert_allclose(total + waiting, sent_all / n, rtol=0, atol=2e-4)
        # it did compress: something waits
        assert np.abs(waiting).max() > 1e-3


@pytest.mark.parametrize("n", SIZES)
def test_powersgd_exact_inside_its_rank(n: int) -> None:
    u = np.random.default_rng(1).standard_normal((30, 2))

    def body(r: int, rf: Any) -> Any:
        ex = Exchange(Compression.powersgd(rank=2, min_elements=1), op=Sum)
        outs = []
        for step in range(2):
            v = np.random.default_rng([r, step]).standard_normal((20, 2))
            x = (u @ v.T).astype(np.float64)  # rank 2, the same column space on every rank
            items = ex.start(["m"], [x])
            ex.middle(items)
            ex.end(items)
            outs.append((x, np.abs(ex.errors["m"]).max()))
        return outs

    out = run_engines(n, body, deadline=60)
    for step in range(2):
        exact = sum(u @ np.random.default_rng([r, step]).standard_normal((20, 2)).T
                    for r in range(n))
        np.testing.assert_allclose(out[0][step][0], exact, atol=1e-10)
        assert max(o[step][1] for o in out) < 1e-10


@pytest.mark.parametrize("n", SIZES)
def test_randomk_of_everything_and_onebit_of_equal_magnitudes_are_exact(n: int) -> None:
    def body(r: int, rf: Any) -> Any:
        x = grad("v", r, 0)
        a = Exchange(Compression.randomk(fraction=1.0, min_elements=1), op=Sum)
        items = a.start(["v"], [x])
        a.middle(items)
        a.end(items)
        y = np.where(np.arange(64) % 3 == 0, -0.5, 0.5).astype(np.float32)
        b = Exchange(Compression.onebit(min_elements=1), op=Sum)
        items = b.start(["y"], [y])
        b.middle(items)
        b.end(items)
        return x, y

    out = run_engines(n, body, deadline=60)
    np.testing.assert_allclose(out[0][0], sum(grad("v", r, 0) for r in range(n)), atol=1e-6)
    if n == 1:  # one sender: its signs and scale are its values
        np.testing.assert_array_equal(out[0][1], np.where(np.arange(64) % 3 == 0, -0.5, 0.5))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_process_set(kind: str) -> None:
    out = run_steps(3, KINDS[kind], ranks=[0, 2])
    assert out[1] is None
    for k, v in out[0][0][-1].items():
        np.testing.assert_array_equal(v, out[2][0][-1][k])


def test_auto_is_off_on_one_host_and_decides_by_bandwidth() -> None:
    def body(r: int, rf: Any) -> Any:
        ex = Exchange(Compression.auto())
        return ex.compresses(np.zeros((100, 100), np.float32), "float32"), ex.active

    assert run_engines(2, body, deadline=60) == [(False, False)] * 2
    assert auto_decision(False, 0.1, 2.0) and not auto_decision(False, 10.0, 2.0)
    assert not auto_decision(True, 0.1, 2.0)


def test_state_dict_round_trip_continues_identically() -> None:
    def body(r: int, rf: Any) -> Any:
        a = Exchange(Compression.powersgd(rank=2, min_elements=1))
        b = Exchange(Compression.powersgd(rank=2, min_elements=1))
        outs = []
        for step in range(3):
            if step == 2:
                b.load_state_dict(a.state_dict())
            for ex in (a, b) if step == 2 else (a,):
                x = grad("w1", r, step)
                items = ex.start(["w1"], [x])
                ex.middle(items)
                ex.end(items)
                outs.append(x)
        with pytest.raises(ConfigError, match="same compression"):
            Exchange(Compression.randomk()).load_state_dict(a.state_dict())
        return outs

    for outs in run_engines(2, body, deadline=60):
        np.testing.assert_array_equal(outs[-1], outs[-2])


def test_options_are_checked_and_parsed() -> None:
    assert parse("powersgd:rank=2") == Compression.powersgd(rank=2)
    assert parse("randomk:fraction=0.05").spec() == "randomk:fraction=0.05"
    assert parse("fp16") is Compression.fp16
    with pytest.raises(ConfigError, match="rank must be"):
        Compression.powersgd(rank=0)
    with pytest.raises(ConfigError, match="fraction must be"):
        parse("randomk:fraction=2")
    with pytest.raises(ConfigError, match="no option 'rnk'"):
        parse("powersgd:rnk=2")
    with pytest.raises(ConfigError, match="unknown compression"):
        parse("topk")


def test_timeline_shows_compress_exchange_decompress(tmp_path: Any) -> None:
    path = tmp_path / "timeline.json"

    def body(r: int, rf: Any) -> Any:
        ex = Exchange(KINDS["powersgd"])
        items = ex.start(["w1"], [grad("w1", r, 0)])
        ex.middle(items)
        ex.end(items)

    from ringflow.config import Config

    run_engines(2, body, Config(timeout_s=120, timeline_path=str(path)), deadline=60)
    text = path.read_text()
    for label in ("COMPRESS", "EXCHANGE", "DECOMPRESS"):
        assert text.count(f'"name":"{label}"') == 2, label  # one per rank
    assert '"name":"w1"' in text  # the tensor's row


def test_bad_configured_compression_names_the_variable() -> None:
    from ringflow.config import Config

    with pytest.raises(ConfigError, match="RINGFLOW_COMPRESSION: unknown compression 'zip'"):
        Config.from_env({"RINGFLOW_COMPRESSION": "zip"})
    assert Config.from_env({"RINGFLOW_COMPRESSION": "onebit"}).compression == "onebit"


@pytest.mark.parametrize("below", [1e9, 1e-9])
def test_auto_between_hosts_measures_and_every_rank_decides_alike(below: float,
                                                                  monkeypatch: Any) -> None:
    from ringflow import compressed

    monkeypatch.setattr(compressed.runtime, "cross_size", lambda: 2)  # as if on two hosts

    def body(r: int, rf: Any) -> Any:
        ex = Exchange(Compression.auto(Compression.randomk(0.5, min_elements=1), below))
        x = grad("v", r, 0)
        on = ex.compresses(x, "float32")
        if on:
            items = ex.start(["v"], [x])
            ex.middle(items)
            ex.end(items)
        return on, ex.state_dict()["active"]

    out = run_engines(3, body, deadline=60)
    assert out == [(below > 1, below > 1)] * 3


@pytest.mark.parametrize("kind", ["powersgd", "randomk-all", "onebit"])
def test_a_nan_on_one_rank_is_never_hidden(kind: str) -> None:
    options = {"randomk-all": Compression.randomk(fraction=1.0, min_elements=1)}.get(
        kind) or KINDS[kind]

    def body(r: int, rf: Any) -> Any:
        x = grad("w1", r, 0)
        if r == 1:
            x[3, 4] = np.nan
        ex = Exchange(options)
        items = ex.start(["w1"], [x])
        ex.middle(items)
        ex.end(items)
        return bool(np.isnan(x).any())

    assert run_engines(2, body, deadline=60) == [True, True]
