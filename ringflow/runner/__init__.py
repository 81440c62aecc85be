"""``ringflow-run``: the launcher (DESIGN.md section 5).

:mod:`.hosts` parses host lists and host files and assigns ranks; :mod:`.launch` starts and
supervises the workers of one job (:func:`run_job`); :mod:`.ssh` and :mod:`.remote` start workers
on other hosts; :mod:`.netif` picks the store's address; :mod:`.pyrun` is ``ringflow.run`` and
``ringflow.launcher``, whose MegEngine-style launch across machines (the same program on each)
is :mod:`.machines`; :mod:`.cli` is the command line, :mod:`.dialects` the horovodrun / torchrun
/ mpirun spellings it answers, :mod:`.configfile` its ``--config-file`` and :mod:`.check_build` its
``--check-build``.
"""

from __future__ import annotations

from .hosts import Host, WorkerSpec, assign_ranks, parse_hostfile, parse_hosts
from .launch import JobResult, LocalJob, WorkerExit, run_job, start_store
from .ssh import SshOptions

__all__ = [
    "Host",
    "JobResult",
    "LocalJob",
    "SshOptions",
    "WorkerExit",
    "WorkerSpec",
    "assign_ranks",
    "parse_hostfile",
    "parse_hosts",
    "run_job",
    "start_store",
]
