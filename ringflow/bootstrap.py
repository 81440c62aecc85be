"""How a process of a job finds the rendezvous store, whichever launcher started it.

``ringflow-run`` (and ``ringflow.run``) hand every worker ``RINGFLOW_RENDEZVOUS_ADDR/PORT`` and
the job secret on an inherited descriptor; :func:`connect_store` uses them.
"""

from __future__ import annotations

from typing import Any

from . import rendezvous
from .errors import ConfigError
from .topology import RankInfo

__all__ = ["connect_store"]


def connect_store(info: RankInfo, timeout: float) -> Any:
    """The job's rendezvous store for a process of a multi-process job.

    Raises:
        ConfigError: the environment names no way to reach the other ranks.
    """
    if info.detector == "ringflow":
        return rendezvous.connect(timeout=timeout)
    raise ConfigError(
        f"this process was started by {info.detector} as rank {info.rank} of {info.size}, "
        "but no ringflow rendezvous is configured; start the job with ringflow-run"
    )
