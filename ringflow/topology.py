"""Where this process sits in the job: :class:`RankInfo` and :func:`detect`.

:func:`detect` reads the environment that started the process and tries, in order:

1. ``ringflow`` -- ``ringflow-run`` (``RINGFLOW_RANK`` is set): ``RINGFLOW_RANK, _SIZE,
   _LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE, _HOSTNAME`` (DESIGN.md section 5). Every
   value is given; nothing is derived.
2. ``openmpi`` -- ``mpirun`` of Open MPI (``OMPI_COMM_WORLD_RANK``): ``OMPI_COMM_WORLD_RANK, _SIZE,
   _LOCAL_RANK, _LOCAL_SIZE``.
3. ``pmi`` -- MPICH / Intel MPI under Hydra (``PMI_RANK``): ``PMI_RANK, PMI_SIZE``, and
   ``MPI_LOCALRANKID, MPI_LOCALNRANKS`` where Hydra sets them.
4. ``slurm`` -- ``srun`` (``SLURM_PROCID``): ``SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
   SLURM_NODEID, SLURM_NNODES`` and ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) for the local size.
   The ``SLURM_STEP_*`` variants win where present, since they describe the running step.
5. ``torchrun`` -- ``torch.distributed.run`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` all set):
   ``RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE``.
6. ``single`` -- none of the above: one process, ``RankInfo(0, 1, 0, 1, 0, 1, hostname)``.

Derived values. Open MPI, PMI and torchrun without ``GROUP_*`` give the local size but not the host
index. There ringflow assumes *homogeneous hosts with ranks assigned host by host* (Open MPI's and
Hydra's default ``--map-by slot``): ``cross_rank = rank // local_size`` and ``cross_size =
ceil(size / local_size)``. Under another mapping (``--map-by node``) the local values are still
right, but the cross values are not; launch with ``ringflow-run`` or Slurm for exact values. PMI
without ``MPI_LOCALRANKID`` is taken as one rank per host (``local_size = 1``), which is always
safe: it only forgoes shared memory between ranks of one host.

Binding. :func:`bind_to_cores` (``RINGFLOW_BIND_TO=core``, ``ringflow-run --bind-to core``) pins
each process to its slice of the CPUs it may use (:func:`cpu_share`), after the local values are
known. On a 2-core machine it turned the 2-rank 4 KiB allreduce loop from bimodal (0.14 or
0.35-0.50 ms for hundreds of ops at a time) into a steady 0.14 ms (benchmarks/RESULTS.md
section 5).

Validation. Every value must be a non-negative integer, ``size >= 1``, ``rank < size``,
``local_rank < local_size <= size`` and ``cross_rank < cross_size <= size``; otherwise
:class:`~ringflow.errors.ConfigError` names the variable, its value and what was expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping

from .errors import ConfigError

__all__ = ["DETECTORS", "RankInfo", "bind_to_cores", "cpu_share", "detect"]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """This process's place in the job; ``detector`` names the environment it came from."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    detector: str = "single"


_Env = Mapping[str, str]


def _int(env: _Env, name: str) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise ConfigError(
            f"{name} is not set, but the launcher that set its sibling variables always sets it; "
            "unset the stale launcher variables or start through that launcher"
        )
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; expected a rank or a count") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} is negative; expected a rank or a count >= 0")
    return value


def _first(env: _Env, *names: str) -> str:
    """The first of ``names`` that is set (the last one when none is, so errors name it)."""
    for name in names:
        if env.get(name, "").strip():
            return name
    return names[-1]


def _check(info: RankInfo, names: Mapping[str, str]) -> RankInfo:
    """Raise ConfigError naming the variable behind the first inconsistent field."""

    def fail(field: str, expected: str) -> None:
        value = getattr(info, field)
        var = names.get(field, f"the derived {field}")
        raise ConfigError(
            f"{var}={value} is inconsistent ({info.detector} environment): expected {expected}; "
            "check the launcher's -np / host list or unset stale variables"
        )

    if info.size < 1:
        fail("size", "a world size >= 1")
    if info.rank >= info.size:
        fail("rank", f"a rank below the world size {info.size}")
    if not 1 <= info.local_size <= info.size:
        fail("local_size", f"a local size between 1 and the world size {info.size}")
    if info.local_rank >= info.local_size:
        fail("local_rank", f"a local rank below the local size {info.local_size}")
    if not 1 <= info.cross_size <= info.size:
        fail("cross_size", f"a host count between 1 and the world size {info.size}")
    if info.cross_rank >= info.cross_size:
        fail("cross_rank", f"a host index below the host count {info.cross_size}")
    return info


def _homogeneous(
    detector: str, rank: int, size: int, local_rank: int, local_size: int, names: Mapping[str, str]
) -> RankInfo:
    # Check before dividing, so that local_size=0 is reported rather than dividing by it.
    _check(RankInfo(rank, size, local_rank, local_size, 0, 1, "", detector), names)
    info = RankInfo(
        rank, size, local_rank, local_size, rank // local_size, -(-size // local_size),
        socket.gethostname(), detector,
    )
    return _check(info, names)


def _ringflow(env: _Env) -> RankInfo:
    fields = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
    names = {f: f"RINGFLOW_{f.upper()}" for f in fields}
    values = [_int(env, names[f]) for f in fields]
    host = env.get("RINGFLOW_HOSTNAME") or socket.gethostname()
    return _check(RankInfo(*values, host, "ringflow"), names)  # type: ignore[arg-type]


