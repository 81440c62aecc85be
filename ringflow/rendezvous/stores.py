"""The rendezvous key-value :class:`Store`, its semantics, and the in-process and file stores.

A store maps string keys to byte values. Ranks publish what others need (listening addresses, NCCL
unique ids) with ``set``, block on what they need with ``get`` / ``wait``, and count arrivals with
``add``. Three implementations share the semantics below:

* :class:`MemoryStore` -- one process, ranks as threads (tests, ``ringflow.testing.run_ranks``).
* :class:`FileStore` -- a directory shared by the processes of one host.
* :class:`TCPStore` -- a client of a :class:`StoreServer` (started by ``ringflow-run``), which holds
  the data; every connection proves knowledge of the per-job secret first.

Semantics (every store):

* keys are non-empty ``str`` of at most 4 KiB in UTF-8; values are bytes of at most 64 MiB.
* ``get`` / ``wait`` block until the key(s) exist; past the timeout (``None`` = the store's
  default) they raise :class:`RingflowTimeoutError` naming the missing keys. A ``set`` releases a
  waiter within milliseconds (a Condition in memory and on the server; the file store polls at
  1, 2, 4, 5, 5, ... ms).
* ``add`` treats a missing key as 0 and stores the sum as decimal ASCII (``b"3"``), so ``get`` of a
  counter returns its text; a value that is not an integer raises :class:`ConfigError`. Counters
  are signed 64-bit. ``add`` is atomic: in memory and on the server under one lock, in a file store
  under ``fcntl.flock`` on ``<dir>/.lock`` (across processes).
* ``close`` wakes waiters of the same store with :class:`ShutdownError`; later calls raise it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from ..errors import (
    ConfigError,
    PeerError,
    RingflowTimeoutError,
    ShutdownError,
)
from ..polling import polls

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 * 1024 * 1024
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_NAMES_SHOWN = 10
#: The file store's polling interval grows from 1 ms to this, so a set is seen within ~5 ms
#: while an idle waiter costs ~200 stat calls a second.
_POLL_MAX_S = 0.005
#: How often a server thread waiting for a key checks that its client is still connected.
_PEER_CHECK_S = 0.5




@runtime_checkable
class Store(Protocol):
    """A key-value store shared by the ranks of a job."""

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any value, and wake its waiters."""

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it exists. Raises RingflowTimeoutError."""

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Return when every key exists. Raises RingflowTimeoutError listing the missing keys."""

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing = 0); return the new value."""

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""

    def close(self) -> None:
        """Release the store's resources; idempotent."""


_C = TypeVar("_C", bound="_Base")


