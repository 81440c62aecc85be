"""The per-job secret as ringflow-run hands it to a worker: an inherited descriptor or a file."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping

from ..errors import (
    ConfigError,
)

log = logging.getLogger(__name__)

_SECRETS: dict[tuple[str, str], bytes] = {}
_SECRETS_LOCK = threading.Lock()
_MAX_SECRET_TEXT = 64 * 1024


def read_secret(environ: Mapping[str, str] | None = None) -> bytes:
    """The per-job secret, from ``RINGFLOW_SECRET_FD`` or else ``RINGFLOW_SECRET_FILE``.

    Either holds the secret as hex text with an optional trailing newline; a descriptor is read to
    its end (the writer must close its side) and then closed. The result is cached per source (a
    descriptor can be read only once). Raises ConfigError if neither variable is set or the source
    cannot be read or parsed.
    """
    env = os.environ if environ is None else environ
    for var in ("RINGFLOW_SECRET_FD", "RINGFLOW_SECRET_FILE"):
        source = env.get(var, "")
        if source:
            break
    else:
        raise ConfigError(
            "no job secret: neither RINGFLOW_SECRET_FD nor RINGFLOW_SECRET_FILE is set; start "
            "this process with ringflow-run or ringflow.run, which pass the secret to each "
            "worker, or set one of them to a descriptor / file holding the secret in hex"
        )
    with _SECRETS_LOCK:
        if (var, source) not in _SECRETS:
            text = _read_fd(source) if var == "RINGFLOW_SECRET_FD" else _read_file(source)
            _SECRETS[var, source] = _parse_secret(var, source, text)
        return _SECRETS[var, source]



def _read_fd(source: str) -> bytes:
    try:
        fd = int(source)
    except ValueError:
        raise ConfigError(
            f"RINGFLOW_SECRET_FD={source!r} is not a file descriptor number"
        ) from None
    chunks: list[bytes] = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
            if sum(map(len, chunks)) > _MAX_SECRET_TEXT:
                break
    except OSError as exc:
        raise ConfigError(
            f"RINGFLOW_SECRET_FD={source}: cannot read descriptor {fd}: {exc}; it must be "
            "inherited from ringflow-run or ringflow.run (and is readable only once)"
        ) from exc
    if fd > 2:
        with contextlib.suppress(OSError):
            os.close(fd)
    return b"".join(chunks)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if os.name == "posix" and os.fstat(f.fileno()).st_mode & 0o077:
                log.warning("secret file %s is readable by other users; make it mode 0o600", path)
            return f.read(_MAX_SECRET_TEXT + 1)
    except OSError as exc:
        raise ConfigError(f"RINGFLOW_SECRET_FILE={path!r} cannot be read: {exc}") from exc


def _parse_secret(var: str, source: str, text: bytes) -> bytes:
    try:
        secret = bytes.fromhex(text.strip().decode("ascii"))
    except ValueError:  # UnicodeDecodeError is a ValueError
        secret = b""
    if not secret:
        # Never echo the content: it may be a secret in the wrong format.
        raise ConfigError(
            f"{var}={source!r} does not hold a secret as hex text ({len(text)} bytes read); "
            "it must be written by ringflow-run or ringflow.run"
        )
    return secret


