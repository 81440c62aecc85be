"""ringflow's fallback log handler: every level, with the rank, once whoever configured logging."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest

from ringflow import logs, runtime
from ringflow.testing import run_engines

pytestmark = pytest.mark.timeout(30)


class _Err:
    def __init__(self, capsys) -> None:
        self._capsys = capsys

    def getvalue(self) -> str:
        return str(self._capsys.readouterr().err)


@pytest.fixture
def isolated(monkeypatch, capsys):
    """A logger below ``ringflow`` that does not propagate to the root (where pytest's capture
    handler sits), so the fallback handler on ``ringflow`` is alone in its chain."""
    ringflow_logger = logging.getLogger("ringflow")
    monkeypatch.setattr(runtime, "_info", None)  # an earlier test's job, shut down, is no rank's
    monkeypatch.setattr(ringflow_logger, "propagate", False)
    monkeypatch.setattr(ringflow_logger, "level", logging.DEBUG)
    return logging.getLogger("ringflow.test_logs"), _Err(capsys)


@contextlib.contextmanager
def alone():
    """pytest 9.2 also hangs its capture handlers on loggers that do not propagate (``ringflow``
    in ``isolated``): take them off while the test logs, so that the fallback handler is alone."""
    logger = logging.getLogger("ringflow")
    others = [h for h in logger.handlers if not isinstance(h, logs.FallbackHandler)]
    for h in others:
        logger.removeHandler(h)
    try:
        yield
    finally:
        for h in others:
            logger.addHandler(h)


def test_debug_records_are_written_with_the_rank_and_time(isolated, monkeypatch) -> None:
    log, err = isolated
    monkeypatch.setenv("RINGFLOW_RANK", "3")
    monkeypatch.setenv("RINGFLOW_SIZE", "4")
    with alone():
        log.debug("hello %s", "there")
    assert re.fullmatch(r"\[ringflow rank 3/4 \d\d:\d\d:\d\d\.\d{3}\] DEBUG "
                        r"ringflow.test_logs: hello there\n", err.getvalue()), err.getvalue()


def test_a_handler_of_the_program_takes_the_record_instead(isolated) -> None:
    log, err = isolated
    mine = io.StringIO()
    handler = logging.StreamHandler(mine)
    handler.addFilter(logs.RankFilter())
    handler.setFormatter(logging.Formatter("%(ringflow_rank)s|%(message)s"))
    logging.getLogger("ringflow").addHandler(handler)
    try:
        log.info("once")
    finally:
        logging.getLogger("ringflow").removeHandler(handler)
    assert err.getvalue() == "" and mine.getvalue().endswith("|once\n")


def test_each_thread_rank_of_run_engines_logs_as_itself(isolated) -> None:
    log, err = isolated

    def body(rank, rf):
        log.warning("from the body")

    with alone():
        run_engines(2, body)
    found = sorted(re.findall(r"\[ringflow (rank \d/2) [\d:.]+\] WARNING ringflow.test_logs: "
                              r"from the body", err.getvalue()))
    assert found == ["rank 0/2", "rank 1/2"], err.getvalue()
