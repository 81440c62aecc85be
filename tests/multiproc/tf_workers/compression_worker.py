"""A DistributedGradientTape with PowerSGD inside tf.function, and the Keras DistributedOptimizer
with 1-bit in model.fit, through ringflow-run (tests/multiproc/test_tf_adapter.py).

Per step the compressed gradient is c * sum_w (D_w - e_w'): each rank allgathers its raw gradient
and its errors before and after, and checks the closed form; every rank checks it got rank 0's
bits. Prints "PASS compression rank r".
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import ringflow.tensorflow as hvd
import ringflow.tensorflow.keras as hvd_keras
from ringflow.tensorflow.gradient_tape import exchange_for

hvd.init()
r, n = hvd.rank(), hvd.size()
options = hvd.Compression.powersgd(rank=2, min_elements=64)
w = tf.Variable(np.linspace(-1, 1, 240, dtype=np.float32).reshape(24, 10))
b = tf.Variable(np.zeros(10, np.float32))


@tf.function
def step(x: tf.Tensor) -> tuple[list, list]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2)
    raw = tape.gradient(loss, [w, b])
    with tf.GradientTape() as tape2:
        loss = tf.reduce_sum(tf.tanh(x @ w + b) ** 2)
    return raw, hvd.DistributedGradientTape(tape2, compression=options).gradient(loss, [w, b])


for s in range(3):
    ex = exchange_for(options)
    before = {k: np.array(v) for k, v in ex.errors.items()}
    x = tf.constant(np.random.default_rng([r, s]).standard_normal((5, 24)), tf.float32)
    raw, reduced = step(x)
    (name,) = ex.errors
    e0 = before.get(name, np.zeros(240)).reshape(24, 10)
    e1 = np.asarray(ex.errors[name]).reshape(24, 10)
    mine = (raw[0].numpy().astype(np.float64) + e0 - e1)[None]
    total = hvd.allgather(tf.constant(mine)).numpy().sum(axis=0)
    np.testing.assert_allclose(reduced[0].numpy(), total / n, atol=1e-5)
    first = hvd.broadcast(reduced[0], root_rank=0, name=f"check.{s}").numpy()
    np.testing.assert_array_equal(reduced[0].numpy(), first)

# Keras: model.fit (a tf.function) with 1-bit; the replicas stay equal.
tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(4)])
opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05),
                                     compression=hvd.Compression.onebit(min_elements=256))
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
data = np.random.default_rng(r).standard_normal((64, 16)).astype(np.float32)
labels = (data[:, 0] > 0).astype(np.int64) + 2 * (data[:, 1] > 0)
hist = model.fit(data, labels, batch_size=16, epochs=3, verbose=0,
                 callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
for i, v in enumerate(model.trainable_variables):
    first = hvd.broadcast(v, root_rank=0, name=f"keras.{i}").numpy()
    np.testing.assert_array_equal(v.numpy(), first)
assert hist.history["loss"][-1] < hist.history["loss"][0], hist.history
print(f"PASS compression rank {r}", flush=True)
hvd.shutdown()
