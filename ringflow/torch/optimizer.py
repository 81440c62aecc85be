"""DistributedOptimizer: Horovod 0.28's gradient-averaging wrapper around any torch optimizer.

How it works (the same protocol as ``horovod.torch.DistributedOptimizer``):

1. At construction every parameter that requires a gradient gets a post-accumulate-grad hook.
2. During ``loss.backward()``, as soon as a parameter's gradient is accumulated, its hook counts a
   backward pass; on the ``backward_passes_per_step``-th pass it starts an asynchronous in-place
   allreduce of ``p.grad``, as the shared batching policy decides (:mod:`ringflow.batching`):
   buckets in the order gradients become ready (the first one small), each submitted once it is
   full or the pass ends, an explicit ``groups`` member as one grouped allreduce once its group is
   complete. Communication of early gradients overlaps the rest of the backward pass; the engine
   fuses whatever is ready together. The bucket size is read from the engine when a pass starts
   (``RINGFLOW_BUCKET_BYTES``, or the autotuner's choice).
3. ``step()`` calls :meth:`synchronize` (unless inside ``skip_synchronize()``), which starts the
   allreduce of every parameter whose hook did not fire - a gradient this rank did not compute is
   sent as zeros, because other ranks may have computed it - waits for everything, and then runs
   the wrapped optimizer's own step.

After each step, ``step_overlap`` holds how much of its exchange the backward pass hid
(:class:`ringflow.overlap.StepOverlap`), and the timeline, when one is recorded, shows it.

Averaging: ``op=Average`` with ``gradient_predivide_factor=f`` scales by ``1/f`` before the sum and
by ``f/size`` after it (Horovod's split of the average). Compression ``fp16`` / ``bf16`` is done by
the engine while it fuses, so the gradients are reduced in place with no temporary tensors.
The compressors with state (``Compression.powersgd`` / ``randomk`` / ``onebit`` / ``auto``) are
run by a :class:`ringflow.compressed.Exchange`: a bucket's compressible gradients start their
exchange when the bucket is submitted, the second round and the results come in
:meth:`synchronize`; the other gradients of the bucket are reduced exactly. Its state (error
feedback, warm start) is in ``state_dict()["ringflow_compression"]``. Without ``compression=``,
``RINGFLOW_COMPRESSION`` (``ringflow-run --compression``) chooses.

The result is an instance of a class created on the fly that derives from the user's optimizer
class, so ``isinstance(opt, torch.optim.SGD)`` still holds and ``state_dict()`` is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .. import ProcessSet, global_process_set, runtime, size
from .._adapter import broadcast_object
from ..batching import Batch, BucketPolicy, GradientBatcher
from ..compressed import Exchange, configured
from ..compression import Compressor, GradientCompression
from ..errors import AdasumError, RingflowError
from ..ops import Adasum, Average, ReduceOp
from ..overlap import StepClock, StepOverlap
from .compression import TORCH_OPS, Compression
from .mpi_ops import (
    allreduce_async_,
    allreduce_many_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)

__all__ = ["DistributedOptimizer", "OptimizerMisuseError"]


class OptimizerMisuseError(RingflowError, AssertionError):
    """A DistributedOptimizer was used out of order (Horovod raises AssertionError here)."""


_PENDING = object()  # a handle slot whose gradient waits in the batcher's bucket
_COMPRESSED = object()  # a handle slot whose gradient is in the compressed exchange


class _DistributedOptimizer:
    """The methods mixed in front of the user's optimizer class."""

    def _ringflow_setup(self, named_parameters: Any, compression: Any,
                        backward_passes_per_step: int, op: ReduceOp,
                        gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                        process_set: ProcessSet) -> None:
        compression = configured(compression)
        if isinstance(compression, Compressor):  # torch's compress()/decompress() on tensors
            compression = Compression.by_name(compression.name) if compression.name in (
                "none", "fp16", "bf16") else compression
        self._exchange: Exchange | None = None
        self._in_exchange: list[Any] = []  # batches whose first round is in flight
        self._second_round: list[Any] = []  # batches whose second round is in flight
        if isinstance(compression, GradientCompression):
            pre, post = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                         if op == Average else (1.0, 1.0))
            self._exchange = Exchange(compression, TORCH_OPS, op, pre, post, process_set)
            compression = Compression.none  # what is not compressed is reduced exactly
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             f"Found duplicates: {', '.join(dups)}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: "
                             f"{', '.join(str(i) for i in sorted(unnamed))}")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._batcher: GradientBatcher[torch.Tensor] = GradientBatcher([])
        self._flush_queued = False  # the end-of-pass callback is queued: a pass is running
        self._clock = StepClock()
        self.step_overlap: StepOverlap | None = None  # the last step's (ringflow.overlap)
        self._requires_update: set[torch.Tensor] = set()
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
            if isinstance(groups, list):
                seen: set[int] = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in seen:
                            raise ValueError("A parameter can only appear once in groups.")
                        seen.add(id(p))
        self._groups = groups
        # As Horovod: with one rank (and not elastic) there is nothing to exchange.
        if process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    # hooks -------------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if self._groups is not None:
            # Every rank must form the same groups in the same order: rank 0's order wins.
            order = broadcast_object([self._parameter_names.get(p) for p in params], 0,
                                     name="DistributedOptimizer.groups",
                                     process_set=self.process_set)
            params.sort(key=lambda p: order.index(self._parameter_names.get(p)))
        self._batcher = GradientBatcher(params, self._groups)
        for p in params:
            self._requires_update.add(p)
            p.register_post_accumulate_grad_hook(self._make_hook(p))

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(*_: Any) -> None:
            if p in self._handles and self._handles[p][0] not in (None, _PENDING) \
                    and self._allreduce_delay[p] <= 0:
                raise OptimizerMisuseError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            if p.grad is not None and p.grad.requires_grad:
                raise OptimizerMisuseError(
                    f"the gradient of {self._parameter_names.get(p)!r} requires grad "
                    "(create_graph=True); DistributedOptimizer cannot allreduce it")
            if not self._flush_queued:
                self._pass_started()
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] != 0:
                self._handles[p] = (None, None)  # not due: synchronize() sends it if need be
                return
            # Due: the batcher submits it now, or holds it (bucket, incomplete group) until a
            # flush or synchronize() (which sends it alone if its group never completed).
            self._handles[p] = (_PENDING, None)
            grad = p.grad
            nbytes = None if grad is None or grad.is_sparse else grad.numel() * grad.element_size()
            self._submit(self._batcher.ready(p, nbytes))

        return hook

    def _pass_started(self) -> None:
        """The first hook of a backward pass: this pass's buckets, and its end's callback."""
        self._flush_queued = True
        # Runs once the current backward pass has finished (DDP uses the same hook).
        torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self._clock.pass_started()
        engine = runtime.running()
        if engine.params.bucket_bytes != self._batcher.policy.bucket_bytes:
            self._batcher.policy = BucketPolicy(engine.params.bucket_bytes)

    def _submit(self, batches: list[Batch[torch.Tensor]]) -> None:
        for keys, grouped in batches:
            keys = self._start_compressed(keys)
            if not keys:
                continue
            if grouped:
                for p in keys:
                    self._handles.pop(p, None)
                self._handles[keys] = self._grouped_allreduce_grad_async(keys)
                self._clock.submitted(self._handles[keys][0])
            elif len(keys) > 1 and isinstance(self._compression, Compressor) and not any(
                    p.grad is not None and p.grad.is_sparse for p in keys):
                self._allreduce_bucket_async(keys)
            else:
                for p in keys:
                    self._handles[p] = self._allreduce_grad_async(p)
                    self._clock.submitted(self._handles[p][0])

    def _start_compressed(self, keys: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Start the compressed exchange of the gradients of ``keys`` that the compressor takes
        (the same ones on every rank: it decides by shape and dtype); the others, to reduce."""
        if self._exchange is None or self._exchange.active is False:  # auto chose off
            return keys
        taken = []
        for p in keys:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not grad.is_sparse and self._exchange.compresses(
                    grad, str(grad.dtype).removeprefix("torch.")):
                p.grad = grad
                taken.append(p)
        if taken:
            self._in_exchange.append(self._exchange.start(
                [self._parameter_names.get(p) for p in taken], [p.grad for p in taken]))
            for p in taken:
                self._handles[p] = (_COMPRESSED, None)
        self._advance()
        ids = {id(p) for p in taken}
        return tuple(p for p in keys if id(p) not in ids)

    def _advance(self) -> None:
        """Start the second round of each batch whose first round is done, while backward still
        runs (it overlaps the rest of the pass; synchronize() starts the others)."""
        waiting = []
        for items in self._in_exchange:
            if all(it.handle.poll() for it in items):
                self._exchange.middle(items)  # type: ignore[union-attr]
                self._second_round.append(items)
            else:
                waiting.append(items)
        self._in_exchange = waiting

    def _flush(self) -> None:
        """The backward pass has ended: submit the gradients the batcher's bucket holds."""
        if self._flush_queued:
            self._flush_queued = False
            self._clock.backward_ended()
        self._submit(self._batcher.flush())

    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            # Average = Sum then 1/size in the engine; the predivide factor splits it in two.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        if p.grad is None:
            # Not computed here (a branch this rank's forward skipped); other ranks may have it.
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                # Horovod's sparse path: allgather of indices and values (a function to call).
                return sparse_allreduce_async(tensor, name, self.op, self.process_set), None
            tensor = tensor.to_dense()
        pre, post = self._scales()
        if isinstance(self._compression, Compressor):
            handle = allreduce_async_(tensor, name=name, op=self.op, prescale_factor=pre,
                                      postscale_factor=post, process_set=self.process_set,
                                      compression=self._compression)
            return handle, ("dense", tensor) if tensor is not p.grad else None
        compressed, ctx = self._compression.compress(tensor)
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)
        return handle, ("custom", ctx)

    def _allreduce_bucket_async(self, keys: tuple[torch.Tensor, ...]) -> None:
        """A bucket of dense gradients: separate operations, handed to the engine at once."""
        for p in keys:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pre, post = self._scales()
        handles = allreduce_many_async_([p.grad for p in keys],
                                        [self._parameter_names.get(p) for p in keys], self.op,
                                        pre, post, self.process_set, self._compression)
        for p, handle in zip(keys, handles, strict=True):
            self._handles[p] = (handle, None)
            self._clock.submitted(handle)

    def _grouped_allreduce_grad_async(self, group: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pre, post = self._scales()
        name = self._parameter_names.get(group[0])
        if isinstance(self._compression, Compressor):
            handle = grouped_allreduce_async_([p.grad for p in group], name=name, op=self.op,
                                              prescale_factor=pre, postscale_factor=post,
                                              process_set=self.process_set,
                                              compression=self._compression)
            return handle, None
        pairs = [self._compression.compress(p.grad) for p in group]
        handle = grouped_allreduce_async_([c for c, _ in pairs], name=name, op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return handle, [("custom", c) for _, c in pairs]

    @staticmethod
    def _store(p: torch.Tensor, output: torch.Tensor, ctx: Any, compression: Any) -> None:
        """Put an allreduced gradient back into ``p.grad`` (in place already, unless noted)."""
        if ctx is None:
            return
        kind, value = ctx
        if kind == "custom":
            output = compression.decompress(output, value)
        if p.grad.is_sparse:
            aggregated = output if output.is_sparse else output.to_sparse()
            p.grad.zero_().add_(aggregated)
        elif output.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(output)

    # public ------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient allreduce (starting the missing ones) and write the results.

        Call it before modifying gradients (clipping, AMP unscaling), then call ``step()`` inside
        ``skip_synchronize()``.
        """
        if not self.process_set.included():
            self._synchronized = True
            return
        self._flush()  # normally done at the end of backward already
        completed: set[Any] = set()
        for key in self._handles:
            if isinstance(key, tuple):
                completed.update(key)
            else:
                completed.add(key)
        # Sorted by name so every rank submits its missing gradients in the same order.
        missing = sorted(self._requires_update - completed,
                         key=lambda q: self._parameter_names.get(q) or "")
        missing += [p for p, (handle, _) in self._handles.items()
                    if handle is None or handle is _PENDING]
        for p in self._start_compressed(tuple(missing)):
            self._handles[p] = self._allreduce_grad_async(p)
            self._clock.submitted(self._handles[p][0])
        if self._exchange is not None:
            for items in self._in_exchange:  # every second round in flight before any wait
                self._exchange.middle(items)
            batches = self._second_round + self._in_exchange
            self._in_exchange, self._second_round = [], []
            for items in batches:
                self._exchange.end(items)
        for key, (handle, ctx) in self._handles.items():
            if handle is _COMPRESSED:
                self._allreduce_delay[key] = self.backward_passes_per_step
                continue
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for i, (gp, output) in enumerate(zip(key, outputs, strict=False)):
                    self._allreduce_delay[gp] = self.backward_passes_per_step
                    self._store(gp, output, None if ctx is None else ctx[i], self._compression)
                continue
            output = handle() if callable(handle) else synchronize(handle)
            self._allreduce_delay[key] = self.backward_passes_per_step
            if callable(handle):
                key.grad.zero_().add_(output)
                continue
            self._store(key, output, ctx, self._compression)
        self._handles.clear()
        self._batcher.reset()
        self._synchronized = True
        overlap = self._clock.finish()
        if overlap is not None:
            self.step_overlap = overlap
            runtime.running().record_step(overlap)

    def _abandon(self) -> None:
        """Forget the allreduces of a step that failed with its job (an elastic reset,
        :mod:`ringflow.torch.elastic`): the next backward pass starts afresh, on the next
        generation's engine."""
        self._handles.clear()
        self._batcher.reset()
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay,
                                              self.backward_passes_per_step)
        self._flush_queued = False
        self._synchronized = False
        self._in_exchange, self._second_round = [], []  # compressed rounds of the failed step

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's, with the compressor's state (error feedback, warm start:
        each rank's own) under ``"ringflow_compression"`` when it compresses."""
        state = super().state_dict()  # type: ignore[misc]
        if self._exchange is not None:
            state["ringflow_compression"] = self._exchange.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's, and the compressor's state where it was saved.

        Raises:
            ConfigError: the saved state is another compressor's.
        """
        state_dict = dict(state_dict)
        compressor = state_dict.pop("ringflow_compression", None)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if compressor is not None and self._exchange is not None:
            self._exchange.load_state_dict(compressor)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (you called synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise OptimizerMisuseError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments follow Horovod 0.28: ``named_parameters`` names the allreduces (recommended:
    ``model.named_parameters()``); ``compression`` (``Compression.fp16`` / ``bf16``) shortens the
    wire format, ``Compression.powersgd(rank=)`` / ``randomk(fraction=)`` / ``onebit()`` /
    ``auto()`` send far less with error feedback (:mod:`ringflow.compressed`; left at ``none``,
    ``RINGFLOW_COMPRESSION`` chooses); ``backward_passes_per_step`` accumulates that many backward
    passes locally before communicating; ``op`` is Average or Sum; ``gradient_predivide_factor``
    splits the average into a pre- and post-scale; ``groups`` (an int, or lists of parameters)
    reduces parameters in groups (``num_groups`` is its deprecated alias); ``sparse_as_dense``
    densifies sparse gradients; ``process_set`` limits the exchange to some ranks.

    The returned object shares ``param_groups`` and ``state`` with ``optimizer`` and is an
    instance of ``type(optimizer)``.

    Raises:
        ValueError: bad ``backward_passes_per_step``, ``gradient_predivide_factor`` with an op other
            than Average, bad ``named_parameters`` or ``groups`` (Horovod's messages).
        AdasumError: ``op=Adasum`` (Horovod's delta-based Adasum optimizer is not implemented;
            ``allreduce(op=Adasum)`` is).
        ConfigError: a compressor with state and an op other than Average or Sum.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise AdasumError("DistributedOptimizer(op=Adasum) (Horovod's delta-based Adasum "
                          "optimizer) is not implemented by ringflow; use op=Average (the "
                          "default) or op=Sum, or allreduce(op=Adasum) on tensors")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base),
               {"_ringflow_base_step": base.step, "__module__": __name__})
    opt = cls.__new__(cls)
    # Share the wrapped optimizer's param groups, state and hooks rather than re-running its
    # __init__ (which may need arguments we do not know): both objects see the same state.
    opt.__dict__.update(optimizer.__dict__)
    if hasattr(opt, "_patch_step_function"):
        opt._patch_step_function()  # step pre/post hooks, profiler names, as in __init__
    opt._ringflow_setup(named_parameters, compression, backward_passes_per_step, ReduceOp(op),
                        gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return opt
