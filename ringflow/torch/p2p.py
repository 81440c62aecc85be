"""Point-to-point ``send`` / ``recv`` / ``isend`` / ``irecv`` on torch tensors; ``send`` and
``recv`` are differentiable (MegEngine's ``remote_send`` / ``remote_recv``).

Messages go between the two ranks only and are matched per (source, tag) in the order they were
sent (:mod:`ringflow.p2p`). A send completes once the receiver has the data (synchronous mode),
so an exchange in which both ranks send first uses ``isend``; a sent tensor may be changed as
soon as ``send``/``isend`` returns (its bytes have been copied).

The autograd contract (the rules are the kit's, :data:`ringflow._adapter.P2P_GRADIENTS`):

* ``send(x, dst, tag)`` returns a **token**, a 0-dim zero tensor of ``x``'s dtype. When ``x``
  requires grad, backpropagating through the token (``token.backward()`` on a rank without a
  loss, or ``(loss + token).backward()``) receives the gradient of ``x`` from ``dst`` and carries
  it into ``x``'s graph. The sender tells the receiver that it will want that gradient.
* ``recv(src, tag)`` returns a tensor that requires grad when the sender's tensor did (and grad
  mode is on). When the backward pass reaches it, its gradient is sent back to ``src`` without
  waiting (so the two ranks' backward passes may run in any order). ``loss.backward()`` reaches
  it whenever the loss depends on it; ``torch.autograd.grad(loss, params)`` visits only the
  paths to ``params``, and does not.
* The backward pass runs a rank's point-to-point gradients in the reverse order of its forward
  calls (torch's engine runs a graph in reverse creation order), and a gradient send never
  waits, so a forward order that cannot deadlock gives a backward that cannot either.
* Each side must do its part: a sender whose token is never backpropagated leaves the gradient
  unclaimed (it stays buffered), and a sender waits in ``token.backward()`` until the receiver's
  backward pass has sent the gradient. First derivatives only.

``isend`` / ``irecv`` are not differentiable (as in torch.distributed) and return a
:class:`P2PWork` with torch.distributed's ``is_completed()`` and ``wait()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _adapter as kit
from ..errors import ShutdownError, TensorError
from ..p2p import P2PHandle
from ..submission import start_recv, start_send
from ._tensors import SUPPORTED, from_numpy, prepare, to_numpy
from .mpi_ops import TorchHandle

__all__ = ["P2PWork", "irecv", "isend", "recv", "remote_recv", "remote_send", "send"]

log = logging.getLogger(__name__)


class P2PWork(TorchHandle):
    """A pending ``isend`` / ``irecv`` (torch.distributed's ``Work``): ``wait()`` returns None
    for a send, the received tensor for a receive, and raises the operation's error."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return self.poll()

    def __repr__(self) -> str:
        return f"<P2PWork {self.core!r}>"


def _numpy_dtype(dtype: Any) -> Any:
    if dtype is None or not isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in SUPPORTED:
        raise TensorError(f"recv: dtype {dtype} is not one ringflow moves; supported: "
                          f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED)}")
    return to_numpy(torch.empty(0, dtype=dtype)).dtype


def _start_recv(src: int, tag: Any, out: torch.Tensor | None, shape: Any,
                dtype: Any) -> tuple[P2PHandle, Callable[[Any], torch.Tensor]]:
    if out is None:
        core = start_recv(src, tag, None, shape, _numpy_dtype(dtype))
        return core, lambda value: from_numpy(np.asarray(value))
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
        raise TensorError(f"recv: out must be a contiguous CPU torch.Tensor, got "
                          f"{out.device if isinstance(out, torch.Tensor) else type(out).__name__}"
                          f"{'' if not isinstance(out, torch.Tensor) else ' tensor'}")
    if out.requires_grad and out.is_leaf:
        raise TensorError("recv: out is a leaf tensor that requires grad and cannot be written "
                          "in place; pass no out (recv returns a new tensor)")
    core = start_recv(src, tag, to_numpy(out.detach()), shape, _numpy_dtype(dtype))
    return core, lambda _: out


# asynchronous, not differentiable ----------------------------------------------------------------
def isend(tensor: torch.Tensor, dst: int, tag: int = 0) -> P2PWork:
    """Start sending ``tensor`` to rank ``dst``; ``wait()`` returns once ``dst`` received it.

    Raises:
        TensorError: ``dst`` is not another rank, or ``tag`` is not an int (a tensor that cannot
            be sent fails the work and the matching receive instead).
    """
    return P2PWork(start_send(prepare(tensor, "isend tensor")[0], dst, tag), lambda _: None)


def irecv(src: int, tag: int = 0, out: torch.Tensor | None = None, shape: Any = None,
          dtype: torch.dtype | None = None) -> P2PWork:
    """Start receiving the next message of ``src`` with ``tag``; ``wait()`` returns the tensor:
    ``out`` when given, else a new one of ``shape`` (default: the sender's) and the sender's
    dtype (``dtype``, if given, must be it).

    Raises:
        TensorError: ``src`` is not another rank, ``tag`` is not an int, or ``out`` / ``shape``
            / ``dtype`` are not usable.
    """
    return P2PWork(*_start_recv(src, tag, out, shape, dtype))


