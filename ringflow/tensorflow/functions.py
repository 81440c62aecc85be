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
from ringflow.errors import TensorError

from .mpi_ops import broadcast

__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables"]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False,
                        name: str | None = None) -> Any:
    """Assign ``root_rank``'s value to each variable on every rank of ``process_set``.

    Eagerly, all broadcasts are submitted at once and fused by the engine; the list of new values
    is returned. In a graph, the grouped assign op is returned. ``inplace`` is accepted for
    Horovod compatibility (ringflow always assigns in place).
    """
    del inplace
    variables = list(variables)
    base = name or "broadcast_variables"
    if tf.executing_eagerly():
        handles = [
            # By position, not variable name: Keras numbers names per process.
            _core.broadcast_async(np.asarray(v.numpy()), int(root_rank), name=f"{base}.{i}",
                                  process_set=process_set)
            for i, v in enumerate(variables)
        ]
        for v, h in zip(variables, handles, strict=True):
            v.assign(np.reshape(h.wait(), v.shape))  # the core returns 0-d values as (1,)
        return [tf.convert_to_tensor(v) for v in variables]
    return tf.group(*[
        v.assign(broadcast(v, root_rank, f"{base}_{i}", process_set=process_set))
        for i, v in enumerate(variables)
    ])


def _eager_only(what: str) -> None:
    if not tf.executing_eagerly():
        raise TensorError(f"{what}() moves Python objects and cannot run inside tf.function; "
                          "call it eagerly (outside the traced function)")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of ``process_set`` (the kit's
    :func:`~ringflow._adapter.broadcast_object`; eager only; ``root_rank`` is a global rank).

    Raises:
        TensorError: called while tracing a ``tf.function`` (objects are Python values).
    """
    del session
    _eager_only("broadcast_object")
    return kit.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The list of every rank's ``obj``, in rank order of ``process_set`` (the kit's
    :func:`~ringflow._adapter.allgather_object`; eager only)."""
    del session
    _eager_only("allgather_object")
    return kit.allgather_object(obj, name, process_set)
