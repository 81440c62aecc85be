"""Variable and Python-object helpers: ``broadcast_variables``, ``broadcast_object``,
``allgather_object`` (Horovod 0.28's ``horovod.tensorflow.functions``).

Objects travel pickled, as uint8 arrays: first their lengths, then the bytes. Only peers that
proved the job secret can send them (see the transport), so unpickling them is as safe as the
training script itself.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import ProcessSet, global_process_set
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


def _bytes_of(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


@tf.autograph.experimental.do_not_convert
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of ``process_set`` (pickled; eager only).

    Raises:
        TensorError: called while tracing a ``tf.function`` (objects are Python values).
    """
    del session
    if not tf.executing_eagerly():
        raise TensorError(
            "broadcast_object() moves Python objects and cannot run inside tf.function; call it "
            "eagerly (outside the traced function)"
        )
    base = name or "object"  # not the type: non-root ranks often pass None
    me = process_set.rank()
    payload = _bytes_of(obj) if me == root_rank else np.zeros(0, np.uint8)
    length = _core.broadcast(np.asarray([payload.size], np.int64), root_rank,
                             name=f"broadcast_object.{base}.len", process_set=process_set)
    buf = payload if me == root_rank else np.zeros(int(length[0]), np.uint8)
    data = _core.broadcast(buf, root_rank, name=f"broadcast_object.{base}.data",
                           process_set=process_set)
    return obj if me == root_rank else pickle.loads(data.tobytes())


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@tf.autograph.experimental.do_not_convert
def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The list of every rank's ``obj``, in rank order of ``process_set`` (pickled; eager only)."""
    del session
    if not tf.executing_eagerly():
        raise TensorError(
            "allgather_object() moves Python objects and cannot run inside tf.function; call it "
            "eagerly (outside the traced function)"
        )
    base = name or "object"  # not the type: non-root ranks often pass None
    payload = _bytes_of(obj)
    lengths = _core.allgather(np.asarray([payload.size], np.int64),
                              name=f"allgather_object.{base}.len", process_set=process_set)
    data = _core.allgather(payload, name=f"allgather_object.{base}.data",
                           process_set=process_set)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(data[offsets[i]:offsets[i + 1]].tobytes()) for i in range(lengths.size)]
