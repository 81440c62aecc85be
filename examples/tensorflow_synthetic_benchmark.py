"""Synthetic TensorFlow training throughput with ringflow (Horovod's benchmark, same output).

    ringflow-run -np 2 python examples/tensorflow_synthetic_benchmark.py
    ringflow-run -np 4 python examples/tensorflow_synthetic_benchmark.py --model ResNet50 \\
        --image-size 224 --batch-size 32 --num-iters 10

Random images and labels, a keras.applications model (weights=None: nothing is downloaded), a
``DistributedGradientTape`` step in ``tf.function``. Prints images/sec per worker as mean
± 1.96 standard deviations over the timed iterations, and the total over all workers.
The defaults are small so that the script finishes in seconds on a laptop CPU.
"""

from __future__ import annotations

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import ringflow.tensorflow as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="MobileNetV2", help="a keras.applications model name")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-classes", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=16, help="per worker")
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradients on the wire")
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=4)
parser.add_argument("--eager", action="store_true", help="run eagerly, without tf.function")
parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per pool")
args = parser.parse_args()

tf.config.threading.set_inter_op_parallelism_threads(args.threads)
tf.config.threading.set_intra_op_parallelism_threads(args.threads)
hvd.init()
rank, size = hvd.rank(), hvd.size()

shape = (args.image_size, args.image_size, 3)
model = getattr(keras.applications, args.model)(weights=None, input_shape=shape,
                                                classes=args.num_classes)
optimizer = keras.optimizers.SGD(0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy()
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
data = tf.random.uniform((args.batch_size, *shape), seed=rank)
target = tf.random.uniform((args.batch_size,), maxval=args.num_classes, dtype=tf.int64,
                           seed=rank)


def benchmark_step() -> None:
    with tf.GradientTape() as tape:
        loss = loss_fn(target, model(data, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


step = benchmark_step if args.eager else tf.function(benchmark_step)


def log(message: str) -> None:
    if rank == 0:
        print(message, flush=True)


log(f"Model: {args.model}, image size {args.image_size}, batch size {args.batch_size}, "
    f"{size} worker(s), {'eager' if args.eager else 'tf.function'}, "
    f"compression {compression.name}")
step()  # traces; the optimizer makes its variables
# Every rank goes on from rank 0's state. After the first step, as Horovod's benchmark does (the
# optimizer's variables exist only then), but outside the traced step: a step with a "first
# batch" argument would be traced twice.
hvd.broadcast_variables(model.variables, root_rank=0)
hvd.broadcast_variables(optimizer.variables, root_rank=0)
timeit.timeit(step, number=args.num_warmup_batches)
img_secs = []
for i in range(args.num_iters):
    elapsed = timeit.timeit(step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / elapsed
    log(f"Iter #{i}: {img_sec:.1f} img/sec per worker")
    img_secs.append(img_sec)

mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {size} worker(s): {size * mean:.1f} +-{size * conf:.1f}")
hvd.shutdown()
