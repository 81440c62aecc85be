"""Byte movement between ranks: the :class:`Transport` protocol and a registry of backends.

A transport connects the ``size`` ranks of one job and moves *exact-size* byte buffers between
pairs of them. Messages between one pair arrive in the order they were sent, and a receive must be
posted with the size the sender sends (a different size is a ProtocolError, never a silent
truncation). Algorithms (``ringflow.algorithms``) are written once over this interface.

Backends are created through :func:`create`, which imports the backend module only when it is
asked for, so ``import ringflow`` never imports mpi4py or cupy.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError

__all__ = ["Subset", "Transport", "Work", "available", "connect", "create", "register"]

_log = logging.getLogger(__name__)


class Work(Protocol):
    """A pending send or receive."""

    def wait(self) -> None:
        """Block until done. Raises PeerError / RingflowTimeoutError / ProtocolError."""


@runtime_checkable
class Transport(Protocol):
    rank: int
    size: int

    def isend(self, buf: memoryview, dst: int) -> Work:
        """Start sending ``buf``; it must stay unchanged until ``wait()`` returns."""

    def irecv(self, buf: memoryview, src: int) -> Work:
        """Start receiving exactly ``buf.nbytes`` bytes from ``src`` into ``buf``."""

    def close(self) -> None:
        """Release sockets/threads; pending and later operations raise PeerError."""


def send(t: Transport, buf: memoryview, dst: int) -> None:
    t.isend(buf, dst).wait()


def recv(t: Transport, buf: memoryview, src: int) -> None:
    t.irecv(buf, src).wait()


def sendrecv(t: Transport, sbuf: memoryview, dst: int, rbuf: memoryview, src: int) -> None:
    """Send to ``dst`` and receive from ``src`` at the same time (no deadlock in a ring)."""
    r = t.irecv(rbuf, src)
    s = t.isend(sbuf, dst)
    r.wait()
    s.wait()


class Subset:
    """The ranks ``members`` (global ranks, sorted) of ``base`` seen as their own transport.

    Used for process sets: algorithms see ranks 0..len(members)-1. Only the members may use it.
    """

    def __init__(self, base: Transport, members: Sequence[int]) -> None:
        self.base = base
        self.members = list(members)
        self.rank = self.members.index(base.rank)
        self.size = len(self.members)

    def isend(self, buf: memoryview, dst: int) -> Work:
        return self.base.isend(buf, self.members[dst])

    def irecv(self, buf: memoryview, src: int) -> Work:
        return self.base.irecv(buf, self.members[src])

    def close(self) -> None:
        """The base transport is owned by someone else."""


_REGISTRY: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, factory: str) -> None:
    """Register ``module.factory(rank, size, store, config, **kw) -> Transport`` under ``name``."""
    _REGISTRY[name] = (module, factory)


def available() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str, *args: object, **kwargs: object) -> Transport:
    """Create the transport registered as ``name``, importing its module now."""
    try:
        module, factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown transport {name!r}; set RINGFLOW_TRANSPORT to one of {available()}"
        ) from None
    fn: Callable[..., Transport] = getattr(importlib.import_module(module), factory)
    return fn(*args, **kwargs)


def connect(info: Any, store: Any, config: Any, prefix: str) -> Transport:
    """The job's transport, chosen alike on every rank from the layout they all publish.

    ``config.transport == "auto"``: MPI when the job was started by mpirun (detector ``openmpi``
    or ``pmi``) and every rank can use mpi4py with MPI_THREAD_MULTIPLE (each rank publishes why
    it cannot, so that all choose alike); else shared memory when every rank is on one host;
    shared memory within hosts plus rings across them (hierarchical) when every host has the same
    number of ranks (more than one), numbered host by host; plain TCP otherwise. Any other value
    names a registered transport and is used as is.
    """
    name = config.transport
    kwargs: dict[str, Any] = {}
    if name == "auto" and getattr(info, "detector", "") in ("openmpi", "pmi"):
        from . import mpi

        store.set(f"{prefix}mpi/{info.rank}", (mpi.unusable_reason() or "ok").encode())
        why = [store.get(f"{prefix}mpi/{r}").decode() for r in range(info.size)]
        if all(w == "ok" for w in why):
            name = "mpi"
        else:
            _log.info("not using the mpi transport: %s", next(w for w in why if w != "ok"))
    if name == "auto":
        store.set(f"{prefix}layout/{info.rank}",
                  f"{info.cross_rank},{info.local_rank},{info.local_size}".encode())
        layout = [tuple(map(int, store.get(f"{prefix}layout/{r}").split(b",")))
                  for r in range(info.size)]
        local = layout[0][2]
        by_host = all(ls == local and r == cr * local + lr
                      for r, (cr, lr, ls) in enumerate(layout))
        from . import shm

        name = "shm" if by_host and local > 1 and shm.available() else "tcp"
        if name == "shm":
            kwargs["local_size"] = local
    return create(name, info.rank, info.size, store, config, prefix=prefix, **kwargs)


register("loopback", "ringflow.transport.loopback", "create")
register("tcp", "ringflow.transport.tcp", "create")
register("shm", "ringflow.transport.shm", "create")
register("mpi", "ringflow.transport.mpi", "create")
