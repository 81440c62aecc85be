"""TensorFlow's DistributedGradientTape with the compressors with state, ranks as threads.

Eagerly, at 2-4 ranks: each compressed gradient is ``c * sum_w (D_w - e_w')`` from the
ranks' own gradients and errors (the state of :func:`exchange_for`, which persists across
tapes), the small ones are exact, and every rank gets the same bits. A graph's ops run on
TensorFlow's threads, which no rank's engine is bound to: the graph path is tested with
processes (tests/multiproc/test_compressed_processes.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(180)

tf = hvd = exchange_for = None  # imported by _imports
OPTIONS = {"powersgd": {"rank": 2, "min_elements": 64},
           "randomk": {"fraction": 0.3, "min_elements": 64}}


@pytest.fixture(scope="module", autouse=True)
def _imports() -> None:
    """TensorFlow and ringflow.tensorflow: imported when a test here first runs, not at
    collection (tests/conftest.py: "TensorFlow at collection")."""
    global tf, hvd, exchange_for
    tf = pytest.importorskip("tensorflow")
    import ringflow.tensorflow as hvd
    from ringflow.tensorflow.gradient_tape import exchange_for


def compressor(kind: str) -> Any:
    return getattr(hvd.Compression, kind)(**OPTIONS[kind])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_tape_result_is_the_closed_form(kind: str, n: int) -> None:
    options = compressor(kind)

    def body(r: int, rf: Any) -> Any:
        w = tf.Variable(np.linspace(-1, 1, 24 * 10, dtype=np.float32).reshape(24, 10))
        b = tf.Variable(np.zeros(10, np.float32))

        def grads(x: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2)
            raw = tape.gradient(loss, [w, b])
            tape2 = tf.GradientTape()
            with tape2:
                loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2)
            return raw, hvd.DistributedGradientTape(tape2, compression=options).gradient(
                loss, [w, b])

        step = grads
        records = []
        for s in range(3):
            x = tf.constant(np.random.default_rng([r, s]).standard_normal((5, 24)), tf.float32)
            ex = exchange_for(options)
            before = {k: np.array(v) for k, v in ex.errors.items()}
            raw, reduced = step(x)
            after = {k: np.array(v) for k, v in ex.errors.items()}
            records.append(([g.numpy() for g in raw], before, after,
                            [g.numpy() for g in reduced]))
        return records

    out = run_engines(n, body, deadline=120)
    for s in range(3):
        name = next(iter(out[0][s][2]))
        total = 0
        for r in range(n):
            raw, before, after, _ = out[r][s]
            d = raw[0].astype(np.float64) + before.get(name, np.zeros(240)).reshape(24, 10)
            total = total + d - after[name].reshape(24, 10)
        np.testing.assert_allclose(out[0][s][3][0], total / n, atol=1e-5)
        exact_b = sum(out[r][s][0][1] for r in range(n)) / n
        np.testing.assert_allclose(out[0][s][3][1], exact_b, atol=1e-6)
        for r in range(1, n):
            for a, c in zip(out[r][s][3], out[0][s][3], strict=True):
                np.testing.assert_array_equal(a, c)


def test_sparse_gradients_take_the_exact_sparse_path() -> None:
    def body(r: int, rf: Any) -> Any:
        emb = tf.Variable(np.ones((50, 30), np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [1, 3 + r]) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=compressor("powersgd"))
        (g,) = tape.gradient(loss, [emb])
        return tf.convert_to_tensor(g).numpy()

    out = run_engines(2, body, deadline=60)
    expected = np.zeros((50, 30), np.float32)
    expected[1] = 2.0  # both ranks: 2 * 1, averaged
    expected[3] = expected[4] = 1.0  # one rank each: 2 * 1 / 2
    np.testing.assert_allclose(out[0], expected)
    np.testing.assert_array_equal(out[1], out[0])


def test_elastic_states_commit_restore_and_sync_the_compressors() -> None:
    # TensorFlowState carries this rank's compressed exchanges: restore() rolls their error
    # feedback and warm-start factors back to the commit (so a replayed step gives the same
    # bits), sync() gives every rank rank 0's factors and keeps each rank's own errors (a
    # newcomer's: none).
    from ringflow.tensorflow.elastic import TensorFlowState
    from ringflow.tensorflow.gradient_tape import compressor_states, load_compressor_states

    options = hvd.Compression.powersgd(rank=2, min_elements=64)
    n = 3

    def body(r: int, rf: Any) -> Any:
        w = tf.Variable(np.linspace(-1, 1, 240, dtype=np.float32).reshape(24, 10))

        def step(s: int) -> np.ndarray:
            x = tf.constant(np.random.default_rng([r, s]).standard_normal((5, 24)), tf.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.tanh(x @ w) ** 2)
            (g,) = hvd.DistributedGradientTape(tape, compression=options).gradient(loss, [w])
            w.assign_sub(0.1 * g)
            return g.numpy()

        step(0)
        state = TensorFlowState([w], step=1)
        committed = compressor_states()
        first = step(1)
        moved = compressor_states()
        state.restore()
        restored = compressor_states()
        again = step(1)
        state.restore()
        if r == n - 1:
            load_compressor_states({})  # as a newcomer: no exchange state at all
        before_sync = compressor_states()
        state.sync()
        synced = compressor_states()
        after = step(1)
        return committed, moved, restored, first, again, before_sync, synced, after

    out = run_engines(n, body, deadline=120)
    for r in range(n):
        committed, moved, restored, first, again, before_sync, synced, after = out[r]
        (key,) = committed
        name = next(iter(committed[key]["errors"]))
        assert not np.array_equal(moved[key]["errors"][name], committed[key]["errors"][name])
        for part in ("errors", "factors"):
            np.testing.assert_array_equal(restored[key][part][name], committed[key][part][name])
        np.testing.assert_array_equal(again, first)  # the replayed step, bit for bit
        np.testing.assert_array_equal(synced[key]["factors"][name],
                                      out[0][6][key]["factors"][name])
        if r == n - 1:
            assert before_sync[key]["factors"] == before_sync[key]["errors"] == {}
            assert synced[key]["errors"] == {}
        else:
            np.testing.assert_array_equal(synced[key]["errors"][name],
                                          committed[key]["errors"][name])
        np.testing.assert_array_equal(after, out[0][7])  # the same factors: the same result
