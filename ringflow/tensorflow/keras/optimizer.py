"""The Keras 3 ``DistributedOptimizer``: a subclass of the wrapped optimizer's own class.

``create_distributed_optimizer`` builds ``type(Base.__name__, (_DistributedMixin, Base), ...)``
and instantiates it from the original's config, so the result *is* a ``Base`` (isinstance checks,
``get_config`` and saved models are unchanged: a model saved with it loads without ringflow).
The class carries the ringflow options; ``from_config`` therefore rebuilds a distributed optimizer,
which is how :func:`ringflow.tensorflow.keras.load_model` re-wraps a loaded one.

``apply(grads, variables)`` — the single entry point of Keras 3's ``apply_gradients`` and of
``model.fit`` — averages the gradients over the ranks before the base class applies them.

With ``backward_passes_per_step = k > 1`` gradients are summed locally into accumulators (plain
``tf.Variable``s, not optimizer state, so checkpoints stay compatible with the base optimizer);
every k-th call allreduces the sums (divided by k when ``average_aggregated_gradients``) and
applies them, and the other calls only advance ``iterations`` (Horovod's behaviour). Communication
thus drops by a factor k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import tensorflow as tf

from ringflow import Average, ProcessSet, ReduceOp, global_process_set
from ringflow.errors import ConfigError

from ..compression import Compression
from ..gradient_tape import allreduce_gradients

__all__ = ["create_distributed_optimizer", "wrap_optimizer_class"]


class _DistributedMixin:
    """Methods placed before the base optimizer's in the MRO."""

    _ringflow_options: ClassVar[dict[str, Any]] = {}

    def build(self, variables: Sequence[Any]) -> None:
        super().build(variables)  # type: ignore[misc]
        if self._ringflow_options["backward_passes_per_step"] > 1:
            # init_scope: build may run while model.fit traces its train function.
            with tf.init_scope():
                self._ringflow_acc = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                name="ringflow_aggregated") for v in variables
                ]
                self._ringflow_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                   name="ringflow_aggregation_counter")

    def _ringflow_reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        opts = self._ringflow_options
        return allreduce_gradients(
            grads, variables, prefix=f"{self.name}", compression=opts["compression"],
            sparse_as_dense=opts["sparse_as_dense"], op=opts["op"],
            gradient_predivide_factor=opts["gradient_predivide_factor"],
            num_groups=opts["num_groups"], groups=opts["groups"],
            process_set=opts["process_set"], local_vars=opts["local_vars"],
            scale_local_gradients=opts["scale_local_gradients"],
        )

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        """Average ``grads`` over the ranks (every k-th call), then apply them."""
        grads = list(grads)
        if not grads:
            return None
        base_apply = super().apply  # type: ignore[misc]
        if trainable_variables is None:
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = list(trainable_variables)
        k = self._ringflow_options["backward_passes_per_step"]
        if k == 1:
            return base_apply(self._ringflow_reduce(grads, variables), trainable_variables)
        if not self.built:  # type: ignore[attr-defined]
            self.build(variables)
            self.built = True
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}  # type: ignore
        pairs = [(g, index[id(v)]) for g, v in zip(grads, variables, strict=True) if g is not None]
        for g, i in pairs:
            self._ringflow_acc[i].assign_add(tf.convert_to_tensor(g))
        count = self._ringflow_count.assign_add(1)
        average = self._ringflow_options["average_aggregated_gradients"]

        def communicate() -> tf.Tensor:
            summed = [self._ringflow_acc[i].read_value() for _, i in pairs]
            if average:
                summed = [s / tf.cast(k, s.dtype) for s in summed]
            used = [variables[j] for j, g in enumerate(grads) if g is not None]
            base_apply(self._ringflow_reduce(summed, used), used)
            for _, i in pairs:
                self._ringflow_acc[i].assign(tf.zeros_like(self._ringflow_acc[i]))
            self._ringflow_count.assign(0)
            return tf.constant(True)

        def skip() -> tf.Tensor:
            self.iterations.assign_add(1)  # type: ignore[attr-defined]
            return tf.constant(False)

        return tf.cond(count >= k, communicate, skip)


def wrap_optimizer_class(base: type, **options: Any) -> type:
    """A distributed subclass of the Keras optimizer class ``base`` (same name and module)."""
    if issubclass(base, _DistributedMixin):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, _DistributedMixin))
    return type(base.__name__, (_DistributedMixin, base),
                {"__module__": base.__module__, "_ringflow_options": _options(**options)})


def _options(compression: Any = Compression.none, sparse_as_dense: bool = False,
             gradient_predivide_factor: float = 1.0, op: ReduceOp | int = Average,
             backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
             num_groups: int = 0, groups: Sequence[Sequence[Any]] | None = None,
             process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
             local_vars: Sequence[Any] = ()) -> dict[str, Any]:
    if int(backward_passes_per_step) < 1:
        raise ConfigError(
            f"DistributedOptimizer: backward_passes_per_step must be >= 1, got "
            f"{backward_passes_per_step}; use 1 to allreduce on every step"
        )
    if gradient_predivide_factor != 1.0 and ReduceOp(op) != ReduceOp.AVERAGE:
        raise ConfigError(
            f"DistributedOptimizer: gradient_predivide_factor={gradient_predivide_factor} needs "
            f"op=Average, got {ReduceOp(op).name}; set gradient_predivide_factor=1.0"
        )
    return {
        "compression": compression, "sparse_as_dense": bool(sparse_as_dense),
        "gradient_predivide_factor": float(gradient_predivide_factor), "op": ReduceOp(op),
        "backward_passes_per_step": int(backward_passes_per_step),
        "average_aggregated_gradients": bool(average_aggregated_gradients),
        "num_groups": int(num_groups), "groups": groups, "process_set": process_set,
        "scale_local_gradients": bool(scale_local_gradients), "local_vars": list(local_vars),
    }


def create_distributed_optimizer(optimizer: Any, name: str | None = None, **options: Any) -> Any:
    """A distributed copy of ``optimizer`` built from its config (state is not copied)."""
    cls = wrap_optimizer_class(type(optimizer), **options)
    config = optimizer.get_config()
    config["name"] = name or f"Distributed{cls.__name__}"
    return cls.from_config(config)
