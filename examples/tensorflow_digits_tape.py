"""A custom TensorFlow training loop with DistributedGradientTape on scikit-learn's digits.

    ringflow-run -np 2 python examples/tensorflow_digits_tape.py --steps 300

The Horovod recipe: scale the learning rate by the number of ranks, average gradients with
``DistributedGradientTape``, broadcast the initial state from rank 0 after the first step (when
the optimizer's slots exist), and average the evaluation over the ranks.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import ringflow.tensorflow as hvd

import digits  # examples/digits.py: scikit-learn's digits, read with numpy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.002, help="single-rank learning rate")
parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per pool")
args = parser.parse_args()

tf.config.threading.set_inter_op_parallelism_threads(args.threads)
tf.config.threading.set_intra_op_parallelism_threads(args.threads)
hvd.init()
rank, size = hvd.rank(), hvd.size()

images, labels = digits.load()
x = (images.reshape(len(images), 64) / 16.0).astype("float32")
y = labels
order = np.random.RandomState(0).permutation(len(x))
x, y = x[order], y[order]
split = int(0.8 * len(x))
train = (tf.data.Dataset.from_tensor_slices((x[:split], y[:split]))
         .shard(size, rank).repeat().shuffle(1000, seed=rank).batch(args.batch_size))
x_test, y_test = x[split:][rank::size], y[split:][rank::size]

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10),
])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(args.lr * size)


@tf.function
def training_step(images, labels):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


for step, (images, labels) in enumerate(train.take(args.steps)):
    loss = training_step(images, labels)
    if step == 0:
        # Every rank continues from rank 0's model and optimizer state.
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)
    if step % 50 == 0 and rank == 0:
        print(f"step {step:4d}  loss {float(loss):.4f}")

correct = np.sum(np.argmax(model(x_test).numpy(), axis=1) == y_test)
counts = hvd.allreduce(tf.constant([float(correct), float(len(y_test))]), op=hvd.Sum,
                       name="accuracy")
weights = hvd.allgather_object(float(np.sum(model.variables[0].numpy())))
if rank == 0:
    print(f"test accuracy over {size} ranks: {float(counts[0] / counts[1]):.4f}; "
          f"weights identical on every rank: {len(set(weights)) == 1}")
hvd.shutdown()
