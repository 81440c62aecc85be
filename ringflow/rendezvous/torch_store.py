"""ringflow's :class:`~ringflow.rendezvous.Store` over a ``torch.distributed`` store.

Jobs started under torch's own contract (torchrun, ``env://``, ``tcp://``, or a process where
``torch.distributed`` is already initialised) meet in torch's store rather than in one of
ringflow's: torchrun's agent already holds ``MASTER_PORT``, and a script that also calls
``torch.distributed.init_process_group()`` must be able to share the port ringflow used.
:func:`open_url` makes that store the way ``torch.distributed`` itself does (a client of
torchrun's agent store, or rank 0 serving a multi-tenant ``TCPStore`` that a later
``init_process_group`` with the same address shares), with one difference: rank 0 binds the
server to the address the store is named by, not to every interface.

These stores are as protected as torch.distributed's: anyone who can reach the port can read and
write every key, including the data-plane secret ringflow's rank 0 publishes there. torch is
imported only here, and only on these paths.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, PeerError, RingflowTimeoutError

__all__ = ["TorchStore", "address_towards", "default_store", "open_url"]

# Servers this process holds for torch-contract stores, by (host, port): rank 0's must outlive
# ringflow's engine (a later init() and torch.distributed may share it), as torch's does.
_held: dict[tuple[str, int], Any] = {}


def address_towards(host: str) -> str:
    """This process's address on the interface that routes to ``host`` (127.0.0.1 for a local
    name). A UDP socket's connect() only selects a route: nothing is sent."""
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return "127.0.0.1"
    if addr.startswith("127.") or addr == "0.0.0.0":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((addr, 9))
        except OSError:
            return "127.0.0.1"
        return str(probe.getsockname()[0])


class TorchStore:
    """The Store protocol on a torch c10d store, every key under ``prefix``."""

    def __init__(self, store: Any, prefix: str, timeout: float, host: str = "127.0.0.1") -> None:
        self._store = store
        self._prefix = prefix
        self._timeout = timeout
        self._host = host

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self.wait([key], timeout)
        return bytes(self._store.get(self._prefix + key))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout
        try:
            self._store.wait([self._prefix + k for k in keys],
                             datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:
            raise _translated(exc, f"waiting for {list(keys)[:10]} in torch's store") from exc

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(self._prefix + key, amount))

    def delete(self, key: str) -> bool:
        return bool(self._store.delete_key(self._prefix + key))

    def close(self) -> None:
        """The store belongs to torch (or to this process's held servers); nothing to release."""

    def local_address(self) -> str:
        return address_towards(self._host)


def _translated(exc: RuntimeError, what: str) -> Exception:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "timeout" in text.lower() or "timed out" in text.lower():
        return RingflowTimeoutError(f"{what}: {text}")
    return PeerError(f"{what}: {text}")


def default_store(prefix: str, timeout: float) -> TorchStore:
    """The store of torch.distributed's default process group (this process initialised it)."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    return TorchStore(store, prefix, timeout, _master_of(store) or "127.0.0.1")


def _master_of(store: Any) -> str:
    """The host of the TCPStore under torch's PrefixStore wrappers, if there is one."""
    with contextlib.suppress(AttributeError, RuntimeError):
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return str(getattr(store, "host", ""))
    return ""


def open_url(host: str, port: int, rank: int, size: int, agent_store: bool, prefix: str,
             timeout: float) -> TorchStore:
    """The torch TCPStore at ``host:port`` as ``torch.distributed`` would make it for ``env://``
    or ``tcp://``: a client of torchrun's agent store when ``agent_store``; else rank 0 serves it
    (multi-tenant, bound to ``host``'s address) and the others are clients.

    Raises:
        ConfigError: rank 0 cannot listen on ``host:port``.
        PeerError / RingflowTimeoutError: the store could not be reached within ``timeout``.
    """
    import torch.distributed as dist

    delta = datetime.timedelta(seconds=timeout)
    where = f"torch's store at {host}:{port}"
    try:
        if agent_store or rank != 0:
            store = dist.TCPStore(host, port, None, False, delta)
        elif (host, port) in _held:
            store = _held[host, port]
        else:
            store = dist.TCPStore(host, port, None, True, delta, multi_tenant=True,
                                  master_listen_fd=_listener(host, port).detach())
            _held[host, port] = store
    except ConfigError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise _translated(exc, f"connecting to {where} (rank {rank} of {size})") from exc
    return TorchStore(store, prefix, timeout, host)


def _listener(host: str, port: int) -> socket.socket:
    try:
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError) as exc:
        raise ConfigError(f"rank 0 cannot resolve the store host {host!r}: {exc}") from exc
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"rank 0 cannot listen on {host}:{port} ({addr}): {exc}; rank 0 must run on that "
            "host and the port must be free (MASTER_ADDR / MASTER_PORT)"
        ) from exc
    return sock
