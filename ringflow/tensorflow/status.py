"""How a ringflow error surfaces in TensorFlow: as the ``tf.errors`` class Horovod's op raises.

Horovod's TensorFlow kernels turn its core's ``Status`` into a TensorFlow status
(``ConvertStatus`` in ``horovod/tensorflow/mpi_ops.cc``), so a failed collective raises a
``tf.errors.OpError`` eagerly and inside a graph alike. Which class, as read in Horovod 0.28's
sources (``horovod/common/operations.cc``, ``ops/collective_operations.cc``, ``common.h``):

=====================================  =========================  ============================
what failed                            Horovod's status           ringflow's error -> tf class
=====================================  =========================  ============================
ranks disagree (dtype, shape, op,      ``PreconditionError`` (the ``MismatchError`` ->
root, ...): the coordinator's ERROR    ERROR response)            ``FailedPreconditionError``
the call itself (splits, root, a       ``InvalidArgument``        ``TensorError`` ->
duplicate name, a scalar to scatter)                              ``InvalidArgumentError``
not initialized                        ``PreconditionError``      ``NotInitializedError`` ->
                                                                  ``FailedPreconditionError``
shut down, a stall, a lost peer        ``UnknownError``           ``ShutdownError``,
                                       (``SHUT_DOWN_ERROR``)      ``StallError``, ``PeerError``
                                                                  -> ``UnknownError``
not implemented here                   (Python's                  ``UnsupportedError``,
                                       ``NotImplementedError``)   ``AdasumError`` ->
                                                                  ``UnimplementedError``
=====================================  =========================  ============================

The error keeps ringflow's class and text: eagerly, :func:`typed` makes an exception that is both
(``except hvd.MismatchError`` and ``except tf.errors.FailedPreconditionError`` both catch it).

Inside a graph the collective is a ``tf.py_function``, and TensorFlow decides the class from the
Python exception the function raises, by its builtin base only: ``ValueError`` and
``TypeError`` -> ``InvalidArgumentError``, ``NotImplementedError`` -> ``UnimplementedError``,
anything else -> ``UnknownError`` (``tensorflow/python/lib/core/py_func.cc``, whose own comment
notes that an ``OpError``'s code is not used). That is right for every row above but the
FailedPrecondition ones, which no exception can reach. TensorFlow reports a
``FailedPreconditionError`` for a ``tf.py_function`` that returns, in its list of outputs,
something other than a tensor ("Expected EagerTensor, found PyObject of type: <type name>"), so
for those the function returns :func:`carriers`: placeholders whose type is named after the
error (``"MismatchError: <text>"``), which the message then carries. That is TensorFlow's
behaviour from 2.0 to 2.21 (py_func.cc unchanged); ``tests/unit/test_tf_status.py`` pins it, and
a TensorFlow that stopped reporting it would still fail the op with the text, as another class.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from ringflow import errors

__all__ = ["carriers", "tf_class", "typed"]

# ringflow class -> tf.errors class, most specific first (the first isinstance match wins).
_TABLE: tuple[tuple[type[BaseException], type[tf.errors.OpError]], ...] = (
    (errors.MismatchError, tf.errors.FailedPreconditionError),
    (errors.NotInitializedError, tf.errors.FailedPreconditionError),
    (errors.AdasumError, tf.errors.UnimplementedError),
    (errors.UnsupportedError, tf.errors.UnimplementedError),
    (errors.TensorError, tf.errors.InvalidArgumentError),
    (errors.HorovodInternalError, tf.errors.UnknownError),
)


def tf_class(exc: BaseException) -> type[tf.errors.OpError] | None:
    """The ``tf.errors`` class Horovod's op would raise for ``exc``; None when ``exc`` is not a
    collective's error (it is then raised as it is)."""
    if isinstance(exc, tf.errors.OpError):
        return None
    return next((tf_cls for cls, tf_cls in _TABLE if isinstance(exc, cls)), None)


@functools.cache
def _combined(cls: type[BaseException], tf_cls: type[tf.errors.OpError]) -> type[Any]:
    def __init__(self: Any, message: str) -> None:
        tf_cls.__init__(self, None, None, message)
        self.args = (message,)

    def __reduce__(self: Any) -> tuple[Any, ...]:
        return _rebuild, (cls, tf_cls, self.message)

    return type(cls.__name__, (cls, tf_cls), {
        "__init__": __init__, "__reduce__": __reduce__, "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__name__} raised as TensorFlow's {tf_cls.__name__}.",
    })


def _rebuild(cls: type[BaseException], tf_cls: type[tf.errors.OpError], message: str) -> Any:
    return _combined(cls, tf_cls)(message)


def typed(exc: BaseException) -> BaseException:
    """``exc`` as an instance of both its class and its ``tf.errors`` class (same text); ``exc``
    itself when it has no ``tf.errors`` class."""
    tf_cls = tf_class(exc)
    if tf_cls is None:
        return exc
    return _combined(type(exc), tf_cls)(str(exc))


class _Anywhere(str):
    """A device name equal to every device: TensorFlow compares a py_function's outputs' device
    with the op's before it hands them over (``script_ops._maybe_copy_to_context_device``)."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


def _carrier_class(text: str) -> type[Any]:
    return type(text.replace("\0", " "), (), {
        # Taken for a tensor by tf.convert_to_tensor (TensorFlow's __tf_tensor__ protocol) ...
        "__tf_tensor__": lambda self, dtype=None, name=None: self,
        "backing_device": _Anywhere("carrier"),
        # ... and refused by the kernel, which names the type: the error's class and text.
    })


def carriers(exc: BaseException, count: int) -> list[Any]:
    """What a ``tf.py_function`` returns (``count`` outputs) so that its op fails with
    ``FailedPreconditionError`` carrying ``exc``'s class and text (see the module docstring)."""
    carrier = _carrier_class(f"{type(exc).__name__}: {exc}")()
    return [carrier] * max(count, 1)