# differentiable ----------------------------------------------------------------------------------
class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dst: int, tag: int) -> torch.Tensor:
        core = start_send(prepare(tensor, "send tensor")[0], dst, tag, tracked=True)
        core.wait()
        ctx.spec = kit.P2PSpec("send", core.peer, int(core.tag), core.seq,  # type: ignore[arg-type]
                               like=(tensor.shape, tensor.dtype))
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx: Any, dtoken: torch.Tensor) -> tuple[Any, ...]:
        (dx,) = kit.P2P_GRADIENTS["send"](_OPS, [dtoken], ctx.spec)
        return dx, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: kit.P2PSpec, anchor: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        return value  # returned as a view of the received tensor (torch's rule for inputs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        kit.P2P_GRADIENTS["recv"](_OPS, [dy.contiguous()], ctx.spec)
        return None, None, None


class _TorchP2POps:
    """The kit's :class:`~ringflow._adapter.P2POps` on torch tensors."""

    def send(self, x: torch.Tensor, dst: int, tag: Any) -> None:
        start_send(prepare(x.detach(), "gradient")[0], dst, tag).add_done_callback(_log_failure)

    def recv(self, src: int, tag: Any, like: Any) -> torch.Tensor:
        shape, dtype = like
        core = start_recv(src, tag, None, tuple(shape), _numpy_dtype(dtype))
        return from_numpy(np.asarray(core.wait()))


def _log_failure(handle: Any) -> None:
    """Nobody waits for a gradient's send: say what happened to it (its data may still arrive
    when this rank shut down first: it went out before the goodbye)."""
    try:
        handle.wait(0)
    except ShutdownError as exc:
        log.debug("ringflow.torch: a gradient sent back (%s) was not confirmed: %s", handle.name,
                  exc)
    except Exception as exc:
        log.error("ringflow.torch: sending a gradient back (%s) failed: %s", handle.name, exc)


_OPS = _TorchP2POps()


def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> torch.Tensor:
    """Send ``tensor`` to rank ``dst``, return once ``dst`` received it; returns the token (see
    the module's autograd contract): backpropagate through it to receive ``tensor``'s gradient.

    Raises:
        TensorError: ``dst`` is not another rank, or ``tag`` is not an int.
        HorovodInternalError: the send failed (``dst`` refused its size or dtype, with the text
            it reports too; a peer failed; the job failed).
    """
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _Send.apply(tensor, dst, tag)  # type: ignore[no-any-return]
    isend(tensor, dst, tag).wait()
    return (tensor.new_zeros(()) if isinstance(tensor, torch.Tensor)
            else torch.zeros(()))


def recv(src: int, tag: int = 0, out: torch.Tensor | None = None, shape: Any = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """Receive the next message of rank ``src`` with ``tag`` (see :func:`irecv` for ``out``,
    ``shape``, ``dtype``). The result requires grad when the sender's tensor did; its gradient
    goes back to ``src`` in the backward pass (see the module's autograd contract).

    Raises:
        TensorError: ``src`` is not another rank, ``tag`` is not an int, or ``out`` / ``shape``
            / ``dtype`` are not usable.
        HorovodInternalError: the receive failed (its size or dtype disagreed with the send; a
            peer failed; the job failed).
    """
    core, finish = _start_recv(src, tag, out, shape, dtype)
    value = finish(core.wait())
    if core.tracked and torch.is_grad_enabled() and value.is_floating_point():
        spec = kit.P2PSpec("recv", core.peer, core.tag, core.seq)  # type: ignore[arg-type]
        return _Recv.apply(spec, torch.zeros((), requires_grad=True), value)  # type: ignore
    return value


# MegEngine's names ------------------------------------------------------------------------------
def remote_send(tensor: torch.Tensor, dest_rank: int) -> torch.Tensor:
    """MegEngine's ``F.distributed.remote_send(inp, dest_rank)``: :func:`send` with tag 0.

    Returns the token (MegEngine returns None and its ``GradManager`` remembers the send):
    ``token.backward()`` is MegEngine's ``gm.backward([])`` on a rank without a loss, and
    ``(loss + token).backward()`` on a rank with one. The receiver learns the shape and dtype
    from the message. A ``remote_send`` pairs with the next ``remote_recv`` (or ``recv(src)``) of
    ``dest_rank``, in order.

    Raises:
        TensorError / HorovodInternalError: as :func:`send`.
    """
    return send(tensor, dest_rank, 0)


def remote_recv(src_rank: int, shape: Any = None, dtype: Any = None,
                device: Any = None) -> torch.Tensor:
    """MegEngine's ``F.distributed.remote_recv(src_rank, shape, dtype, device)``: the next
    tensor :func:`remote_send` sent from ``src_rank``, differentiable (its gradient goes back to
    ``src_rank`` in the backward pass).

    ``shape`` and ``dtype`` may be left out: they travel with the message (as in MegEngine 1.x,
    which broadcasts them). When given, they are checked against what was sent; ``dtype`` may be
    a ``torch.dtype``, a numpy dtype or a name (``"float32"``, what MegEngine's own example
    sends through ``user_set``, or ``str(tensor.dtype)``). ``device`` moves the result there
    (differentiably).

    Raises:
        TensorError: ``dtype`` names no dtype ringflow moves.
        HorovodInternalError: the shape or dtype disagreed with the send (MismatchError, on
            both ranks), a peer failed, or the job failed.
    """
    if shape is not None:
        shape = tuple(int(d) for d in shape)
    value = recv(src_rank, 0, shape=shape, dtype=_torch_dtype(dtype))
    return value if device is None else value.to(device)


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(named, torch.dtype):
        return named
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
    except (TypeError, ValueError) as exc:
        raise TensorError(f"remote_recv: dtype {dtype!r} names no dtype ringflow moves ({exc}); "
                          "pass a torch.dtype, a numpy dtype or its name") from exc
