"""``ringflow-run``: the launcher (DESIGN.md section 5).

:mod:`.hosts` parses host lists and assigns ranks; :mod:`.launch` starts and supervises the workers
of one job (:func:`run_job`, also the Python entry point); :mod:`.cli` is the command line.
"""

from __future__ import annotations

from .hosts import Host, WorkerSpec, assign_ranks, parse_hosts
from .launch import JobResult, LocalJob, WorkerExit, run_job

__all__ = [
    "Host",
    "JobResult",
    "LocalJob",
    "WorkerExit",
    "WorkerSpec",
    "assign_ranks",
    "parse_hosts",
    "run_job",
]
