"""Point-to-point ``send`` / ``recv`` on TensorFlow tensors, eagerly and inside ``tf.function``,
differentiable through ``tf.custom_gradient`` (MegEngine's ``remote_send`` / ``remote_recv``);
``isend`` / ``irecv`` (eager only) return handles.

Messages go between the two ranks only and are matched per (source, tag) in the order they were
sent (:mod:`ringflow.p2p`). A send completes once the receiver has the data (synchronous mode),
so an exchange in which both ranks send first uses ``isend`` (or orders its sends and receives).
Inside a graph, point-to-point ops run in trace order with the collectives (the chain of
:mod:`ringflow.tensorflow.mpi_ops`).

The autograd contract (the kit's rules, :data:`ringflow._adapter.P2P_GRADIENTS`, as in
``ringflow.torch``):

* ``send(x, dst, tag)`` returns a **token**, a scalar zero of ``x``'s dtype. Differentiating
  through it (``tape.gradient(token, variables)`` on a rank without a loss, or adding it to the
  loss) receives the gradient of ``x`` from ``dst``.
* ``recv(src, tag)`` of a floating-point tensor that the sender will want a gradient for (a
  floating-point send; TensorFlow cannot know at the send whether a tape will differentiate it)
  is recorded on every active tape through a trainable scalar variable of this module (tapes
  watch the trainable variables they see read), so ``tape.gradient(loss, ...)`` runs its
  gradient whenever the loss depends on it: the gradient is sent back to ``src`` without waiting.
* The backward pass runs a rank's point-to-point gradients in the reverse order of its forward
  calls: each differentiable send/recv takes the previous one's output (this thread's, eagerly;
  the graph's, in ``tf.function``) as an extra input on the tape, whose gradient is None. With
  gradient sends that never wait, a forward order that cannot deadlock then gives a backward
  that cannot either. (torch's engine runs a graph in reverse creation order by itself.)
  TensorFlow's own order is breadth-first from the target, which in an exchange in both
  directions can put both ranks' gradient receives first: a deadlock.
* Each side must do its part: a receiver that differentiates under a tape sends a gradient the
  sender must claim by differentiating through its token. First derivatives only.

Inside ``tf.function``, ``recv`` needs ``dtype`` (the graph's output type); eagerly it defaults
to the sender's. ``shape`` defaults to the sender's (unknown to the graph until run).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy as np
import tensorflow as tf

import ringflow as _core
from ringflow import _adapter as kit
from ringflow.errors import ShutdownError, TensorError
from ringflow.p2p import P2PHandle
from ringflow.submission import check_peer, check_tag, start_recv, start_send

from .mpi_ops import _call, _plain

__all__ = ["irecv", "isend", "recv", "send"]

log = logging.getLogger(__name__)

_ANCHOR: tf.Variable | None = None
# The last differentiable point-to-point output: of each thread (eager), of each graph.
_CHAIN_EAGER = threading.local()
_CHAIN_GRAPH: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _previous() -> list[tf.Tensor]:
    """[the previous differentiable point-to-point output of this thread or graph], or []."""
    if tf.executing_eagerly():
        ref = getattr(_CHAIN_EAGER, "last", None)
        prev = None if ref is None else ref()
    else:
        prev = _CHAIN_GRAPH.get(tf.compat.v1.get_default_graph())
    return [] if prev is None else [prev]


def _chain(out: tf.Tensor) -> tf.Tensor:
    """Remember ``out`` as the output the next differentiable point-to-point op takes."""
    if tf.executing_eagerly():
        _CHAIN_EAGER.last = weakref.ref(out)  # a token nobody holds cannot be on a tape
    else:
        _CHAIN_GRAPH[tf.compat.v1.get_default_graph()] = out
    return out


def _anchor() -> tf.Tensor:
    """A read of this module's trainable scalar: tapes watch it, so a receive that takes it as
    its input is recorded on every active tape (its own gradient is always zero)."""
    global _ANCHOR
    if _ANCHOR is None:
        with tf.init_scope():  # created once, outside any graph being traced
            _ANCHOR = tf.Variable(0.0, trainable=True, name="ringflow_recv_anchor")
    return tf.convert_to_tensor(_ANCHOR)


def _peer(value: Any, what: str) -> int:
    return check_peer(value, _core.rank(), _core.size(), what)


def _tf_dtype(dtype: Any) -> tf.DType | None:
    return None if dtype is None else tf.as_dtype(dtype)


class _TFP2POps:
    """The kit's :class:`~ringflow._adapter.P2POps` on TensorFlow tensors."""

    def send(self, x: tf.Tensor, dst: int, tag: Any) -> None:
        forward, seq = tag

        def run(array: np.ndarray, number: np.ndarray) -> list[np.ndarray]:
            if int(number) >= 0:  # a graph's recv gives -1 when the sender wants no gradient
                start_send(array, dst, (forward, int(number))).add_done_callback(_log_failure)
            return [np.asarray(0, np.int32)]

        _call(run, [x, tf.cast(seq, tf.int64)], [tf.int32], None)

    def recv(self, src: int, tag: Any, like: Any) -> tf.Tensor:
        forward, seq = tag

        def run(number: np.ndarray, shape: np.ndarray) -> list[np.ndarray]:
            core = start_recv(src, (forward, int(number)), None,
                              tuple(int(d) for d in shape), like.dtype.as_numpy_dtype)
            return [core.wait()]

        out = _call(run, [tf.cast(seq, tf.int64), tf.shape(like, out_type=tf.int64)],
                    [like.dtype], None)[0]
        out.set_shape(like.shape)
        return out


