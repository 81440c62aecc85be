"""A ringflow error raises the ``tf.errors`` class Horovod's op raises (its ``ConvertStatus``),
keeping ringflow's class and text: eagerly, in ``tf.function`` and in a TF1 session.

The graph cases run the op machinery of ``ringflow.tensorflow.mpi_ops`` (``_call``) on a function
that fails as a collective would; no job is needed.
"""

from __future__ import annotations

import pickle

import pytest

from ringflow import errors

pytestmark = pytest.mark.timeout(60)

tf = mpi_ops = status = None  # imported by _imports

#: A ringflow error and the name of the ``tf.errors`` class it raises as.
CASES = [
    (errors.MismatchError("ranks disagree on dtype of tensor 'x'"), "FailedPreconditionError"),
    (errors.NotInitializedError("call init() first"), "FailedPreconditionError"),
    (errors.TensorError("alltoall 'x': splits need one per rank"), "InvalidArgumentError"),
    (errors.ShutdownError("the engine was shut down"), "UnknownError"),
    (errors.StallError("ranks 1 never submitted 'x'"), "UnknownError"),
    (errors.PeerError("lost rank 1: the connection was closed"), "UnknownError"),
    (errors.UnsupportedError("not implemented"), "UnimplementedError"),
]


@pytest.fixture(scope="module", autouse=True)
def _imports() -> None:
    """TensorFlow and ringflow.tensorflow's ops: imported when a test here first runs, not at
    collection (tests/conftest.py: "TensorFlow at collection")."""
    global tf, mpi_ops, status
    tf = pytest.importorskip("tensorflow")
    from ringflow.tensorflow import mpi_ops, status


def _failing(exc: BaseException):
    def fn(*arrays):
        raise exc
    return fn


@pytest.mark.parametrize(("exc", "tf_name"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_eager_error_is_both_classes_with_the_same_text(exc: BaseException, tf_name: str) -> None:
    with pytest.raises(getattr(tf.errors, tf_name)) as info:
        mpi_ops._call(_failing(exc), [tf.constant([1.0])], [tf.float32], None)
    assert isinstance(info.value, type(exc))
    assert isinstance(info.value, errors.RingflowError)
    assert str(info.value) == str(exc) and info.value.message == str(exc)
    assert info.value.__cause__ is exc
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and str(again) == str(exc)


@pytest.mark.parametrize(("exc", "tf_name"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_tf_function_error_has_horovods_class_and_ringflow_text(exc: BaseException,
                                                              tf_name: str) -> None:
    @tf.function
    def op(x):
        return mpi_ops._call(_failing(exc), [x], [tf.float32, tf.int32], "HorovodTest")

    with pytest.raises(getattr(tf.errors, tf_name)) as info:
        op(tf.constant([1.0]))
    assert f"{type(exc).__name__}: {exc}" in str(info.value)


@pytest.mark.parametrize(("exc", "tf_name"), CASES[:3],
                         ids=[type(e).__name__ for e, _ in CASES[:3]])
def test_session_error_has_horovods_class(exc: BaseException, tf_name: str) -> None:
    with tf.Graph().as_default():
        out = mpi_ops._call(_failing(exc), [tf.constant([1.0])], [tf.float32], "HorovodTest")
        with tf.compat.v1.Session() as sess, pytest.raises(getattr(tf.errors, tf_name)) as info:
            sess.run(out)
    assert f"{type(exc).__name__}: {exc}" in str(info.value)


def test_graph_op_still_returns_values_and_chains() -> None:
    @tf.function
    def op(x):
        a = mpi_ops._call(lambda v: [v * 2], [x], [tf.float32], "A")[0]
        return mpi_ops._call(lambda v: [v + 1], [a], [tf.float32], "B")[0]

    assert op(tf.constant([1.0, 2.0])).numpy().tolist() == [3.0, 5.0]


def test_other_errors_are_left_alone() -> None:
    assert status.tf_class(ValueError("x")) is None
    assert status.tf_class(errors.ConfigError("x")) is None
    plain = KeyError("k")
    assert status.typed(plain) is plain


def test_results_of_any_alignment_become_tensors() -> None:
    """TensorFlow aborts the process on an unaligned buffer: results go through DLPack only when
    aligned, else they are copied (numpy's small arrays are 16-byte aligned)."""
    import numpy as np

    for n in range(1, 200, 3):
        array = np.arange(n, dtype=np.float64)
        for got in (mpi_ops._tensor(array, tf.float64),
                    mpi_ops._tensor(array.reshape(1, n), tf.float64),
                    mpi_ops._tensor(array[1:], tf.float64)):
            want = array[n - got.shape[-1]:].sum()
            assert float(tf.reduce_sum(got - tf.reduce_sum(got) * 0)) == want
