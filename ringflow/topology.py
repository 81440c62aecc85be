"""Where this process sits in the job: :class:`RankInfo` and :func:`detect`.

:func:`detect` reads the environment that started the process. The innermost launcher wins: a
launcher started inside another (torchrun inside an ``sbatch`` step, ``torch.multiprocessing``
workers that set ``RANK``/``WORLD_SIZE`` inside ``srun``) sets its own variables on top of the
inherited ones, so the detectors are tried in this order:

1. ``ringflow`` -- ``RINGFLOW_RANK`` is set (ringflow-run, ``ringflow.run``, RayExecutor):
   ``RINGFLOW_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE, _HOSTNAME``, all
   given, nothing derived.
2. ``torch`` -- ``torch.distributed`` is initialised in this process (Lightning, Accelerate, Ray
   Train, a script of your own): rank and size of its default group; local values from
   ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when ``RANK``/``WORLD_SIZE`` agree with the group, else
   from the peers' host names.
3. ``torchrun`` / ``env`` -- ``RANK`` and ``WORLD_SIZE`` are set (``torchrun`` when
   ``TORCHELASTIC_RUN_ID`` is too: torchrun and ``python -m torch.distributed.launch``; ``env``
   otherwise: torch's ``env://`` contract as Kubeflow PyTorchJob, SageMaker or ``mp.spawn``
   workers set it): ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``/``GROUP_WORLD_SIZE``
   where set, else the local values come from the peers' host names.
4. ``openmpi`` -- ``OMPI_COMM_WORLD_RANK`` (Open MPI's mpirun): ``OMPI_COMM_WORLD_RANK, _SIZE,
   _LOCAL_RANK, _LOCAL_SIZE``.
5. ``pmi`` -- ``PMI_RANK`` (MPICH / Intel MPI under Hydra): ``PMI_RANK, PMI_SIZE``, and
   ``MPI_LOCALRANKID, MPI_LOCALNRANKS`` where Hydra sets them.
6. ``slurm`` -- ``SLURM_PROCID`` and ``SLURM_STEP_ID`` (a task of an ``srun`` step):
   ``SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID``, the ``SLURM_STEP_*`` sizes (else the job's) and
   ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``) for the local size.
7. ``single`` -- none of the above: one process, unless a variable says the job is larger.

Where each finds the other ranks and the job secret is :mod:`ringflow.bootstrap`'s business.

Never silently alone. A process that matches no detector runs as a job of one, unless a variable
of some launcher (:data:`WORLD_SIZE_VARIABLES`) says the job has more processes: then
:func:`detect` raises :class:`ConfigError` naming the variable and what to do. The classic case
is ``python train.py`` in an ``sbatch`` script with ``--ntasks=4`` but no ``srun``: the batch
step has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=4`` but no ``SLURM_STEP_ID``. To run one process
there on purpose, set ``RANK=0 WORLD_SIZE=1``.

Local values. Where the launcher gives no local rank and size (``env``, ``torch``, or
``ringflow.init(rank=, size=)``), :func:`detect` returns them as 0 (:attr:`RankInfo.placed` is
False) and :func:`place` derives them once the store is reachable: ranks with the same host name
are one host, hosts are numbered in the order of their lowest rank. Open MPI, PMI and torchrun
without ``GROUP_*`` give the local size but not the host index; there ringflow assumes
*homogeneous hosts with ranks assigned host by host* (Open MPI's and Hydra's default ``--map-by
slot``): ``cross_rank = rank // local_size`` and ``cross_size = ceil(size / local_size)``. Under
another mapping the cross values are not right; launch with ``ringflow-run`` or Slurm for exact
values. PMI without ``MPI_LOCALRANKID`` is taken as one rank per host (``local_size = 1``),
which only forgoes shared memory between ranks of one host.

Binding. :func:`bind_to_cores` (``RINGFLOW_BIND_TO=core``, ``ringflow-run --bind-to core``) pins
each process to its slice of the CPUs it may use (:func:`cpu_share`), after the local values are
known. On a 2-core machine it turned the 2-rank 4 KiB allreduce loop from bimodal (0.14 or
0.35-0.50 ms for hundreds of ops at a time) into a steady 0.14 ms (benchmarks/RESULTS.md
section 5). ``RINGFLOW_BIND_TO=auto``, ringflow-run's default, binds where
:func:`auto_binding` finds it safe, as ``mpirun`` binds by default at small rank counts.

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
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

from .errors import ConfigError

__all__ = ["DETECTORS", "WORLD_SIZE_VARIABLES", "RankInfo", "auto_binding", "bind_to_cores",
           "cpu_share", "detect", "explicit", "place", "why_not_bound"]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """This process's place in the job; ``detector`` names the environment it came from.

    ``local_size == 0`` means the local and cross values are not known yet (:func:`place`)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    detector: str = "single"

    @property
    def placed(self) -> bool:
        return self.local_size > 0


_Env = Mapping[str, str]