def _log_failure(handle: Any) -> None:
    """Nobody waits for a gradient's send: say what happened to it (its data may still arrive
    when this rank shut down first: it went out before the goodbye)."""
    try:
        handle.wait(0)
    except ShutdownError as exc:
        log.debug("ringflow.tensorflow: a gradient sent back (%s) was not confirmed: %s",
                  handle.name, exc)
    except Exception as exc:
        log.error("ringflow.tensorflow: sending a gradient back (%s) failed: %s", handle.name, exc)


_OPS = _TFP2POps()


@_plain
def send(tensor: Any, dst: int, tag: int = 0, name: str | None = None) -> tf.Tensor:
    """Send ``tensor`` to rank ``dst`` and return the token (see the module's autograd contract)
    once ``dst`` received it.

    Raises:
        TensorError: ``dst`` is not another rank, or ``tag`` is not an int (at the call, also
            while tracing).
        HorovodInternalError: the send failed (eagerly; in a graph TensorFlow reports it as an
            UnknownError carrying the class and text): ``dst`` refused its size or dtype, with
            the text it reports too; a peer failed; the job failed.
    """
    tensor = tf.convert_to_tensor(tensor)
    dst, tag = _peer(dst, "dst"), check_tag(tag)
    tracked = tensor.dtype.is_floating

    def run(array: np.ndarray) -> list[np.ndarray]:
        core = start_send(array, dst, tag, tracked=tracked)
        core.wait()
        return [np.zeros((), array.dtype), np.asarray(core.seq, np.int64)]

    @tf.custom_gradient
    def forward(x: tf.Tensor, *prev: tf.Tensor) -> Any:
        token, seq = _call(run, [x], [x.dtype, tf.int64], name)
        token.set_shape([])

        def grad(*dys: tf.Tensor) -> list[Any]:
            spec = kit.P2PSpec("send", dst, tag, seq, like=x)
            (dx,) = kit.P2P_GRADIENTS["send"](_OPS, [dys[0]], spec)
            return [dx, *[None] * len(prev)]

        return (token, seq), grad

    if not tracked:
        return _call(run, [tensor], [tensor.dtype, tf.int64], name)[0]
    return _chain(forward(tensor, *_previous())[0])