def _openmpi(env: _Env) -> RankInfo:
    fields = ("rank", "size", "local_rank", "local_size")
    names = {f: f"OMPI_COMM_WORLD_{f.upper()}" for f in fields}
    vals = {f: _int(env, v) for f, v in names.items()}
    return _homogeneous("openmpi", **vals, names=names)


def _pmi(env: _Env) -> RankInfo:
    names = {"rank": "PMI_RANK", "size": "PMI_SIZE"}
    rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_rank, local_size = 0, 1
    if env.get("MPI_LOCALRANKID", "").strip() or env.get("MPI_LOCALNRANKS", "").strip():
        names.update(local_rank="MPI_LOCALRANKID", local_size="MPI_LOCALNRANKS")
        local_rank, local_size = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
    return _homogeneous("pmi", rank, size, local_rank, local_size, names)


def _expand_tasks_per_node(var: str, raw: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(
                f"{var}={raw!r} is not a Slurm task list; expected e.g. '2(x3),1'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm(env: _Env) -> RankInfo:
    names = {
        "rank": "SLURM_PROCID",
        "size": _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS", "SLURM_NTASKS"),
        "local_rank": "SLURM_LOCALID",
        "cross_rank": "SLURM_NODEID",
        "cross_size": _first(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    }
    vals = {f: _int(env, v) for f, v in names.items()}
    tasks_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    raw = env.get(tasks_var, "").strip()
    if raw:
        per_node = _expand_tasks_per_node(tasks_var, raw)
        if vals["cross_rank"] >= len(per_node):
            raise ConfigError(
                f"SLURM_NODEID={vals['cross_rank']} has no entry in {tasks_var}={raw!r} "
                f"({len(per_node)} nodes); expected a node index below {len(per_node)}"
            )
        local_size = per_node[vals["cross_rank"]]
    else:
        # Slurm always sets the task list; without it assume homogeneous nodes.
        local_size = -(-vals["size"] // max(vals["cross_size"], 1))
    names["local_size"] = tasks_var
    info = RankInfo(
        vals["rank"], vals["size"], vals["local_rank"], local_size, vals["cross_rank"],
        vals["cross_size"], env.get("SLURMD_NODENAME") or socket.gethostname(), "slurm",
    )
    return _check(info, names)


def _torchrun(env: _Env) -> RankInfo:
    names = {"rank": "RANK", "size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}
    rank, size, local_rank = (_int(env, v) for v in names.values())
    local_size = size
    if env.get("LOCAL_WORLD_SIZE", "").strip():
        names["local_size"] = "LOCAL_WORLD_SIZE"
        local_size = _int(env, "LOCAL_WORLD_SIZE")
    if env.get("GROUP_RANK", "").strip() and env.get("GROUP_WORLD_SIZE", "").strip():
        names.update(cross_rank="GROUP_RANK", cross_size="GROUP_WORLD_SIZE")
        info = RankInfo(
            rank, size, local_rank, local_size, _int(env, "GROUP_RANK"),
            _int(env, "GROUP_WORLD_SIZE"), socket.gethostname(), "torchrun",
        )
        return _check(info, names)
    return _homogeneous("torchrun", rank, size, local_rank, local_size, names)


#: (name, marker variable, reader) in the order :func:`detect` tries them.
DETECTORS: tuple[tuple[str, tuple[str, ...], Callable[[_Env], RankInfo]], ...] = (
    ("ringflow", ("RINGFLOW_RANK",), _ringflow),
    ("openmpi", ("OMPI_COMM_WORLD_RANK",), _openmpi),
    ("pmi", ("PMI_RANK",), _pmi),
    ("slurm", ("SLURM_PROCID",), _slurm),
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK"), _torchrun),
)


def detect(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's :class:`RankInfo`, from the first launcher environment found.

    Raises:
        ConfigError: a variable of the detected launcher is missing, not an integer, negative, or
            inconsistent with the others (``rank >= size``, ...); the message names it.
    """
    env = os.environ if environ is None else environ
    for _name, markers, reader in DETECTORS:
        if all(env.get(m, "").strip() for m in markers):
            return reader(env)
    return RankInfo(0, 1, 0, 1, 0, 1, socket.gethostname(), "single")


def cpu_share(local_rank: int, local_size: int, cpus: Iterable[int]) -> list[int]:
    """Local rank ``local_rank``'s CPUs: the ``local_rank``-th of ``local_size`` equal slices of
    ``cpus`` (sorted; a remainder stays unused), or a single CPU, round-robin, when there are
    more local ranks than CPUs."""
    ordered = sorted(cpus)
    per = len(ordered) // local_size
    if per == 0:
        return [ordered[local_rank % len(ordered)]]
    return ordered[local_rank * per:(local_rank + 1) * per]


def bind_to_cores(info: RankInfo) -> list[int]:
    """Pin every thread of this process to its :func:`cpu_share` (threads it starts later inherit
    it); returns the CPUs.

    Raises:
        ConfigError: this platform cannot pin threads (no ``os.sched_setaffinity``).
    """
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        raise ConfigError("RINGFLOW_BIND_TO=core needs Linux (sched_setaffinity); unset it or "
                          "set it to none")
    share = cpu_share(info.local_rank, info.local_size, os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), share)
    return share
