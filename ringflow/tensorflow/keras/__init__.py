"""ringflow for Keras 3 (TensorFlow backend): Horovod 0.28's ``horovod.tensorflow.keras`` API.

::

    import ringflow.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

Collectives run as ``tf.py_function`` ops, which XLA cannot compile: compile the model with
``jit_compile=False`` on machines with a GPU (Keras already chooses False on CPU-only machines).
``broadcast_global_variables`` needs TF1 global variables, which Keras 3 does not have: use
``BroadcastGlobalVariablesCallback`` or ``broadcast_variables(model.variables, 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

import ringflow as _core
from ringflow import (
    Adasum,
    Average,
    ProcessSet,
    Sum,
    cross_rank,
    cross_size,
    global_process_set,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ringflow.build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ringflow.errors import RingflowError

from .. import Compression, SyncBatchNormalization, add_process_set, init
from ..functions import allgather_object, broadcast_object, broadcast_variables
from . import callbacks
from .optimizer import create_distributed_optimizer, wrap_optimizer_class

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer so that gradients are averaged over the ranks before each update.

    The result is an instance of a subclass of ``type(optimizer)`` with the same name, built from
    ``optimizer.get_config()`` (wrap the optimizer before training: its state is not copied).

    Args:
        compression: ``Compression.none``/``fp16``/``bf16``: the wire dtype of the gradients;
            ``Compression.powersgd(rank=)``/``randomk(fraction=)``/``onebit()``/``auto()``:
            compressed with error feedback (:mod:`ringflow.compressed`; its state:
            ``ringflow.tensorflow.gradient_tape.exchange_for``); left at ``none``,
            ``RINGFLOW_COMPRESSION`` chooses.
        sparse_as_dense: densify ``IndexedSlices`` gradients before the allreduce.
        gradient_predivide_factor: divide by f before the sum and by size/f after (op=Average).
        op: Average (default) or Sum.
        backward_passes_per_step: accumulate k local gradients between allreduces.
        average_aggregated_gradients: divide the k accumulated gradients by k.
        num_groups: split the gradients into this many groups negotiated together (see the
            tape).
        groups: which gradients are negotiated together, as lists of variables.

    Raises:
        ConfigError: backward_passes_per_step < 1, or gradient_predivide_factor with op != Average.
    """
    del device_dense, device_sparse
    return create_distributed_optimizer(
        optimizer, name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
    )


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                local_layers: Any = None, **kwargs: Any) -> Any:
    """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers`` local."""
    layers = [] if local_layers is None else (
        list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers])
    kwargs.pop("device_dense", None)
    kwargs.pop("device_sparse", None)
    local_vars = [w for layer in layers for w in layer.trainable_weights]
    return create_distributed_optimizer(optimizer, name, local_vars=local_vars, **kwargs)


def broadcast_global_variables(root_rank: int) -> None:
    """Not available in Keras 3 (no global variables); see the module docstring."""
    raise RingflowError(
        "broadcast_global_variables() needs TF1 global variables, which Keras 3 does not have; "
        "use callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit, or "
        "broadcast_variables(model.variables, root_rank)"
    )


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = Compression.none) -> np.ndarray:
    """Reduce a value (number or array) over the ranks; returns a numpy array."""
    if average is not None and op is None:
        op = Average if average else Sum
    value = np.asarray(value)
    out = _core.allreduce(value, name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, compression=compression)
    return np.reshape(out, value.shape)  # the core returns 0-d values as shape (1,)


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's value along the first dimension; returns a numpy array."""
    return _core.allgather(np.asarray(value), name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """``root_rank``'s value on every rank; returns a numpy array."""
    value = np.asarray(value)
    return np.reshape(_core.broadcast(value, root_rank, name=name), value.shape)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> np.ndarray:
    """Reduce, then keep this rank's share of rows; returns a numpy array."""
    return _core.reducescatter(np.asarray(value), name=name, op=op)


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none) -> keras.Model:
    """``keras.models.load_model`` whose optimizer comes back wrapped in DistributedOptimizer.

    The saved optimizer's state (slots, iterations) is restored into the distributed optimizer.
    """
    model = keras.models.load_model(filepath, custom_objects=custom_objects)
    optimizer = getattr(model, "optimizer", None)
    allowed = tuple(custom_optimizers or ()) or (keras.optimizers.Optimizer,)
    if optimizer is not None and isinstance(optimizer, allowed):
        # Re-class in place: the loaded instance keeps its restored variables, and the wrapper
        # class only adds methods (no state of its own when backward_passes_per_step == 1).
        optimizer.__class__ = wrap_optimizer_class(type(optimizer), compression=compression)
    return model


from . import elastic as elastic  # noqa: E402  (hvd.elastic as in horovod.tensorflow.keras)
