"""ringflow.tensorflow.keras: DistributedOptimizer in model.fit, callbacks, load_model.

Run as ``ringflow-run -np N python keras_worker.py OUTDIR``. Each rank also trains a plain
single-process reference on the union of all ranks' batches, so "n ranks with batch B equal one
process with batch n*B" is checked without a second launch.
"""

from __future__ import annotations

import os
import sys

import keras
from common import check, close, finish, np, run

import ringflow.tensorflow.keras as hvd
from ringflow.errors import RingflowError

hvd.init()
r, n = hvd.rank(), hvd.size()
OUT = sys.argv[1]
B, STEPS = 8, 4
rng = np.random.RandomState(0)
X = rng.randn(STEPS * 2 * n * B, 6).astype(np.float32)
Y = (np.tanh(X @ rng.randn(6, 1)) + 0.1 * X[:, :1]).astype(np.float32)


def shard(a: np.ndarray, passes: int = 1) -> np.ndarray:
    """This rank's rows: within each group of passes*n*B rows, batch p*n + r for each pass p."""
    groups = a.reshape(-1, passes, n, B, *a.shape[1:])
    return groups[:, :, r].reshape(-1, *a.shape[1:])


def model(bn: type = keras.layers.BatchNormalization, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        # No bias before batch norm: its gradient is ~0 and Adam would amplify the rounding.
        keras.Input((6,)), keras.layers.Dense(8, use_bias=False), bn(momentum=0.5),
        keras.layers.Activation("tanh"), keras.layers.Dense(1),
    ])


def fit_equivalence() -> None:
    for label, make_opt in (("SGD", lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
                            ("Adam", lambda: keras.optimizers.Adam(0.01))):
        ref = model()
        ref.compile(make_opt(), "mse", jit_compile=False)
        ref.fit(X, Y, batch_size=n * B, epochs=2, shuffle=False, verbose=0)
        dist = model(hvd.SyncBatchNormalization)
        opt = hvd.DistributedOptimizer(make_opt())
        check(f"wrapped {label} is a {label}", isinstance(opt, type(make_opt()))
              and type(opt).__name__ == label)
        dist.compile(opt, "mse", jit_compile=False)
        dist.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0)
        for i, (got, want) in enumerate(zip(dist.get_weights(), ref.get_weights(), strict=True)):
            close(f"fit equivalence {label} weight {i}", got, want, atol=2e-5, rtol=1e-4)


def aggregation() -> None:
    """backward_passes_per_step=2 with averaging equals one step on both batches."""
    # Batch norm statistics differ per pass, so compare a model without batch norm.
    ref2, dist2 = _plain_model(), _plain_model()
    ref2.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", jit_compile=False)
    ref2.fit(X, Y, batch_size=2 * n * B, epochs=1, shuffle=False, verbose=0)
    opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                    backward_passes_per_step=2,
                                    average_aggregated_gradients=True)
    dist2.compile(opt2, "mse", jit_compile=False)
    dist2.fit(shard(X, 2), shard(Y, 2), batch_size=B, epochs=1, shuffle=False, verbose=0)
    for i, (got, want) in enumerate(zip(dist2.get_weights(), ref2.get_weights(), strict=True)):
        close(f"backward_passes_per_step=2 weight {i}", got, want, atol=2e-5, rtol=1e-4)
    check("iterations count every backward pass", int(opt2.iterations) == 2 * STEPS,
          int(opt2.iterations))


def _plain_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


class Recorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[dict] = []
        self.lrs: list[float] = []

    def on_batch_begin(self, batch, logs=None) -> None:
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.epochs.append(dict(logs or {}))


def callbacks() -> None:
    m = _plain_model(seed=100 + r)  # different initial weights on every rank
    m.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse",
              metrics=["mae"], jit_compile=False)
    raw, averaged, lr_seen = Recorder(), Recorder(), Recorder()
    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, verbose=0)
    sched = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5,
                                                       start_epoch=2)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
           hvd.callbacks.MetricAverageCallback(), averaged, warm, sched, lr_seen]
    m.fit(shard(X), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=cbs)
    w = m.get_weights()[0]
    gathered = hvd.allgather(w[None])
    check("BroadcastGlobalVariablesCallback: same weights on every rank",
          all(np.array_equal(gathered[0], g) for g in gathered), "weights differ")
    for e, (a, b) in enumerate(zip(raw.epochs, averaged.epochs, strict=True)):
        want = hvd.allreduce(np.asarray([a["loss"], a["mae"]]), name=f"check_metrics_{e}")
        close(f"MetricAverageCallback epoch {e}", [b["loss"], b["mae"]], want)
    steps = STEPS * 2
    lrs = np.asarray(lr_seen.lrs).reshape(3, steps)
    frac = np.arange(2 * steps) / steps
    close("warmup lr per batch", lrs[:2].ravel(), 0.1 * (frac * (n - 1) / 2 + 1) / n,
          atol=1e-7)
    close("warmup ends at initial_lr then schedule x0.5", lrs[2], np.full(steps, 0.05),
          atol=1e-7)
    check("lr logged", abs(lr_seen.epochs[-1]["lr"] - 0.05) < 1e-7, lr_seen.epochs[-1])


