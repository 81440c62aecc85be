"""ringflow for TensorFlow 2: Horovod 0.28's ``horovod.tensorflow`` API over the ringflow engine.

Switch from Horovod by changing the import::

    import ringflow.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Every collective works eagerly and inside ``tf.function`` and is differentiable (see
:mod:`ringflow.tensorflow.mpi_ops` for names, gradients and ordering). Differences from Horovod:

- ``Compression`` is the core's: the engine casts while fusing, and 16-bit sums accumulate in
  float32; ``Compression.bf16`` is added. A custom compressor with TensorFlow
  ``compress``/``decompress`` methods is still applied around the allreduce, as in Horovod.
- ``op=Adasum`` runs the Adasum algorithm on the CPU (a power of two ranks), in any process set
  (Horovod: the global set only).
- ``device_dense`` / ``device_sparse`` are accepted and ignored: data moves through host memory.
- ``num_groups``/``groups`` decide which gradients are negotiated together; fusion itself is the
  engine's and happens either way. By the batching policy the torch optimizer shares
  (:mod:`ringflow.batching`), a tape's gradients that no group names are one op per step, where
  Horovod issues one allreduce per ungrouped gradient.
- Collective ops of one graph run in the order they were traced (a control-dependency chain):
  a pure-Python op blocks its thread, so this is what keeps ranks from deadlocking.
- ``SyncBatchNormalization`` weights each rank's statistics by its row count (exact for unequal
  batches); Horovod averages per-rank moments.
- ``broadcast_object``/``allgather_object`` default to a fixed name rather than the object's
  type name, so a non-root rank may pass ``None``.
- ``size_op``/``rank_op``/``local_*_op`` are constants, except in the graphs of an elastic
  worker, where they are read when the graph runs (as Horovod's under ``HOROVOD_ELASTIC``).
- Point to point (not in Horovod): ``send`` / ``recv``, eagerly and in ``tf.function``,
  differentiable (see :mod:`ringflow.tensorflow.p2p`); ``isend`` / ``irecv`` eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

import ringflow as _core
from ringflow import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
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
from ringflow import _adapter as kit
from ringflow.build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ringflow.compression import Compressor
from ringflow.errors import HorovodInternalError, HostsUpdatedInterrupt, UnsupportedError

from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (
    _SETS,
    _allreduce,
    _grouped_allreduce,
    _grouped_reducescatter,
    allgather,
    alltoall,
    barrier,
    broadcast,
    current,
    gather,
    grouped_allgather,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reduce,
    scatter,
    size_op,
)
from .p2p import irecv, isend, recv, send  # point to point (differentiable send/recv)
from .sync_batch_norm import SyncBatchNormalization

_plain = tf.autograph.experimental.do_not_convert


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedGradientTape",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gather",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reduce",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "scatter",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]
# point to point
__all__ += ["irecv", "isend", "recv", "send"]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None,
         **kwargs: Any) -> None:
    """Join the job (see :func:`ringflow.init`, whose keyword arguments ``rank``, ``size``,
    ``init_method``, ... pass through) and register ``process_sets``."""
    _core.init(comm, process_sets=None, **kwargs)
    for ps in process_sets or ():
        add_process_set(ps)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set collectively (every rank, same ranks, same order)."""
    ps = _core.add_process_set(process_set)
    _SETS[int(ps.process_set_id)] = ps
    return ps


@_plain
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: ReduceOp | int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce a ``tf.Tensor``/``tf.Variable`` (or ``tf.IndexedSlices``) over the process set.

    Dense tensors go through the engine's ring allreduce (default op: Average). An
    ``IndexedSlices`` becomes two allgathers (values and indices) — the represented dense tensor
    is reduced without densifying it; Average divides the gathered values by the set size.

    Raises:
        SparseOpError: a sparse tensor with an op other than Sum or Average (a TensorError and,
            as in Horovod, a NotImplementedError).
        UnsupportedError: a sparse tensor with scale factors (Horovod's NotImplementedError).
    """
    reduce_op = kit.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, reduce_op, prescale_factor, postscale_factor, name,
                                 process_set, ignore_name_scope)

    def reduce(xs: Sequence[tf.Tensor], core: Compressor) -> list[tf.Tensor]:
        return [_allreduce(xs[0], name, reduce_op, prescale_factor, postscale_factor,
                           ignore_name_scope, process_set, core)]

    return kit.compressed(compression, [tf.convert_to_tensor(tensor)], reduce)[0]


def _sparse_allreduce(tensor: tf.IndexedSlices, op: ReduceOp, prescale_factor: float,
                      postscale_factor: float, name: str | None, process_set: ProcessSet,
                      ignore_name_scope: bool) -> tf.IndexedSlices:
    """Horovod's allreduce of ``tf.IndexedSlices``: allgather values and indices; Average
    divides the values by the set size (``/``: integer values become floating point, as in
    Horovod). Both refusals happen before any collective, so on every rank alike."""
    kit.sparse_scale(op, 1.0, 1.0, process_set, name)  # Sum or Average only
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise UnsupportedError(
            f"allreduce of the tf.IndexedSlices {name or '(unnamed)'}: pre/postscale_factor are "
            f"not supported with tf.IndexedSlices (got {prescale_factor}, {postscale_factor}), as "
            "in Horovod; scale the values, or pass sparse_as_dense=True")
    values, indices = grouped_allgather(
        [tensor.values, tensor.indices], kit.op_name("sparse", name), ignore_name_scope,
        process_set)
    if op == ReduceOp.AVERAGE:
        values = values / tf.cast(current(process_set.size), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


@_plain
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: ReduceOp | int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """Allreduce a list of tensors negotiated as one group; ``IndexedSlices`` go one by one."""
    reduce_op = kit.resolve_op(op, average)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = list(tensors)
    for i, t in enumerate(tensors):
        if i not in dense:
            out[i] = allreduce(t, op=reduce_op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor,
                               name=None if name is None else f"{name}.sparse{i}",
                               process_set=process_set, ignore_name_scope=ignore_name_scope)
    if not dense:
        return out

    def reduce(xs: Sequence[tf.Tensor], core: Compressor) -> list[tf.Tensor]:
        return _grouped_allreduce(xs, name, reduce_op, prescale_factor, postscale_factor,
                                  ignore_name_scope, process_set, core)

    reduced = kit.compressed(compression, [tf.convert_to_tensor(tensors[i]) for i in dense],
                             reduce)
    for i, r in zip(dense, reduced, strict=True):
        out[i] = r
    return out


@_plain
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: ReduceOp | int = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` (default Average), then keep this rank's share of rows."""
    del device_dense  # data moves through host memory
    return grouped_reducescatter([tensor], compression=compression, op=op,
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, name=name,
                                 ignore_name_scope=ignore_name_scope, _kind="Reducescatter")[0]


@_plain
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: ReduceOp | int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None, ignore_name_scope: bool = False,
                          _kind: str = "GroupedReducescatter") -> list[tf.Tensor]:
    """Reducescatter a list of tensors negotiated as one group."""
    del device_dense
    reduce_op = kit.resolve_op(op, None)

    def reduce(xs: Sequence[tf.Tensor], core: Compressor) -> list[tf.Tensor]:
        return _grouped_reducescatter(xs, name, reduce_op, ignore_name_scope, process_set,
                                      prescale_factor, postscale_factor, core, _kind=_kind)

    return kit.compressed(compression, [tf.convert_to_tensor(t) for t in tensors], reduce)


from . import elastic as elastic  # noqa: E402  (hvd.elastic as in horovod.tensorflow; after the above)