class _Base:
    """The default timeout (``None`` resolves to it) and ``with``-statement support."""

    def __init__(self, timeout: float) -> None:
        self._timeout = _check_timeout(timeout)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _resolve(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else _check_timeout(timeout)


class MemoryStore(_Base):
    """A thread-safe store inside one process."""

    def __init__(self, timeout: float = 30.0) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        key, value = _check_key(key), _check_value(key, value)
        with self._cond:
            self._check_open()
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._get(key, timeout)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self._wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        key, amount = _check_key(key), _check_amount(key, amount)
        with self._cond:
            self._check_open()
            total = _counter(key, self._data.get(key, b"0"), amount)
            self._data[key] = str(total).encode()
            self._cond.notify_all()
            return total

    def delete(self, key: str) -> bool:
        key = _check_key(key)
        with self._cond:
            self._check_open()
            return self._data.pop(key, None) is not None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _get(
        self, key: str, timeout: float | None, abandoned: Callable[[], bool] | None = None
    ) -> bytes:
        key = _check_key(key)
        with self._cond:
            self._wait_locked([key], self._resolve(timeout), abandoned)
            return self._data[key]

    def _wait(
        self,
        keys: Sequence[str],
        timeout: float | None,
        abandoned: Callable[[], bool] | None = None,
    ) -> None:
        keys = _check_keys(keys)
        with self._cond:
            self._wait_locked(keys, self._resolve(timeout), abandoned)

    def _wait_locked(
        self, keys: list[str], timeout: float, abandoned: Callable[[], bool] | None
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingflowTimeoutError(_not_set(missing, len(keys), timeout))
            if abandoned is not None:
                if abandoned():
                    raise PeerError("the client disconnected while waiting for a key")
                left = min(left, _PEER_CHECK_S)
            self._cond.wait(left)

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError("the rendezvous store was closed; create a new one")


class FileStore(_Base):
    """A store in a directory shared by the processes of one host (created with mode 0o700).

    Each key is one file, written to a temporary name and renamed into place, so readers see the
    old value or the new one, never a partial write. ``add`` needs ``fcntl`` (POSIX).
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        super().__init__(timeout)
        self.path = os.fspath(path)
        self._closed = False
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            mode = os.stat(self.path).st_mode
        except OSError as exc:
            raise ConfigError(
                f"cannot create the file store directory {self.path!r}: {exc}; "
                "pass a writable path on a local file system"
            ) from exc
        if os.name == "posix" and mode & 0o022:
            log.warning(
                "file store directory %s is writable by other users (mode %o); "
                "use a private directory (mode 0o700)", self.path, mode & 0o777,
            )

    def set(self, key: str, value: bytes) -> None:
        key, value = _check_key(key), _check_value(key, value)
        self._check_open()
        self._write(self._file(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        key = _check_key(key)
        self._check_open()
        wait_s = self._resolve(timeout)
        name = self._file(key)
        for _ in polls(wait_s, 1e-3, _POLL_MAX_S):
            with contextlib.suppress(FileNotFoundError):
                return self._read(name)
            self._check_open()
        raise RingflowTimeoutError(_not_set([key], 1, wait_s))

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        missing = _check_keys(keys)
        self._check_open()
        wait_s = self._resolve(timeout)
        for _ in polls(wait_s, 1e-3, _POLL_MAX_S):
            missing = [k for k in missing if not os.path.exists(self._file(k))]
            if not missing:
                return
            self._check_open()
        raise RingflowTimeoutError(_not_set(missing, len(keys), wait_s))

    def add(self, key: str, amount: int) -> int:
        key, amount = _check_key(key), _check_amount(key, amount)
        self._check_open()
        name = self._file(key)
        with self._locked():
            try:
                old = self._read(name)
            except FileNotFoundError:
                old = b"0"
            total = _counter(key, old, amount)
            self._write(name, str(total).encode())
        return total

    def delete(self, key: str) -> bool:
        key = _check_key(key)
        self._check_open()
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        self._closed = True

    def _file(self, key: str) -> str:
        # Hex keeps any key a valid, case-insensitive-safe file name; long keys are hashed to fit
        # the usual 255-byte name limit. The prefixes keep the two forms and ".tmp-" apart.
        raw = key.encode()
        name = "k" + raw.hex() if len(raw) <= 100 else "h" + hashlib.sha256(raw).hexdigest()
        return os.path.join(self.path, name)

    def _read(self, name: str) -> bytes:
        with open(name, "rb") as f:
            return f.read()

    def _write(self, name: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError as exc:
            raise ConfigError(
                "FileStore.add needs fcntl, which this platform lacks; use a TCPStore "
                "(ringflow-run starts its server) or a MemoryStore"
            ) from exc
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError(f"the file store at {self.path} was closed; create a new one")


def _not_set(missing: list[str], total: int, timeout: float) -> str:
    names = ", ".join(repr(k) for k in missing[:_NAMES_SHOWN])
    if len(missing) > _NAMES_SHOWN:
        names += f" and {len(missing) - _NAMES_SHOWN} more"
    what = (
        f"store key {names} was not set" if total == 1
        else f"{len(missing)} of {total} store keys were not set (missing: {names})"
    )
    return (
        f"{what} within {timeout:g} s; the process that sets it may have failed (see its log) "
        "or needs longer: raise RINGFLOW_TIMEOUT_S"
    )


def _counter(key: str, old: bytes, amount: int) -> int:
    try:
        total = int(old) + amount
    except ValueError:
        raise ConfigError(
            f"store key {key!r} holds {old[:32]!r}, which is not an integer counter; add() works "
            "on keys that are missing or hold a decimal integer (as written by add())"
        ) from None
    if not _I64_MIN <= total <= _I64_MAX:
        raise ConfigError(f"add({key!r}, {amount}) would leave the signed 64-bit range")
    return total


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"a store key must be a non-empty str, not {key!r}")
    try:
        size = len(key.encode())
    except UnicodeEncodeError as exc:
        raise ConfigError(f"store key {key!r} cannot be encoded as UTF-8") from exc
    if size > MAX_KEY_BYTES:
        raise ConfigError(
            f"store key {key[:40]!r}... is {size} bytes of UTF-8; the limit is {MAX_KEY_BYTES}"
        )
    return key


def _check_keys(keys: object) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ConfigError(f"wait() takes a list of keys, not {keys!r}; write wait([key])")
    return [_check_key(k) for k in keys]


def _check_value(key: str, value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ConfigError(
            f"the value for store key {key!r} must be bytes, not {type(value).__name__}; "
            "encode it first"
        )
    value = bytes(value)
    if len(value) > MAX_VALUE_BYTES:
        raise ConfigError(
            f"the value for store key {key!r} is {len(value)} bytes; the limit is "
            f"{MAX_VALUE_BYTES} (a store carries addresses and ids, not tensors)"
        )
    return value


def _check_amount(key: str, amount: object) -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ConfigError(f"add({key!r}, {amount!r}): the amount must be an int")
    if not _I64_MIN <= amount <= _I64_MAX:
        raise ConfigError(f"add({key!r}, {amount}): the amount exceeds the signed 64-bit range")
    return amount


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ConfigError(f"a store timeout must be a number of seconds, not {timeout!r}")
    if not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError(f"the store timeout {timeout!r} must be a finite number of seconds >= 0")
    return float(timeout)


