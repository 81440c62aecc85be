"""The job's key-value client, MegEngine's ``dist.get_client()``: :class:`Client`.

Every rank of a job reaches the same rendezvous store, whichever launcher started it
(:mod:`ringflow.bootstrap`); :func:`ringflow.get_client` hands it out for small messages between
ranks (shapes, dtypes, flags, metrics). Values are pickled, so they must be picklable, and a
value is unpickled by whoever reads it: on an open rendezvous (torchrun, ``env://``, Slurm
without a secret file) anyone who can reach the store could plant one, as with torch.distributed's
``Store``. Keys live for the whole job (they survive ``shutdown()`` + ``init()``), under their
own ``user/`` prefix.
"""

from __future__ import annotations

import pickle
from typing import Any

from .rendezvous import MemoryStore

__all__ = ["Client"]


class Client:
    """``user_set``/``user_get`` on the job's store; thread-safe."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def user_set(self, key: str, value: Any) -> None:
        """Store ``value`` (any picklable object) under ``key``, replacing any value."""
        self._store.set(f"user/{key}", pickle.dumps(value))

    def user_get(self, key: str, timeout: float | None = None) -> Any:
        """The value of ``key``, waiting until some rank has set it.

        Raises:
            RingflowTimeoutError: nobody set it within ``timeout`` seconds (default: the job's
                ``RINGFLOW_TIMEOUT_S``).
        """
        return pickle.loads(self._store.get(f"user/{key}", timeout))


def local_client(timeout: float) -> Client:
    """The client of a job of one process: a store in this process."""
    return Client(MemoryStore(timeout))
