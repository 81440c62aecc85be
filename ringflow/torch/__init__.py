"""ringflow.torch: a drop-in for Horovod 0.28's ``horovod.torch``.

Change ``import horovod.torch as hvd`` to ``import ringflow.torch as hvd``; names, signatures,
defaults and semantics follow Horovod 0.28 except where noted below.

Differences from Horovod 0.28 (each one deliberate):

- CUDA (any non-CPU) tensors are reduced on the device with NCCL where every rank has it, else
  staged through host memory (DESIGN.md, Devices; docs/guides/gpus.md says what has run on a
  GPU).
- bfloat16 and bool tensors are supported; non-contiguous tensors are copied (in-place operations
  copy the result back) instead of rejected; zero-size tensors work.
- ``Compression.bf16`` exists; compression is done by the engine while it fuses (no temporaries).
  ``allreduce_async`` / ``allreduce_async_`` / grouped forms accept ``compression=`` too.
- ``SyncBatchNorm`` runs on CPU; ``DistributedSampler`` needs no ``torch.distributed``.
- ``broadcast_optimizer_state`` broadcasts param-group options as one pickled object (so ``None``
  options and tuples such as Adam's ``betas`` survive), and its zero-gradient initialization step
  for a fresh optimizer restores the parameters afterwards (Horovod's may move them through
  weight decay).
- ``DistributedOptimizer`` shares the wrapped optimizer's state instead of re-running its
  ``__init__``; ``op=Adasum`` raises ``AdasumError`` (a ``NotImplementedError``: Horovod's
  delta-based Adasum optimizer is not implemented; ``allreduce(op=Adasum)`` is). Misuse errors are
  ``OptimizerMisuseError``, a subclass of both ``RingflowError`` and ``AssertionError`` (Horovod
  raises ``AssertionError`` with the same text).
- Build/feature queries answer for ringflow: ``gloo_built()`` / ``nccl_built()`` / ``ddl_built()`` /
  ``ccl_built()`` / ``cuda_built()`` / ``rocm_built()`` are False (ringflow has its own TCP
  transport); ``mpi_built()`` is True only when mpi4py imports and loads an MPI library
  (``ringflow.transport.mpi.available()``); ``mpi_enabled()`` is True only when the ``mpi``
  transport is the one in use.
- ``start_timeline`` / ``stop_timeline`` are the core's (:func:`ringflow.start_timeline`): one
  Chrome-trace file per rank.
- ``allreduce`` of a sparse COO tensor takes ``sparse_allreduce_async``'s path (Horovod raises
  ``ValueError``), whose result is coalesced; ops other than Sum/Average raise there.
- ``broadcast_object`` / ``allgather_object`` use a fixed default name (Horovod's is the type's
  name, which differs when non-root ranks pass ``None``); ``broadcast_optimizer_state`` handles
  every ``torch.optim`` optimizer, LBFGS included, and state present on some ranks only.
- ``rank()``, ``size()`` (and ``local_*``, ``cross_*`` where the launcher gives them) answer
  before ``init()``, from the launcher's environment (Horovod raises ``ValueError``), as
  Jittor's ``jt.rank`` does; ``single_process_scope`` is Jittor's; ``SyncBatchNorm`` has
  torch's ``convert_sync_batchnorm``; ``DistributedSampler(pad=False)`` shards without
  repeating samples. ``import ringflow.torch.auto`` (or ``ringflow-run --auto``) runs an
  unchanged single-process script data-parallel.
- Point to point (not in Horovod): ``send`` / ``recv`` (differentiable: ``send`` returns a token
  to backpropagate through, the receiver's backward sends the gradient back; see
  :mod:`ringflow.torch.p2p`) and ``isend`` / ``irecv`` (torch.distributed's ``Work``);
  MegEngine's ``remote_send`` / ``remote_recv`` are ``send`` / ``recv`` with tag 0.
- torch.distributed's backend ``"ringflow"`` (not in Horovod): importing this module registers
  it, and ``torch.distributed.init_process_group(backend="ringflow")`` runs torch's own API and
  DistributedDataParallel on ringflow's engine (:mod:`ringflow.torch.process_group`).
- ``elastic`` (Horovod's elastic training, :mod:`ringflow.torch.elastic`): survivors keep their
  processes and the state moves from live peers; the differences are in
  docs/guides/elastic.md.

The errors every collective raises are ringflow's typed errors, and all of them are
``HorovodInternalError`` (a ``RuntimeError``), as in Horovod; misuse that Horovod reports with
``ValueError`` (a name already in flight, a bad root rank or splits) still is one.
"""

from __future__ import annotations

from .. import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    single_process_scope,
    size,
    start_timeline,
    stop_timeline,
)
from ..build import (
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
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    gather,
    gather_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reduce,
    reduce_async,
    reducescatter,
    reducescatter_async,
    scatter,
    scatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer, OptimizerMisuseError
from .p2p import (  # point to point (differentiable send/recv; MegEngine's names)
    P2PWork,
    irecv,
    isend,
    recv,
    remote_recv,
    remote_send,
    send,
)
from .sampler import DistributedSampler
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "OptimizerMisuseError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gather",
    "gather_async",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reduce",
    "reduce_async",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "scatter",
    "scatter_async",
    "shutdown",
    "single_process_scope",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
# point to point
__all__ += ["P2PWork", "irecv", "isend", "recv", "remote_recv", "remote_send", "send"]


# torch.distributed's backend "ringflow" (ringflow.torch.process_group), where torch was built
# with torch.distributed (some builds are not)
def _register_backend() -> None:
    import torch.distributed

    if torch.distributed.is_available():
        from . import process_group

        process_group.register()


_register_backend()

from . import elastic as elastic  # noqa: E402  (hvd.elastic.run as in horovod.torch; after the above)