#: Variables by which a launcher says how many processes the job has. If one of them says more
#: than one and no detector matched, :func:`detect` raises instead of running alone.
WORLD_SIZE_VARIABLES = (
    "RINGFLOW_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
    "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", "MV2_COMM_WORLD_SIZE",
)


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


def _set(env: _Env, *names: str) -> bool:
    return all(env.get(name, "").strip() for name in names)


def _first(env: _Env, *names: str) -> str:
    """The first of ``names`` that is set (the last one when none is, so errors name it)."""
    for name in names:
        if _set(env, name):
            return name
    return names[-1]


def _check(info: RankInfo, names: Mapping[str, str], unplaced: bool = False) -> RankInfo:
    """Raise ConfigError naming the variable behind the first inconsistent field (``unplaced``:
    the local and cross values are still to come, :func:`place`)."""

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
    if unplaced:
        return info
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


def _unplaced(detector: str, rank: int, size: int, names: Mapping[str, str]) -> RankInfo:
    return _check(RankInfo(rank, size, 0, 0, 0, 0, socket.gethostname(), detector), names,
                  unplaced=True)


def _ringflow(env: _Env) -> RankInfo:
    fields = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
    names = {f: f"RINGFLOW_{f.upper()}" for f in fields}
    values = [_int(env, names[f]) for f in fields]
    host = env.get("RINGFLOW_HOSTNAME") or socket.gethostname()
    return _check(RankInfo(*values, host, "ringflow"), names)  # type: ignore[arg-type]


