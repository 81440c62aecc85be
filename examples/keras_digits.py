"""Keras model.fit on scikit-learn's digits with ringflow: the Horovod recipe, data that ships
with a package (no download).

    ringflow-run -np 2 python examples/keras_digits.py --epochs 6

- the learning rate scales with the number of ranks and warms up over the first epochs;
- every rank starts from rank 0's weights (BroadcastGlobalVariablesCallback);
- each rank trains on its shard; metrics are averaged over the ranks (MetricAverageCallback);
- only rank 0 writes checkpoints and prints progress.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import ringflow.tensorflow.keras as hvd

import digits  # examples/digits.py: scikit-learn's digits, read with numpy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.002, help="single-rank learning rate")
parser.add_argument("--warmup-epochs", type=int, default=2)
parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(),
                                                             "ringflow_keras_digits"))
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
x_train, y_train = x[:split][rank::size], y[:split][rank::size]  # this rank's shard
x_val, y_val = x[split:][rank::size], y[split:][rank::size]

keras.utils.set_random_seed(1234 + rank)  # different on purpose: the broadcast fixes it
model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.2),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
lr = args.lr * size
optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(lr))
model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"],
              jit_compile=False)  # XLA cannot compile the collectives

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),  # before anything that reads the metrics
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs,
                                             verbose=1),
]
if rank == 0:
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                    validation_data=(x_val, y_val), callbacks=callbacks,
                    verbose=2 if rank == 0 else 0)
if rank == 0:
    final = {k: round(v[-1], 4) for k, v in history.history.items()}
    print(f"final (averaged over {size} ranks): {final}")
    print(f"checkpoints in {args.checkpoint_dir}: {sorted(os.listdir(args.checkpoint_dir))}")
hvd.shutdown()