def best_checkpoint() -> None:
    m = _plain_model()
    m.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), "mse", jit_compile=False)
    path = os.path.join(OUT, f"best_{r}.keras")  # one path per rank: only rank 0 may write
    m.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0,
          validation_data=(shard(X), shard(Y)),
          callbacks=[hvd.callbacks.MetricAverageCallback(),
                     hvd.callbacks.BestModelCheckpoint(path, monitor="val_loss")])
    check("BestModelCheckpoint writes on rank 0 only", os.path.exists(path) == (r == 0),
          os.listdir(OUT))


def load_model() -> None:
    m = _plain_model()
    m.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse", jit_compile=False)
    m.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(OUT, "model.keras")
    if r == 0:
        m.save(path)
    hvd.allreduce(0, name="saved")  # a barrier: the file exists before anyone loads it
    plain = keras.models.load_model(path)
    check("saved model loads without ringflow", type(plain.optimizer).__mro__[1].__module__
          .startswith("keras"), type(plain.optimizer).__mro__)
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    check("load_model re-wraps the optimizer", type(opt).__mro__[1].__name__ ==
          "_DistributedMixin" and isinstance(opt, keras.optimizers.Adam), type(opt).__mro__)
    check("load_model keeps optimizer state", int(opt.iterations) == STEPS * 2,
          int(opt.iterations))
    loaded.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    gathered = hvd.allgather(loaded.get_weights()[0][None])
    check("training after load_model stays in sync",
          all(np.array_equal(gathered[0], g) for g in gathered))


def partial_and_helpers() -> None:
    m = _plain_model()
    local = m.layers[-1]
    m.compile(hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local]),
              "mse", jit_compile=False)
    m.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    kernels = hvd.allgather(m.layers[0].get_weights()[0][None])
    heads = hvd.allgather(local.get_weights()[0][None])
    check("partial: shared layer in sync", all(np.array_equal(kernels[0], k) for k in kernels))
    check("partial: local layer differs", n == 1 or not np.allclose(heads[0], heads[1]))
    close("keras allreduce", hvd.allreduce(float(r + 1), name="k_ar"), (n + 1) / 2)
    close("keras allreduce sum", hvd.allreduce([r + 1.0], op=hvd.Sum), [n * (n + 1) / 2])
    close("keras allgather", hvd.allgather([r], name="k_ag"), np.arange(n))
    close("keras broadcast", hvd.broadcast([r + 5.0], n - 1, name="k_bc"), [n + 4.0])
    close("keras reducescatter", hvd.reducescatter(np.ones([n, 2]) * (r + 1), name="k_rs"),
          np.full([1, 2], (n + 1) / 2))
    try:
        hvd.broadcast_global_variables(0)
    except RingflowError as exc:
        check("broadcast_global_variables explains", "BroadcastGlobalVariablesCallback"
              in str(exc))


def embedding() -> None:
    """IndexedSlices gradients: the sparse path (allgather) and sparse_as_dense agree with a
    single process on the union of the batches."""
    ids = np.random.RandomState(3).randint(0, 20, size=(STEPS * n * B, 3))
    target = np.random.RandomState(4).randn(STEPS * n * B, 1).astype(np.float32)

    def build() -> keras.Model:
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    ref = build()
    ref.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
    ref.fit(ids, target, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
    for dense in (False, True):
        m = build()
        m.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=dense),
                  "mse", jit_compile=False)
        m.fit(shard(ids), shard(target), batch_size=B, epochs=1, shuffle=False, verbose=0)
        for i, (got, want) in enumerate(zip(m.get_weights(), ref.get_weights(), strict=True)):
            close(f"embedding sparse_as_dense={dense} weight {i}", got, want, atol=2e-5)


run("fit_equivalence", fit_equivalence)
run("embedding", embedding)
run("aggregation", aggregation)
run("callbacks", callbacks)
run("best_checkpoint", best_checkpoint)
run("load_model", load_model)
run("partial_and_helpers", partial_and_helpers)
finish(r)