@_plain
def recv(src: int, tag: int = 0, shape: Any = None, dtype: Any = None,
         name: str | None = None) -> tf.Tensor:
    """Receive the next message of rank ``src`` sent with ``tag``: a tensor of ``shape``
    (default: the sender's) and the sender's dtype (``dtype``, if given, must be it; inside
    ``tf.function`` it is required). Differentiable (see the module's autograd contract).

    Raises:
        TensorError: ``src`` is not another rank, ``tag`` is not an int, or ``dtype`` is missing
            inside ``tf.function`` (at the call, also while tracing).
        HorovodInternalError: the receive failed (eagerly; in a graph an UnknownError carrying
            the class and text): its size or dtype disagreed with the send, a peer failed, the
            job failed.
    """
    src, tag = _peer(src, "src"), check_tag(tag)
    tf_dtype = _tf_dtype(dtype)
    want_shape = None if shape is None else tuple(int(d) for d in shape)
    if tf.executing_eagerly():
        core = start_recv(src, tag, None, want_shape,
                          None if tf_dtype is None else tf_dtype.as_numpy_dtype)
        value = tf.convert_to_tensor(core.wait())
        if not (core.tracked and value.dtype.is_floating):
            return value
        return _attach(value, src, tag, core.seq)
    if tf_dtype is None:
        raise TensorError(f"recv from rank {src} (tag {tag}) inside tf.function needs dtype= "
                          "(the graph's output type)")

    def run(_: np.ndarray) -> list[np.ndarray]:
        core = start_recv(src, tag, None, want_shape, tf_dtype.as_numpy_dtype)
        # The sender waits for a gradient only if it said so: -1 makes the gradient op skip it.
        return [core.wait(), np.asarray(core.seq if core.tracked else -1, np.int64)]

    if not tf_dtype.is_floating:
        value = _call(run, [_anchor()], [tf_dtype, tf.int64], name)[0]
        value.set_shape(want_shape)
        return value

    @tf.custom_gradient
    def forward(anchor: tf.Tensor, *prev: tf.Tensor) -> Any:
        value, seq = _call(run, [anchor], [tf_dtype, tf.int64], name)
        value.set_shape(want_shape)

        def grad(*dys: tf.Tensor) -> list[Any]:
            dy = tf.zeros_like(value) if dys[0] is None else dys[0]
            kit.P2P_GRADIENTS["recv"](_OPS, [dy], kit.P2PSpec("recv", src, tag, seq))
            return [tf.zeros_like(anchor), *[None] * len(prev)]

        return (value, seq), grad

    return _chain(forward(_anchor(), *_previous())[0])


def _attach(value: tf.Tensor, src: int, tag: int, seq: int) -> tf.Tensor:
    """``value``, recorded on the active tapes with the receive's gradient rule (eagerly)."""

    @tf.custom_gradient
    def forward(anchor: tf.Tensor, *prev: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> list[Any]:
            kit.P2P_GRADIENTS["recv"](_OPS, [dy], kit.P2PSpec("recv", src, tag, seq))
            return [tf.zeros_like(anchor), *[None] * len(prev)]

        return tf.identity(value), grad

    return _chain(forward(_anchor(), *_previous()))


def isend(tensor: Any, dst: int, tag: int = 0) -> P2PHandle:
    """Start sending ``tensor`` to rank ``dst`` (eagerly; not differentiable); the handle's
    ``wait()`` returns once ``dst`` received it, ``is_completed()`` says whether it did.

    Raises:
        TensorError: ``dst`` is not another rank, ``tag`` is not an int, or this runs inside
            ``tf.function`` (handles cannot leave a graph: use ``send``).
    """
    _eager_only("isend")
    return start_send(tf.convert_to_tensor(tensor).numpy(), dst, tag)


def irecv(src: int, tag: int = 0, shape: Any = None, dtype: Any = None) -> P2PHandle:
    """Start receiving the next message of ``src`` with ``tag`` (eagerly; not differentiable);
    the handle's ``wait()`` returns it as a numpy array (``tf.convert_to_tensor`` it).

    Raises:
        TensorError: as :func:`isend`; or ``shape`` / ``dtype`` are not usable.
    """
    _eager_only("irecv")
    tf_dtype = _tf_dtype(dtype)
    return start_recv(src, tag, None, shape, None if tf_dtype is None else tf_dtype.as_numpy_dtype)


def _eager_only(what: str) -> None:
    if not tf.executing_eagerly():
        raise TensorError(f"{what} returns a handle, which cannot leave a tf.function; use "
                          f"{what[1:]}() inside tf.function")
