"""A TensorFlow elastic worker for tests/multiproc/test_elastic.py: TensorFlowKerasState with a
Keras model and a Keras SGD optimizer with momentum, an eager loop with DistributedGradientTape,
samples from ringflow.elastic.shard, plain values (epoch, step, processed).

One sample a rank a step (a zero gradient where a rank's share ran out). Records and
``KILL=HOST:STEP`` / ``EDIT=STEP:+LINE`` as in steps.py and torch_steps.py; at the end each
worker writes its weights and optimizer variables as hex.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import ringflow.tensorflow as hvd
from ringflow import elastic as core
from ringflow import runtime
from ringflow.tensorflow.gradient_tape import allreduce_gradients, compressor_states

OUT = os.environ["OUT"]
LENGTH, EPOCHS = int(os.environ["LENGTH"]), int(os.environ["EPOCHS"])
SLEEP = float(os.environ.get("SLEEP", "0"))
WID, HOST = os.environ["RINGFLOW_ELASTIC_ID"], os.environ["RINGFLOW_HOSTNAME"]
KILL, EDIT, HOSTS = (os.environ.get(k, "") for k in ("KILL", "EDIT", "HOSTS"))


def record(**fields: object) -> None:
    with open(os.path.join(OUT, f"steps-{WID}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


hvd.init()
data = np.random.default_rng(5).standard_normal((LENGTH, 4))
target = data.sum(1, keepdims=True)
keras.utils.set_random_seed(int(WID))  # other weights on every worker: sync() makes them equal
HIDDEN = int(os.environ.get("HIDDEN", "0"))  # a layer that RINGFLOW_COMPRESSION compresses
model = keras.Sequential([keras.Input((4,)),
                          *([keras.layers.Dense(HIDDEN, dtype="float64")] if HIDDEN else []),
                          keras.layers.Dense(1, dtype="float64")])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9)


# Traced once, in the first generation: what they return must follow the world's size.
SIZE_OP = tf.function(lambda: hvd.size_op())
ONE = tf.Variable(1.0, dtype=tf.float64)
LOCAL_SCALE = tf.function(lambda: allreduce_gradients(  # a local variable's gradient / size
    [tf.constant(1.0, tf.float64)], [ONE], local_vars=[ONE])[0])


@hvd.elastic.run
def train(state: hvd.elastic.TensorFlowKerasState) -> None:
    g = runtime.world().generation
    while state.epoch < EPOCHS:
        mine = core.shard(LENGTH, state.epoch, 3, True, state.processed, hvd.rank(), hvd.size())
        for k in range(math.ceil((LENGTH - state.processed) / hvd.size())):
            sample = mine[k] if k < len(mine) else -1
            x = data[max(sample, 0):max(sample, 0) + 1]
            with tf.GradientTape() as tape:
                out = model(x)
                loss = (tf.reduce_sum((out - target[sample]) ** 2) if sample >= 0
                        else tf.reduce_sum(out) * 0)
            tape = hvd.DistributedGradientTape(tape)
            rec = dict(gen=g, size=hvd.size(), step=state.step, epoch=state.epoch,
                       processed=state.processed, sample=sample, size_op=int(SIZE_OP()),
                       local_scale=float(LOCAL_SCALE()))
            if f"{HOST}:{state.step}" == KILL:
                record(**rec)
                tape.gradient(loss, model.trainable_variables)  # submitted, then gone
                os.kill(os.getpid(), signal.SIGKILL)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            record(**rec)
            state.processed = min(LENGTH, state.processed + hvd.size())
            state.step += 1
            if EDIT and hvd.rank() == 0 and g == 0 and int(EDIT.split(":")[0]) == state.step:
                with open(HOSTS, "a") as f:
                    f.write(EDIT.split(":", 1)[1][1:] + "\n")
                end = time.monotonic() + 60
                while not runtime.world().update_pending() and time.monotonic() < end:
                    time.sleep(0.05)
            time.sleep(SLEEP)
            state.commit()
        state.epoch += 1
        state.processed = 0
        state.commit()


train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, step=0, processed=0))
with open(os.path.join(OUT, f"final-{WID}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(),
               "params": [v.numpy().tobytes().hex() for v in model.variables],
               "momentum": [np.asarray(v).tobytes().hex() for v in optimizer.variables],
               "compressed": [sorted(state["errors"]) for state in compressor_states().values()
                              if state["errors"]]}, f)
hvd.shutdown()
Path(OUT).joinpath(f"done-{WID}").touch()
