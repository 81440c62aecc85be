"""``hvd.elastic`` for TensorFlow 2 (Horovod's ``horovod.tensorflow.elastic``): ``run``,
``TensorFlowKerasState``, ``TensorFlowState``, and the core's ``ObjectState``.

The loop and the commit/restore/sync protocol live in :mod:`ringflow.elastic`; this module only
copies, assigns and sends variables, eagerly:

* ``commit()`` keeps each variable's value (``numpy()``), ``restore()`` assigns them back;
* ``sync()`` sends rank 0's values, pickled (bit for bit), and assigns them. A newcomer's Keras
  optimizer, whose variables do not exist before its first step, is built first
  (``optimizer.build(model.trainable_variables)``), so that it receives the moments and the
  iteration count.

Both states also carry the state of this rank's compressed exchanges (``compression=
Compression.powersgd(...)`` and the like, on a tape or a Keras optimizer:
:func:`~ringflow.tensorflow.gradient_tape.compressor_states`), as the torch optimizer's
``state_dict()`` does: committed and restored with the variables; synced as
:func:`ringflow.compressed.synced_state` says (rank 0's factors, step counts and ``auto``
decision, each rank's own error feedback).

``run`` also turns the ``tf.errors.UnknownError`` by which a collective inside a
``tf.function`` (or a compiled Keras step) fails into ``HorovodInternalError``, when its text
names one of ringflow's errors of that family; any other ``UnknownError`` propagates (Horovod's
wrapper returns None for it: the training function's failure then passes for its result).
TF1 graphs and sessions are not supported (ringflow's TensorFlow adapter is eager and
``tf.function`` only).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from ringflow import elastic as _core
from ringflow.compressed import synced_state
from ringflow.elastic import ObjectState, PartsState
from ringflow.errors import HorovodInternalError, UnsupportedError

from . import broadcast_object, rank
from .gradient_tape import compressor_states, load_compressor_states

__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]


def _family(cls: type) -> set[str]:
    return {cls.__name__}.union(*(_family(sub) for sub in cls.__subclasses__()))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run`` for TensorFlow (see :func:`ringflow.elastic.run`)."""
    names = re.compile(r"\b(" + "|".join(sorted(_family(HorovodInternalError))) + r")\b")

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as exc:
            if names.search(exc.message or ""):
                raise HorovodInternalError(exc.message) from exc
            raise

    return _core.run(wrapper)


class _Variables:
    """Saved values of a list of variables, and rank 0's sent to every rank."""

    def __init__(self, variables: Callable[[], Sequence[Any]]) -> None:
        self.variables = variables
        self.save()

    def save(self) -> None:
        self.saved = [v.numpy() for v in self.variables()]

    def restore(self) -> None:
        for var, value in zip(self.variables(), self.saved, strict=True):
            var.assign(value)

    def sync(self) -> None:
        for var, value in zip(self.variables(), broadcast_object([v.numpy() for v in
                                                                  self.variables()]),
                              strict=True):
            var.assign(value)
        self.save()


class _Compressors:
    """Saved states of this rank's compressed exchanges (see the module doc)."""

    def __init__(self) -> None:
        self.save()

    def save(self) -> None:
        self.saved = compressor_states()

    def restore(self) -> None:
        load_compressor_states(self.saved)

    def sync(self) -> None:
        own = compressor_states()
        received = broadcast_object(own)
        load_compressor_states({key: synced_state(state, own.get(key, {"errors": {}}))
                                for key, state in received.items()})
        self.save()


def _variables_of(optimizer: Any) -> Sequence[Any]:
    found = optimizer.variables  # Keras 3: a property; tf.keras 2: a method
    return found() if callable(found) else found


def _eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise UnsupportedError(f"{what} works eagerly (TensorFlow 2); TF1 graphs and sessions "
                               "are not supported by ringflow's TensorFlow adapter")


class TensorFlowKerasState(PartsState):
    """A Keras model and its optimizer (``model.optimizer`` by default), and plain values.

    Raises:
        ValueError: the model is not built yet (``model.build(input_shape)``), as Horovod's.
        UnsupportedError: not executing eagerly, or a ``backend`` given for a TF1 session.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        _eager("TensorFlowKerasState")
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        build = getattr(self.optimizer, "build", None)
        if build is not None and not getattr(self.optimizer, "built", True):
            build(model.trainable_variables)  # its slots exist from now on, on every rank
        super().__init__({"model": _Variables(lambda: self.model.variables),
                          "optimizer": _Variables(lambda: _variables_of(self.optimizer)),
                          "compressors": _Compressors()},
                         bcast_object=broadcast_object, get_rank=rank, **kwargs)


class TensorFlowState(PartsState):
    """A list of ``tf.Variable`` s (eagerly; ``session`` is TF1's and not supported), and plain
    values."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        _eager("TensorFlowState")
        if session is not None or variables is None:
            raise UnsupportedError("TensorFlowState needs the variables (TF1's global variables "
                                   "and sessions are not supported): TensorFlowState(variables)")
        self.variables = list(variables)
        super().__init__({"variables": _Variables(lambda: self.variables),
                          "compressors": _Compressors()},
                         bcast_object=broadcast_object, get_rank=rank, **kwargs)
