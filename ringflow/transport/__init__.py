"""Byte movement between ranks: the Protocols (:mod:`.base`) and a registry of backends.

Backends are created through :func:`create`, which imports the backend module only when it is
asked for, so ``import ringflow`` never imports mpi4py or cupy. Which backend a job uses, and
which allreduce implementations run over it, is decided in :mod:`ringflow.backends`; nothing in
this package imports an algorithm.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..errors import ConfigError
from .base import (
    MAX_CTRL_BYTES,
    ControlChannel,
    Link,
    NativeAllreduce,
    Subset,
    Transport,
    Work,
    recv,
    send,
    sendrecv,
)

__all__ = ["MAX_CTRL_BYTES", "ControlChannel", "Link", "NativeAllreduce", "Subset", "Transport",
           "Work", "available", "create", "recv", "register", "send", "sendrecv"]


_REGISTRY: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, factory: str) -> None:
    """Register ``module.factory(rank, size, store, config, **kw) -> Transport`` under ``name``.

    Raises:
        ConfigError: ``name`` is registered already, for another factory.
    """
    if _REGISTRY.get(name, (module, factory)) != (module, factory):
        raise ConfigError(f"transport {name!r} is already registered as "
                          f"{':'.join(_REGISTRY[name])}; pick another name")
    _REGISTRY[name] = (module, factory)


def available() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str, *args: object, **kwargs: object) -> Transport:
    """Create the transport registered as ``name``, importing its module now."""
    try:
        module, factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown transport {name!r}; registered transports: {available()}"
        ) from None
    fn: Callable[..., Transport] = getattr(importlib.import_module(module), factory)
    return fn(*args, **kwargs)


register("loopback", "ringflow.transport.loopback", "create")
register("tcp", "ringflow.transport.tcp", "create")
register("mpi", "ringflow.transport.mpi", "create")