def _torch_world() -> tuple[int, int] | None:
    """(rank, size) of torch.distributed's default group if this process initialised it; torch
    is not imported for this (a process that has not imported it has not initialised it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _torch(env: _Env) -> RankInfo:
    world = _torch_world()
    if world is None:  # pragma: no cover - the marker checked it
        raise ConfigError("torch.distributed is not initialised")
    rank, size = world
    names = {"rank": "torch.distributed.get_rank()", "size": "torch.distributed.get_world_size()"}
    if _set(env, "RANK", "WORLD_SIZE") and (_int(env, "RANK"), _int(env, "WORLD_SIZE")) == world:
        return _local_from_env(env, "torch", rank, size, names)
    return _unplaced("torch", rank, size, names)


def _local_from_env(env: _Env, detector: str, rank: int, size: int,
                    names: dict[str, str]) -> RankInfo:
    """torch's LOCAL_* / GROUP_* variables where they are all there, else unplaced."""
    if not _set(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        return _unplaced(detector, rank, size, names)
    names.update(local_rank="LOCAL_RANK", local_size="LOCAL_WORLD_SIZE")
    local_rank, local_size = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    if _set(env, "GROUP_RANK", "GROUP_WORLD_SIZE"):
        names.update(cross_rank="GROUP_RANK", cross_size="GROUP_WORLD_SIZE")
        info = RankInfo(rank, size, local_rank, local_size, _int(env, "GROUP_RANK"),
                        _int(env, "GROUP_WORLD_SIZE"), socket.gethostname(), detector)
        return _check(info, names)
    return _homogeneous(detector, rank, size, local_rank, local_size, names)


def _env_contract(env: _Env) -> RankInfo:
    detector = "torchrun" if _set(env, "TORCHELASTIC_RUN_ID") else "env"
    names = {"rank": "RANK", "size": "WORLD_SIZE"}
    return _local_from_env(env, detector, _int(env, "RANK"), _int(env, "WORLD_SIZE"), names)


def _openmpi(env: _Env) -> RankInfo:
    fields = ("rank", "size", "local_rank", "local_size")
    names = {f: f"OMPI_COMM_WORLD_{f.upper()}" for f in fields}
    vals = {f: _int(env, v) for f, v in names.items()}
    return _homogeneous("openmpi", **vals, names=names)


def _pmi(env: _Env) -> RankInfo:
    names = {"rank": "PMI_RANK", "size": "PMI_SIZE"}
    rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_rank, local_size = 0, 1
    if _set(env, "MPI_LOCALRANKID") or _set(env, "MPI_LOCALNRANKS"):
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


def _torch_initialised(env: _Env) -> bool:
    return _torch_world() is not None


#: (name, test, reader) in the order :func:`detect` tries them; see the module doc's table.
DETECTORS: tuple[tuple[str, Callable[[_Env], bool], Callable[[_Env], RankInfo]], ...] = (
    ("ringflow", lambda env: _set(env, "RINGFLOW_RANK"), _ringflow),
    ("torch", _torch_initialised, _torch),
    ("env", lambda env: _set(env, "RANK", "WORLD_SIZE"), _env_contract),
    ("openmpi", lambda env: _set(env, "OMPI_COMM_WORLD_RANK"), _openmpi),
    ("pmi", lambda env: _set(env, "PMI_RANK"), _pmi),
    ("slurm", lambda env: _set(env, "SLURM_PROCID", "SLURM_STEP_ID"), _slurm),
)


def _alone(env: _Env) -> RankInfo:
    """A job of one, unless some variable says the job is larger."""
    for var in WORLD_SIZE_VARIABLES:
        raw = env.get(var, "").strip()
        if raw.isdigit() and int(raw) > 1:
            raise ConfigError(_why_not_joined(env, var, raw))
    return RankInfo(0, 1, 0, 1, 0, 1, socket.gethostname(), "single")


def _why_not_joined(env: _Env, var: str, raw: str) -> str:
    seen = f"{var}={raw} says this job has {raw} processes"
    if var.startswith("SLURM_"):
        return (f"{seen}, but this process is not a task of an srun step (SLURM_PROCID and "
                "SLURM_STEP_ID are not both set: started directly by the batch script?); start "
                "it with `srun python ...` (one task per rank), or with torchrun or ringflow-run "
                "inside the allocation; to run one process on purpose set RANK=0 WORLD_SIZE=1")
    if var == "WORLD_SIZE":
        return (f"{seen}, but RANK is not set; set RANK (0 to {int(raw) - 1}) on every process "
                "as torch's env:// contract does, with MASTER_ADDR and MASTER_PORT")
    if var == "RINGFLOW_SIZE":
        return (f"{seen}, but RINGFLOW_RANK is not set; start the job with ringflow-run, or "
                "unset the stale RINGFLOW_* variables")
    return (f"{seen}, but this process has no rank variable of that launcher; start it through "
            "the launcher (mpirun, srun, torchrun, ringflow-run), or set RANK and WORLD_SIZE")


def detect(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's :class:`RankInfo`, from the innermost launcher environment found.

    Raises:
        ConfigError: a variable of the detected launcher is missing, not an integer, negative, or
            inconsistent with the others (``rank >= size``, ...); or no launcher matched but a
            variable says the job has more than one process. The message names the variable.
    """
    env = os.environ if environ is None else environ
    for _name, matches, reader in DETECTORS:
        if matches(env):
            return reader(env)
    return _alone(env)


def explicit(rank: int | None, size: int | None, local_rank: int | None = None,
             local_size: int | None = None) -> RankInfo:
    """The RankInfo of ``ringflow.init(rank=, size=, local_rank=, local_size=)``: unplaced
    unless both local values are given (then hosts are assumed homogeneous, as for Open MPI).

    Raises:
        ConfigError: a value is missing, not an integer, or inconsistent.
    """
    given = {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size}
    for name, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"init({name}={value!r}): expected an integer >= 0")
    if rank is None or size is None:
        raise ConfigError(f"init(rank={rank!r}, size={size!r}): give both or neither")
    names = {f: f"init({f}=)" for f in given}
    if (local_rank is None) != (local_size is None):
        raise ConfigError(f"init(local_rank={local_rank!r}, local_size={local_size!r}): give "
                          "both or neither (neither: derived from the ranks' host names)")
    if local_rank is None or local_size is None:
        return _unplaced("init", rank, size, names)
    return _homogeneous("init", rank, size, local_rank, local_size, names)


def place(info: RankInfo, hostnames: Sequence[str]) -> RankInfo:
    """``info`` with local and cross values derived from every rank's host name (``hostnames[r]``
    is rank r's): ranks of one host name share a host; hosts are numbered by their lowest rank."""
    me = hostnames[info.rank]
    hosts = list(dict.fromkeys(hostnames))
    local = [r for r, h in enumerate(hostnames) if h == me]
    return dataclasses.replace(
        info, local_rank=local.index(info.rank), local_size=len(local),
        cross_rank=hosts.index(me), cross_size=len(hosts), hostname=me,
    )


def cpu_share(local_rank: int, local_size: int, cpus: Iterable[int]) -> list[int]:
    """Local rank ``local_rank``'s CPUs: the ``local_rank``-th of ``local_size`` equal slices of
    ``cpus`` (sorted; a remainder stays unused), or a single CPU, round-robin, when there are
    more local ranks than CPUs."""
    ordered = sorted(cpus)
    per = len(ordered) // local_size
    if per == 0:
        return [ordered[local_rank % len(ordered)]]
    return ordered[local_rank * per:(local_rank + 1) * per]


def auto_binding(info: RankInfo) -> str:
    """Why ``bind_to=auto`` leaves this process where it is, or ``""`` when it pins it to its
    :func:`cpu_share`: only on Linux, with several ranks on this host, each of which gets at
    least one CPU of its own, and only when nothing has placed this process yet (its affinity is
    every online CPU: no ``taskset``, cpuset, Slurm binding or ``mpirun --bind-to``)."""
    return why_not_bound(info.local_size)


def why_not_bound(local_size: int) -> str:
    """:func:`auto_binding` for a process of a host with ``local_size`` ranks (a launcher asks it
    before the worker starts: the worker inherits its affinity)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return "no sched_setaffinity on this platform"
    if local_size < 2:
        return "the only rank on its host"
    mine = os.sched_getaffinity(0)
    online = os.cpu_count() or len(mine)
    if len(mine) < online:
        return f"already placed on {len(mine)} of the {online} CPUs"
    if local_size > len(mine):
        return f"{local_size} ranks on this host share its {len(mine)} CPUs"
    return ""


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
