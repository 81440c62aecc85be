"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` averages over ranks.

``allreduce_gradients`` is the shared step (also used by the Keras ``DistributedOptimizer``):

1. ``IndexedSlices`` become dense when ``sparse_as_dense``; otherwise they take Horovod's sparse
   path (allgather of values and indices).
2. Dense gradients are batched by the policy the torch optimizer uses (:mod:`ringflow.batching`),
   told of every gradient at once: explicit ``groups`` of variables (or ``groups``/``num_groups``
   equal contiguous runs), then all the others as one batch (default: one op per step). Each
   batch is one grouped op; the engine fuses whatever is submitted together anyway.
3. ``gradient_predivide_factor`` f splits the average into a prescale 1/f and a postscale f/n
   (Horovod's semantics; only with op=Average).
4. Gradients of *local* variables (``PartialDistributedGradientTape``) are not reduced; with
   ``scale_local_gradients`` they are divided by the set size, so that their scale matches that of
   averaged gradients.

Names: eagerly ``<prefix>.<crc32 of the gradients' positions, dtypes and shapes>.g<k>``; in a
graph, ``<prefix>_Allreduce_g<k>`` under the current name scope, made unique by the graph.
Variable names never enter a name: Keras numbers them per process, so they can differ by rank.
``use_generic_names`` is accepted for Horovod compatibility (names are always generic).

A compressor with state (``Compression.powersgd`` / ``randomk`` / ``onebit`` / ``auto``) takes
the dense gradients it compresses (:class:`ringflow.compressed.Exchange`, on numpy copies; in a
graph inside one ``tf.py_function``, after the exact reduction of the others). Its state lives
in :func:`exchange_for`'s registry, per compressor, reduce op, scales, process set and prefix,
because Horovod's pattern wraps a new tape every step; its tensors are named by position, dtype
and shape (``<prefix>.c<i>:<dtype><shape>``), as the generic names are.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ringflow import Average, ProcessSet, ReduceOp, global_process_set, runtime
from ringflow.batching import GradientBatcher
from ringflow.compressed import HOST, Exchange, configured
from ringflow.compression import GradientCompression
from ringflow.errors import TensorError

from .compression import Compression
from .mpi_ops import current

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "allreduce_gradients",
           "compressor_states", "exchange_for", "load_compressor_states"]

_EXCHANGES: dict[tuple[Any, ...], Exchange] = {}
_PENDING: dict[tuple[Any, ...], dict[str, Any]] = {}  # loaded before their exchange existed


def exchange_for(compression: GradientCompression, op: ReduceOp | int = Average,
                 prescale: float = 1.0, postscale: float = 1.0,
                 process_set: ProcessSet = global_process_set,
                 prefix: str = "DistributedGradientTape") -> Exchange:
    """The :class:`~ringflow.compressed.Exchange` (error feedback, warm start) that
    ``DistributedGradientTape(compression=...)`` / the Keras ``DistributedOptimizer`` use with
    these arguments: its ``state_dict()`` / ``load_state_dict()`` save and restore it. One per
    rank (ranks as threads each have their own); it outlives ``shutdown(); init()``, so that an
    elastic reset keeps it (a ``tf.function`` traced before holds it) and the elastic states
    restore and sync it (:func:`compressor_states`)."""
    key = (runtime.this_rank(), compression, int(ReduceOp(op)), float(prescale),
           float(postscale), process_set.process_set_id, prefix)
    ex = _EXCHANGES.get(key)
    if ex is None:
        ex = _EXCHANGES[key] = Exchange(compression, HOST, ReduceOp(op), prescale, postscale,
                                        process_set)
        state = _PENDING.pop(key, None)
        if state is not None:
            ex.load_state_dict(state)
    return ex


def compressor_states() -> dict[tuple[Any, ...], dict[str, Any]]:
    """A copy of the state of every compressed exchange of this rank (its tapes' and Keras
    optimizers'), by a key that is the same on every rank: what TensorFlow's elastic states
    commit, restore and send."""
    me = runtime.this_rank()
    states = {key[1:]: state for key, state in _PENDING.items() if key[0] is me}
    states.update({key[1:]: ex.state_dict() for key, ex in _EXCHANGES.items() if key[0] is me})
    return copy.deepcopy(states)


