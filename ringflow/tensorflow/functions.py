"""Variable and Python-object helpers: ``broadcast_variables``, ``broadcast_object``,
``allgather_object`` (Horovod 0.28's ``horovod.tensorflow.functions``).

Objects travel as the adapter kit sends them (:mod:`ringflow._adapter`, shared with
``ringflow.torch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import ProcessSet, global_process_set
from ringflow import _adapter as kit
from ringflow.errors import RingflowError, TensorError, UnsupportedError

from . import status
from .mpi_ops import broadcast

__all__ = ["allgather_object", "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables"]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False,
                        name: str | None = None) -> Any:
    """Assign ``root_rank``'s value to each variable on every rank of ``process_set``.

    Eagerly, all broadcasts are submitted at once and fused by the engine; the list of new values
    is returned. In a graph, the grouped assign op is returned (Horovod's). ``inplace`` is
    accepted for Horovod compatibility (ringflow always assigns in place).
    """
    del inplace
    assigned = _assign_broadcasts(list(variables), root_rank, process_set, name)
    return assigned if tf.executing_eagerly() else tf.group(*assigned)


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Broadcast ``variables`` in place from ``root_rank``; returns their new values (in a graph,
    tensors that read each variable after its assignment, as Horovod's op returns them)."""
    assigned = _assign_broadcasts(list(variables), root_rank, process_set, name)
    return [tf.convert_to_tensor(a) for a in assigned]


def _assign_broadcasts(variables: list[Any], root_rank: int, process_set: ProcessSet,
                       name: str | None) -> list[Any]:
    """Eagerly: assign the broadcast values and return them (tensors). In a graph: the assign
    of each variable (its value after the assignment, read lazily)."""
    base = name or "broadcast_variables"
    if tf.executing_eagerly():
        try:
            handles = [
                # By position, not variable name: Keras numbers names per process.
                _core.broadcast_async(np.asarray(v.numpy()), int(root_rank), name=f"{base}.{i}",
                                      process_set=process_set)
                for i, v in enumerate(variables)
            ]
            values = [h.wait() for h in handles]
        except RingflowError as exc:
            raise status.typed(exc) from exc
        for v, value in zip(variables, values, strict=True):
            v.assign(np.reshape(value, v.shape))  # the core returns 0-d values as (1,)
        return [tf.convert_to_tensor(v) for v in variables]
    return [v.assign(broadcast(v, root_rank, f"{base}_{i}", process_set=process_set))
            for i, v in enumerate(variables)]


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast TF1's global variables (``tf.compat.v1.global_variables()``) from
    ``root_rank``: the grouped assign op, in graph mode only (Horovod's).

    Raises:
        UnsupportedError: called eagerly (a RuntimeError, as Horovod raises); eager code has no
            global variables: broadcast the model's (``broadcast_variables(model.variables)``).
    """
    if tf.executing_eagerly():
        raise UnsupportedError(
            "broadcast_global_variables() does not support eager execution (there are no "
            "global variables); use broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _not_traced(what: str) -> None:
    if tf.inside_function():
        raise TensorError(f"{what}() moves Python objects and cannot run inside tf.function; "
                          "call it eagerly (outside the traced function)")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of ``process_set`` (the kit's
    :func:`~ringflow._adapter.broadcast_object`; ``root_rank`` is a global rank).

    Eagerly and in a TF1 graph alike, the object moves at the call (Horovod runs its broadcast
    in the default session there).

    Raises:
        TensorError: called while tracing a ``tf.function`` (objects are Python values).
    """
    del session
    _not_traced("broadcast_object")
    return kit.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The list of every rank's ``obj``, in rank order of ``process_set`` (the kit's
    :func:`~ringflow._adapter.allgather_object`; eagerly or in a TF1 graph, not in a
    ``tf.function``)."""
    del session
    _not_traced("allgather_object")
    return kit.allgather_object(obj, name, process_set)
