"""ringflow.tensorflow pieces that need no running job: naming, grouping, wrappers, and the
contractual error messages raised before any collective starts."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow.compression import Compressor
from ringflow.errors import ConfigError, RingflowError, TensorError

pytestmark = pytest.mark.timeout(60)

# imported by _imports
tf = keras = hvd = hvd_keras = gradient_tape = mpi_ops = keras_optimizer = None


@pytest.fixture(scope="module", autouse=True)
def _imports() -> None:
    """TensorFlow, Keras and ringflow.tensorflow: imported when a test here first runs, not at
    collection (tests/conftest.py: "TensorFlow at collection")."""
    global tf, keras, hvd, hvd_keras, gradient_tape, mpi_ops, keras_optimizer
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import ringflow.tensorflow as hvd
    import ringflow.tensorflow.keras as hvd_keras
    from ringflow.tensorflow import gradient_tape, mpi_ops
    from ringflow.tensorflow.keras import optimizer as keras_optimizer


def test_normalize_name_makes_valid_op_names() -> None:
    assert mpi_ops._normalize_name("dense/kernel:0") == "dense_kernel_0"
    assert mpi_ops._normalize_name("ok_Name1") == "ok_Name1"


def test_graph_names_are_scoped_unique_and_deterministic() -> None:
    names: list[str | None] = []

    @tf.function
    def trace(x):
        with tf.name_scope("tower"):
            names.append(mpi_ops._op_name("Allreduce", [x], "grads"))
            names.append(mpi_ops._op_name("Allreduce", [x], "grads"))
            names.append(mpi_ops._op_name("Allreduce", [x], "grads", ignore_name_scope=True))
        return x

    trace(tf.constant(1.0))
    assert names == ["tower/grads", "tower/grads_1", "grads"]
    assert mpi_ops._op_name("Allreduce", [tf.constant(1.0)], None) is None  # eager: call order


@pytest.mark.parametrize(("n", "num_groups", "want"), [
    (5, 0, [[0, 1, 2, 3, 4]]),  # all ready at once: one batch
    (5, 2, [[0, 1, 2], [3, 4]]),  # Horovod's split_list: the first groups take the rest
    (3, 7, [[0], [1], [2]]),
    (0, 0, []),
])
def test_gradient_batches(n: int, num_groups: int, want: list[list[int]]) -> None:
    assert gradient_tape._batches(n, [object()] * n, num_groups, None) == want


def test_explicit_groups_then_the_rest_as_one_batch() -> None:
    a, b, c, d, e = (tf.Variable(float(i)) for i in range(5))
    assert gradient_tape._batches(5, [a, b, c, d, e], 0, [[c, a], [d]]) == [[2, 0], [3], [1, 4]]
    assert gradient_tape._batches(5, [a, b, c, d, e], 0, 2) == [[0, 1, 2], [3, 4]]


def test_predivide_needs_average() -> None:
    with pytest.raises(TensorError, match=r"gradient_predivide_factor=2\.0 needs op=Average"):
        gradient_tape.allreduce_gradients([tf.ones(1)], None, op=hvd.Sum,
                                          gradient_predivide_factor=2.0)
    with pytest.raises(ConfigError, match="needs op=Average"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum,
                                       gradient_predivide_factor=2.0)


def test_backward_passes_per_step_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="backward_passes_per_step must be >= 1, got 0"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)


def test_sparse_allreduce_rejects_min() -> None:
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        # Horovod's TensorFlow raises NotImplementedError; ringflow's error is also a TensorError
        with pytest.raises(TensorError, match=f"supports op Sum or Average, not {op.name}"):
            hvd.allreduce(slices, op=op)
        with pytest.raises(NotImplementedError):
            hvd.grouped_allreduce([tf.ones([2]), slices], op=op)


def test_sparse_allreduce_rejects_scale_factors() -> None:
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    for scales in ({"prescale_factor": 0.5}, {"postscale_factor": 2.0}):
        with pytest.raises(NotImplementedError, match="pre/postscale_factor are not supported"):
            hvd.allreduce(slices, op=hvd.Sum, **scales)


def test_object_helpers_refuse_tf_function() -> None:
    for fn in (lambda: hvd.broadcast_object(1), lambda: hvd.allgather_object(1)):
        with pytest.raises(TensorError, match=r"cannot run inside tf\.function"):
            tf.function(fn, autograph=False)()


def test_broadcast_global_variables_is_for_graph_mode() -> None:
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)
    with tf.Graph().as_default():
        assert hvd.broadcast_global_variables(0).type == "NoOp"  # no global variables: no op


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_compression_casts_tensorflow_tensors(graph: bool) -> None:
    """Horovod's ``Compression.fp16.compress/decompress`` on tensors, eagerly and in a graph."""
    def run(fn):
        return tf.function(fn)() if graph else fn()

    for dtype, wire in ((tf.float64, tf.float16), (tf.float32, tf.float16),
                        (tf.float16, tf.float16), (tf.int32, tf.int32), (tf.bool, tf.bool)):
        def roundtrip(dtype=dtype, wire=wire):
            compressed, ctx = hvd.Compression.fp16.compress(tf.ones([3, 2], dtype))
            assert compressed.dtype == wire
            out = hvd.Compression.fp16.decompress(compressed, ctx)
            assert out.dtype == dtype
            return out

        assert run(roundtrip).numpy().tolist() == [[1, 1]] * 3
    same, ctx = hvd.Compression.none.compress(tf.ones([2], tf.float64))
    assert same.dtype == tf.float64 and hvd.Compression.none.decompress(same, ctx) is same
    half, ctx = hvd.Compression.fp16.compress(np.ones(2))  # numpy keeps the core's behaviour
    assert half.dtype == np.float16 and hvd.Compression.fp16.decompress(half, ctx).dtype == "f8"
    assert isinstance(hvd.Compression.bf16, Compressor)  # still handed to the engine


def test_broadcast_global_variables_points_to_the_callback() -> None:
    with pytest.raises(RingflowError, match="BroadcastGlobalVariablesCallback"):
        hvd_keras.broadcast_global_variables(0)


def test_distributed_optimizer_is_the_same_class_by_name_and_config() -> None:
    base = keras.optimizers.Adam(0.01, beta_1=0.8)
    opt = hvd_keras.DistributedOptimizer(base, backward_passes_per_step=3)
    assert isinstance(opt, keras.optimizers.Adam)
    assert type(opt).__name__ == "Adam" and type(opt).__module__ == type(base).__module__
    assert opt.name == "DistributedAdam"
    config = opt.get_config()
    assert {k: v for k, v in config.items() if k != "name"} == {
        k: v for k, v in base.get_config().items() if k != "name"}
    again = type(opt).from_config(config)  # what load_model relies on
    assert again._ringflow_options["backward_passes_per_step"] == 3
    rewrapped = keras_optimizer.wrap_optimizer_class(type(opt))
    assert rewrapped.__mro__[2] is keras.optimizers.Adam  # no double wrapping


def test_distributed_tape_subclasses_the_tape() -> None:
    tape = hvd.DistributedGradientTape(tf.GradientTape(persistent=True))
    assert isinstance(tape, tf.GradientTape) and type(tape).__name__ == "GradientTape"
    assert tape._persistent


def test_schedule_with_constant_multiplier_is_staircase() -> None:
    cb = hvd_keras.callbacks.LearningRateScheduleCallback(0.1, 0.5, staircase=False)
    assert cb.staircase and cb.multiplier(3) == 0.5