def load_compressor_states(states: dict[tuple[Any, ...], dict[str, Any]]) -> None:
    """Make this rank's compressed exchanges hold ``states`` (:func:`compressor_states`' form);
    an exchange that ``states`` lacks starts afresh, one not created yet takes its state when
    it is.

    Raises:
        ConfigError: a state is another compressor's.
    """
    me = runtime.this_rank()
    for key in [key for key in _PENDING if key[0] is me]:
        del _PENDING[key]
    for key, ex in _EXCHANGES.items():
        if key[0] is me and key[1:] not in states:
            ex.clear()
    for portable, state in copy.deepcopy(states).items():
        ex = _EXCHANGES.get((me, *portable))
        if ex is None:
            _PENDING[(me, *portable)] = state
        else:
            ex.load_state_dict(state)


_plain = tf.autograph.experimental.do_not_convert


def _batches(n_dense: int, variables: list[Any], num_groups: int,
             groups: Sequence[Sequence[Any]] | int | None) -> list[list[int]]:
    """Positions (into the dense gradients) of each batch, in a rank-independent order: the
    shared policy (:mod:`ringflow.batching`) told of every gradient at once."""
    spec: Any = None
    if isinstance(groups, int) or (groups is None and num_groups > 0):
        spec = groups or num_groups
    elif groups is not None:
        where = {id(v): i for i, v in enumerate(variables) if v is not None}
        spec = [[where[id(v)] for v in g if id(v) in where] for g in groups]
    batcher = GradientBatcher(range(n_dense), spec)
    return [list(b.keys) for b in batcher.all_ready(range(n_dense))]


@_plain
def allreduce_gradients(grads: Sequence[Any], variables: Sequence[Any] | None, *,
                        prefix: str = "DistributedGradientTape",
                        compression: Any = Compression.none, sparse_as_dense: bool = False,
                        op: ReduceOp | int = Average, gradient_predivide_factor: float = 1.0,
                        num_groups: int = 0, groups: Sequence[Sequence[Any]] | None = None,
                        process_set: ProcessSet = global_process_set,
                        local_vars: Sequence[Any] = (), scale_local_gradients: bool = True,
                        use_generic_names: bool = False) -> list[Any]:
    """Average (or ``op``-reduce) ``grads`` over ``process_set``; ``None`` gradients stay None.

    Raises:
        TensorError: ``gradient_predivide_factor`` != 1 with an op other than Average.
    """
    from . import allreduce  # the public allreduce (sparse path, custom compressors)

    op = ReduceOp(op)
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.AVERAGE:
            raise TensorError(
                f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got "
                f"op={op.name}; set gradient_predivide_factor=1.0 or use op=Average"
            )
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    grads = list(grads)
    variables = list(variables) if variables is not None else [None] * len(grads)
    stateful = configured(compression)  # a compressor with state takes dense gradients only
    if isinstance(stateful, GradientCompression):
        compression = Compression.none
    local = {id(v) for v in local_vars}
    out: list[Any] = list(grads)
    dense: list[int] = []
    labels = []
    for i, (g, v) in enumerate(zip(grads, variables, strict=True)):
        if g is None:
            continue
        if v is not None and id(v) in local:
            if scale_local_gradients:
                out[i] = g / tf.cast(current(process_set.size), g.dtype)
            continue
        if isinstance(g, tf.IndexedSlices) and sparse_as_dense:
            g = out[i] = tf.convert_to_tensor(g)
        # Only position, dtype and shape go into the name: variable names come from per-process
        # counters (Keras auto-naming) and may differ between ranks that built other objects.
        labels.append(f"{i}:{g.dtype.name}{tuple(g.shape)}")
        if isinstance(g, tf.IndexedSlices):
            name = f"{prefix}.sparse.{i}" if tf.executing_eagerly() else None
            out[i] = allreduce(g, op=op, compression=compression, name=name,
                               process_set=process_set)
        else:
            dense.append(i)
    if not dense:
        return out
    compressed: list[int] = []
    if isinstance(stateful, GradientCompression):
        ex = exchange_for(stateful, op, prescale, postscale, process_set, prefix)
        if process_set.size() > 1:  # one rank exchanges nothing (the torch optimizer's rule)
            compressed = [i for i in dense if ex.compresses(out[i], out[i].dtype.name)]
        dense = [i for i in dense if i not in compressed]
    else:
        compression = stateful  # RINGFLOW_COMPRESSION's fp16 / bf16 where the call asked none
    tag = f"{zlib.crc32('|'.join(labels).encode()):08x}"
    for k, group in enumerate(_batches(len(dense), [variables[i] for i in dense], num_groups,
                                       groups)):
        idx = [dense[j] for j in group]
        name = f"{prefix}.{tag}.g{k}" if tf.executing_eagerly() else f"{prefix}_Allreduce_g{k}"
        reduced = _reduce_group([out[i] for i in idx], name, op, prescale, postscale,
                                compression, process_set)
        for i, r in zip(idx, reduced, strict=True):
            out[i] = r
    if compressed:
        after = [out[i] for i in dense]  # in a graph: after the exact reduction (one order)
        names = [f"{prefix}.c{i}:{out[i].dtype.name}{tuple(out[i].shape)}" for i in compressed]
        for i, r in zip(compressed, _exchange(ex, names, [out[i] for i in compressed], after),
                        strict=True):
            out[i] = r
    return out


