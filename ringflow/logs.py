"""ringflow's log output: every record of the ``ringflow`` loggers, with the rank and the time.

ringflow logs through ``logging.getLogger(__name__)`` loggers below ``ringflow``, and
``init()`` sets the level of the ``ringflow`` logger from ``RINGFLOW_LOG_LEVEL``
(``ringflow-run --log-level``, ``HOROVOD_LOG_LEVEL``; default ``warning``). Python prints a record
that no handler takes through ``logging.lastResort``, which drops everything below WARNING and
says nothing of the rank, so ``--log-level debug`` used to print nothing. ``import ringflow``
therefore attaches one :class:`FallbackHandler` to the ``ringflow`` logger, and to no other one.
It writes a record to ``sys.stderr`` (the one of the moment, as ``lastResort`` does) as::

    [ringflow rank 1/4 12:34:56.789] DEBUG ringflow.engine: the message

**only when no other handler would**: it walks the chain that :meth:`logging.Logger.callHandlers`
walks for that record (the record's logger up to the root, stopping where ``propagate`` is False)
and steps aside when it finds any handler but itself. So a program that configures logging
(``logging.basicConfig()``, a handler on ``ringflow``, pytest's capture) gets each record once,
through its own handlers and formats; a program that does not still sees every level it asked
for. Add :class:`RankFilter` to a handler of your own to use ``%(ringflow_rank)s`` in its format.

The prefix: ``rank r/n`` of the running job (the thread's rank for
:func:`ringflow.testing.run_engines`), else the launcher's ``RINGFLOW_RANK``/``RINGFLOW_SIZE``
before ``init()``, else the process's label (``ringflow-run`` in the launcher, which honours
``--log-level`` for its own records too), else just ``ringflow``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

__all__ = ["FallbackHandler", "RankFilter", "install", "label", "rank_label", "set_label"]

_label = ""


def label() -> str:
    """The name :func:`set_label` gave this process, or ``""``."""
    return _label


def set_label(label: str) -> None:
    """Name this process in the prefix when it is no rank (``ringflow-run``)."""
    global _label
    _label = label


def rank_label() -> str:
    """``rank r/n`` of the job this thread acts for, or ``""``."""
    try:
        from . import runtime

        _, info, _ = runtime._state()
    except Exception:  # a record logged while ringflow itself is being imported
        info = None
    if info is not None:
        return f"rank {info.rank}/{info.size}"
    rank, size = os.environ.get("RINGFLOW_RANK"), os.environ.get("RINGFLOW_SIZE")
    if rank is not None:
        return f"rank {rank}/{size}" if size else f"rank {rank}"
    return ""


class RankFilter(logging.Filter):
    """Sets ``record.ringflow_rank`` (``rank 1/4``, or ``""``) for a handler's format."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.ringflow_rank = rank_label()
        return True


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        who = _label or " ".join(filter(None, ("ringflow", rank_label())))
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = (f"[{who} {stamp}.{int(record.msecs):03d}] {record.levelname} {record.name}: "
                f"{record.getMessage()}")
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        return text


class FallbackHandler(logging.Handler):
    """Writes ringflow's records to ``sys.stderr`` where no other handler takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_Formatter())

    def handle(self, record: logging.LogRecord) -> bool:
        if _handled_elsewhere(record, self):
            return False
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            if stream is None:  # pythonw
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _handled_elsewhere(record: logging.LogRecord, me: logging.Handler) -> bool:
    """Whether a handler other than ``me`` gets ``record`` (Logger.callHandlers' walk)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(h is not me for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent  # type: ignore[assignment]
    return False


def install() -> None:
    """Attach the :class:`FallbackHandler` to the ``ringflow`` logger (once)."""
    logger = logging.getLogger("ringflow")
    if not any(isinstance(h, FallbackHandler) for h in logger.handlers):
        logger.addHandler(FallbackHandler())
