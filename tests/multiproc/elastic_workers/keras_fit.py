"""A Keras elastic worker for tests/multiproc/test_elastic.py: ``model.fit`` (a compiled step,
the DistributedOptimizer's allreduces inside it) under ``hvd.elastic.run`` with ``KerasState``,
whole epochs committed (``CommitStateCallback`` with ``batches_per_commit`` past the epoch, and
at each epoch's end) and ``UpdateEpochStateCallback``. Each rank takes ``x[rank::size]``: the
48 samples split evenly at 2, 3 or 4 ranks, so every rank runs the same steps.

``KILL=HOST:EPOCH:BATCH``: the worker on HOST SIGKILLs itself as that batch begins. At the end
each worker writes its weights and optimizer variables as hex, and the epochs it ran.
"""

from __future__ import annotations

import json
import os
import signal

import keras
import numpy as np

import ringflow.tensorflow.keras as hvd

OUT, WID = os.environ["OUT"], os.environ["RINGFLOW_ELASTIC_ID"]
HOST = os.environ["RINGFLOW_HOSTNAME"]
KILL, EPOCHS = os.environ.get("KILL", ""), int(os.environ.get("EPOCHS", "4"))

hvd.init()
x = np.random.default_rng(5).standard_normal((48, 4)).astype("float32")
y = x.sum(1, keepdims=True)
keras.utils.set_random_seed(int(WID))  # other weights on every worker: sync() makes them equal
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
              loss="mse", jit_compile=False)
ran: list[tuple[int, int]] = []  # (epoch, size) of each epoch that ended


class Kill(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        if f"{HOST}:{state.epoch}:{batch}" == KILL:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch: int, logs: object = None) -> None:
        ran.append((state.epoch, hvd.size()))


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    r, n = hvd.rank(), hvd.size()
    model.fit(x[r::n], y[r::n], batch_size=4, epochs=EPOCHS - state.epoch, verbose=0,
              shuffle=False, callbacks=[
                  Kill(), hvd.elastic.UpdateEpochStateCallback(state),
                  hvd.elastic.CommitStateCallback(state, batches_per_commit=10**6)])


state = hvd.elastic.KerasState(model, epoch=0)
train(state)
with open(os.path.join(OUT, f"final-{WID}.json"), "w") as f:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "ran": ran,
               "params": [np.asarray(v).tobytes().hex() for v in model.variables],
               "momentum": [np.asarray(v).tobytes().hex() for v in model.optimizer.variables]},
              f)
hvd.shutdown()