def _exchange(ex: Exchange, names: list[str], tensors: list[Any], after: list[Any]) -> list[Any]:
    def run(*values: Any) -> list[Any]:
        arrays = [np.array(v) for v in values]
        items = ex.start(names, arrays)
        ex.middle(items)
        ex.end(items)
        return arrays

    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in run(*tensors)]
    with tf.control_dependencies(after):
        outs = tf.py_function(run, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors, strict=True):
        o.set_shape(t.shape)
    return list(outs)


def _reduce_group(tensors: list[Any], name: str, op: ReduceOp, prescale: float,
                  postscale: float, compression: Any, process_set: ProcessSet) -> list[Any]:
    from . import grouped_allreduce

    return grouped_allreduce(tensors, op=op, compression=compression, prescale_factor=prescale,
                             postscale_factor=postscale, process_set=process_set, name=name)


class _DistributedGradientTape(tf.GradientTape):
    """Body of the class ``DistributedGradientTape`` builds (a subclass of the tape's class)."""

    def _ringflow_setup(self, options: dict[str, Any]) -> None:
        self._ringflow = options
        self._local_sources: list[Any] = list(options.pop("local_vars", ()))

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (not averaged over ranks)."""
        self._local_sources.append(source)

    @_plain
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        """The tape's gradients, reduced over the process set (structure of ``sources`` kept)."""
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = allreduce_gradients(flat_grads, flat_sources, local_vars=self._local_sources,
                                      use_generic_names=use_generic_names, **self._ringflow)
        return tf.nest.pack_sequence_as(grads, reduced)


@_plain
def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: ReduceOp | int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Sequence[Sequence[Any]] | None = None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True,
                            _local_vars: Sequence[Any] = ()) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged over ranks.

    Works on a tape that has already recorded (``tape = DistributedGradientTape(tape)`` after the
    ``with`` block) and on a fresh one used as a context manager. The result is an instance of a
    subclass of the tape's own class, with the same class name.
    """
    del device_dense, device_sparse
    base = gradtape.__class__
    cls = base if issubclass(base, _DistributedGradientTape) else type(
        base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    # Take over what the original recorded (Horovod does the same with the private _tape).
    tape._tape = gradtape._tape
    tape._recording = getattr(gradtape, "_recording", False)
    tape._watched_variables = getattr(gradtape, "_watched_variables", ())
    _DistributedGradientTape._ringflow_setup(tape, {
        "prefix": "DistributedGradientTape", "compression": compression,
        "sparse_as_dense": sparse_as_dense, "op": op,
        "gradient_predivide_factor": gradient_predivide_factor, "num_groups": num_groups,
        "groups": groups, "process_set": process_set,
        "scale_local_gradients": scale_local_gradients, "local_vars": list(_local_vars),
    })
    return tape


@_plain
def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: ReduceOp | int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Sequence[Sequence[Any]] | None = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` local.

    ``local_layers`` is a Keras layer or a list of them; their trainable weights are registered
    with ``register_local_source``.
    """
    if local_layers is None:
        layers: list[Any] = []
    elif isinstance(local_layers, (list, tuple)):
        layers = list(local_layers)
    else:
        layers = [local_layers]
    local_vars = [w for layer in layers for w in layer.trainable_weights]
    return DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients,
                                   _local_vars=local_vars)
