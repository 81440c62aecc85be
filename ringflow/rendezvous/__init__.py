"""The rendezvous key-value store: how the ranks of a job find each other.

* :mod:`.stores`: the :class:`Store` protocol and its semantics, :class:`MemoryStore` (ranks as
  threads) and :class:`FileStore` (a directory shared by the processes of one host);
* :mod:`.tcp`: :class:`StoreServer` (started by ``ringflow-run``) and its :class:`TCPStore`
  clients, authenticated with the job secret before anything is parsed; :func:`connect`;
* :mod:`.secret`: :func:`read_secret`, the job secret as the launcher hands it to a worker.
"""

from __future__ import annotations

from .secret import read_secret
from .stores import MAX_KEY_BYTES, MAX_VALUE_BYTES, FileStore, MemoryStore, Store
from .tcp import StoreServer, TCPStore, connect

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "FileStore",
    "MemoryStore",
    "Store",
    "StoreServer",
    "TCPStore",
    "connect",
    "read_secret",
]
