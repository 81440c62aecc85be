"""Thread counts that match the cores a rank has: OpenMP, MKL, OpenBLAS, torch, TensorFlow.

Every framework sizes its thread pools for the whole machine. Two ranks on two cores then run
four compute threads, and each rank's threads wait at every barrier for a thread the other rank
preempted: Horovod's ``pytorch_synthetic_benchmark.py`` (a small ResNet-18, 2 ranks on this
2-core VM) ran at 0.3 img/s per rank, and at 1.7 with ``OMP_NUM_THREADS=1``. torchrun sets
``OMP_NUM_THREADS=1`` when it starts several processes; ringflow gives every rank one thread per
core it has, under every launcher.

**The rule.** ::

    threads = max(1, min(cpus, cores // sharing, quota // local_size))

* ``cpus``: the CPUs this rank may run on (its affinity; after ringflow binds it, its share);
* ``cores``: the physical cores (SMT siblings once, as torch's default counts them) of the pool
  those CPUs come from, and ``sharing`` the ranks of this host that share that pool: when
  ringflow binds the ranks (``bind_to``), the host's CPUs and its local size; otherwise the CPUs
  of this rank, and the local ranks whose CPUs overlap them -- the local size when every rank
  may run anywhere, 1 when a launcher gave each rank CPUs of its own (``mpirun --bind-to core``,
  Slurm's ``--cpu-bind``); ranks placed on parts of the host compare their CPUs through the
  store at :func:`ringflow.init` to count that;
* ``quota``: the cgroup's CPU quota (Docker's ``--cpus``, a Kubernetes limit: cgroup v2
  ``cpu.max``, v1 ``cpu.cfs_quota_us``), taken as shared by the host's ranks.

**What follows it.** The variables :data:`VARIABLES` (OpenMP, MKL, OpenBLAS, Accelerate,
numexpr, and TensorFlow's intra-op and inter-op pools), ``torch.set_num_threads`` and TensorFlow's
``tf.config.threading`` settings.

* ``ringflow-run`` (and ``ringflow.run``, ``RayExecutor``): decided for each host before its
  workers start -- by the launcher for this host, by the remote bootstrap on another, by the
  actor's setup under Ray -- and put in the workers' environment, since OpenMP reads it when it
  loads. :data:`MARK` (``RINGFLOW_THREADS=N:VAR,VAR``) tells :func:`ringflow.init` what was
  decided and which variables ringflow set.
* Any other launcher (torchrun, mpirun, srun, ...): at :func:`ringflow.init`, which sets the
  variables in ``os.environ`` (for libraries loaded later: a torch or TensorFlow imported after
  ``init()`` reads them) and applies the count to torch and TensorFlow if already imported.
  OpenMP runtimes and BLAS libraries loaded before ``init()`` other than through torch keep
  their sizes (numpy's OpenBLAS among them).

**The user's settings win.** A variable of :data:`VARIABLES` that the user set is kept, and an
``OMP_NUM_THREADS`` of the user's is the count the others follow; so is a
``torch.set_num_threads(n)`` called before ``init()`` (an ``n`` other than torch's own default,
which it cannot be told from) or after it, and TensorFlow's own settings. A launcher's defaults
are not the user's: torchrun's ``OMP_NUM_THREADS=1`` (its agent, the worker's parent, started
without one) and Ray's (set in the worker process itself) are replaced by the rule, Ray's taken
as a cap since it is the actor's CPU reservation. Where the user's count oversubscribes the
cores, one line says so: ``ringflow-run`` writes it once per host, ``init()`` logs it on local
rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .topology import cpu_share, why_not_bound

__all__ = ["MARK", "VARIABLES", "Plan", "at_init", "cpu_quota", "current", "decide",
           "for_launcher", "physical_cores"]

log = logging.getLogger(__name__)

#: The variables ringflow sets to the rank's thread count (each unless the user set it).
VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
             "TF_NUM_INTEROP_THREADS")
#: Set by a launcher of ringflow's that applied the rule: ``"N:VAR,VAR,...:WHY"``, the count, the
#: variables it set (the others of :data:`VARIABLES` in the environment are the user's) and why.
MARK = "RINGFLOW_THREADS"
_SYSFS = "/sys/devices/system/cpu"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the rule gave one rank, and what was made of it."""

    #: The count libraries get: the rule's, or the user's ``OMP_NUM_THREADS``.
    threads: int
    #: The rule's count, and why (``"2 cores / 2 ranks"``).
    rule: int
    why: str
    #: Variables ringflow sets, and those the user set (kept).
    set: dict[str, str]
    user: dict[str, str]
    #: The one-line note when the user's counts oversubscribe the cores; "" otherwise.
    note: str = ""
    #: What was done to frameworks already imported at ``init()`` (``{"torch": "..."}``).
    frameworks: dict[str, str] = dataclasses.field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        """The variables to add to a worker's environment, :data:`MARK` included."""
        return {**self.set, MARK: f"{self.rule}:{','.join(self.set)}:{self.why}"}

    def describe(self) -> str:
        """One line: the count, where it comes from, what follows it."""
        mine = ", ".join(f"{k}={v}" for k, v in self.set.items()) or "none"
        yours = "; yours kept: " + ", ".join(f"{k}={v}" for k, v in self.user.items()) \
            if self.user else ""
        done = "".join(f"; {v}" for v in self.frameworks.values())
        return (f"{self.threads} thread{'s' * (self.threads != 1)} per rank ({self.why}); "
                f"set {mine}{yours}{done}")

    def metadata(self) -> dict[str, Any]:
        """For the timeline's metadata (JSON)."""
        return {"threads": self.threads, "rule": self.rule, "why": self.why, "set": self.set,
                "user": self.user, "frameworks": self.frameworks, "note": self.note}


# what this host offers ---------------------------------------------------------------------------
def affinity() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def online() -> int:
    """CPUs online on this host (what an unplaced process's affinity holds)."""
    return os.cpu_count() or len(affinity())


def physical_cores(cpus: Iterable[int], sysfs: str = _SYSFS) -> int:
    """The physical cores ``cpus`` belong to (SMT siblings counted once); ``len(cpus)`` where
    the topology cannot be read."""
    cpus = list(cpus)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return len(cpus)
    return len(cores)


def cpu_quota(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup may use (the tightest limit from its cgroup up
    to the root; cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), or None
    where there is no limit or it cannot be read."""
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            bases, read = [root], _v2_limit
        elif "cpu" in controllers.split(","):
            bases = [f"{root}/{name}" for name in (controllers, "cpu", "cpu,cpuacct")]
            read = _v1_limit
        else:
            continue
        for base in dict.fromkeys(bases):
            if not os.path.isdir(base):
                continue
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                limit = read(os.path.join(base, *parts[:depth]))
                if limit is not None:
                    limits.append(limit)
            break
    return min(limits) if limits else None


def _v2_limit(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _v1_limit(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


# the rule ----------------------------------------------------------------------------------------
def count(cpus: int, cores: int, sharing: int, local_size: int,
          quota: float | None) -> tuple[int, str]:
    """The rule (module doc): the count, and why in words."""
    n = min(cpus, cores // max(sharing, 1))
    why = (f"{cores} core{'s' * (cores != 1)} / {sharing} ranks" if sharing > 1
           else f"{min(cpus, cores)} core{'s' * (min(cpus, cores) != 1)} of its own")
    if quota is not None and math.floor(quota / max(local_size, 1)) < n:
        n = math.floor(quota / max(local_size, 1))
        why = f"CPU quota {quota:g} / {local_size} ranks"
    return max(1, n), why


def decide(environ: Mapping[str, str], rule: tuple[int, str], sharing: int, cores: int,
           launcher_set: Iterable[str] = (), cap: tuple[int, str] | None = None) -> Plan:
    """What a rank gets under ``rule`` (count, why), given its environment: the user's
    variables are kept (``launcher_set`` names those a launcher set: not the user's), the rest
    are set. ``cap``: a launcher's count that bounds the rule's (Ray's reservation)."""
    n, why = rule
    if cap is not None and cap[0] < n:
        n, why = cap
    ours = set(launcher_set)
    user = {k: environ[k] for k in VARIABLES if environ.get(k) and k not in ours}
    threads = _int(user.get("OMP_NUM_THREADS")) or n
    plan_set = {k: str(threads) for k in VARIABLES if k not in user}
    return Plan(threads, n, why, plan_set, user,
                note=_oversubscribed(user, sharing, cores, n))


def _int(text: str | None) -> int | None:
    """The first number of an OpenMP count (``"4"``, ``"4,2"`` nested); None if not one."""
    try:
        value = int((text or "").split(",")[0])
    except ValueError:
        return None
    return value if value > 0 else None


def _oversubscribed(user: Mapping[str, str], sharing: int, cores: int, rule: int,
                    extra: Mapping[str, int] | None = None) -> str:
    counts = {k: c for k, v in user.items() if not k.startswith("TF_NUM_INTEROP")
              and (c := _int(v)) is not None}
    counts.update(extra or {})
    over = {k: c for k, c in counts.items() if c * sharing > cores}
    if not over:
        return ""
    name, c = max(over.items(), key=lambda kv: kv[1])
    return (f"{name}={c} (yours) with {sharing} rank{'s' * (sharing != 1)} on "
            f"{cores} core{'s' * (cores != 1)} is {c * sharing} threads: the cores are "
            f"oversubscribed; ringflow's default here is {rule} (unset it to take that)")


# ringflow's launchers ----------------------------------------------------------------------------
def for_launcher(environ: Mapping[str, str], local_rank: int, local_size: int,
                 bind_to: str = "none", cap: tuple[int, str] | None = None) -> Plan:
    """The plan of local rank ``local_rank`` of ``local_size`` on this host, decided before the
    worker starts (its affinity and cgroup are this process's): ``bind_to`` as the worker's
    configuration says (``RINGFLOW_BIND_TO``)."""
    pool = affinity()
    cores = physical_cores(pool)
    bound = bind_to == "core" or (bind_to == "auto" and not why_not_bound(local_size))
    mine = len(cpu_share(local_rank, local_size, pool)) if bound else len(pool)
    rule = count(mine, cores, local_size, local_size, cpu_quota())
    return decide(environ, rule, local_size, cores, _marked(environ), cap)


def _marked(environ: Mapping[str, str]) -> set[str]:
    """The variables an enclosing ringflow launcher set (:data:`MARK`): not the user's."""
    fields = environ.get(MARK, "").split(":", 2)
    return set(filter(None, fields[1].split(","))) if len(fields) > 1 else set()


# init() ------------------------------------------------------------------------------------------
_current: Plan | None = None


def current() -> Plan | None:
    """This process's plan since :func:`ringflow.init` (None before, or without one)."""
    return _current


def at_init(info: Any, store: Any, prefix: str, pool: set[int], bound: bool) -> Plan:
    """Decide (or read what the launcher decided) and apply this rank's plan; ``pool`` is the
    affinity before ringflow bound this process (``bound``)."""
    global _current
    env = os.environ
    launcher = _marked(env) if info.detector == "ringflow" and MARK in env else None
    cores = physical_cores(pool)
    mine = affinity()
    if launcher is not None:
        fields = env[MARK].split(":", 2)
        rule = (_int(fields[0]) or 1, fields[2] if len(fields) > 2 else "the launcher's")
        sharing = info.local_size
        plan = decide(env, rule, sharing, cores, launcher)
        plan = dataclasses.replace(plan, note="")  # the launcher has said it
    else:
        if info.size > 1 and store is not None:  # every rank: any may need to compare
            store.set(f"{prefix}cpus/{info.rank}",
                      f"{info.cross_rank}|{','.join(map(str, sorted(pool)))}".encode())
        sharing = info.local_size if bound else _sharing(info, store, prefix, pool)
        rule = count(len(mine), cores, sharing, info.local_size, cpu_quota())
        not_user, cap = _launcher_defaults(env)
        plan = decide(env, rule, sharing, cores, not_user | _marked(env), cap)
        os.environ.update(plan.environ())  # marked: a launcher started from here knows them
    done, notes = {}, [plan.note] if plan.note else []
    # What torch may have chosen itself: the variables it reads, the machine's physical cores
    # (its default), OpenMP's default (the CPUs of the affinity it was loaded with).
    defaults = {len(pool), physical_cores(range(online())), online()}
    for source in (plan.set, plan.user, _started_with()):
        defaults.update(v for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
                        if (v := _int(source.get(k))) is not None)
    for module, apply in _FRAMEWORKS.items():
        if module in sys.modules:
            with contextlib.suppress(Exception):  # a framework half imported: leave it
                what, note = apply(sys.modules[module], plan, sharing, cores, defaults)
                done[module] = what
                notes += [note] if note else []
    plan = dataclasses.replace(plan, frameworks=done, note=notes[0] if notes else "")
    _current = plan
    log.info("rank %d: %s", info.rank, plan.describe())
    if plan.note and info.local_rank == 0:
        log.warning("%s", plan.note)
    return plan


def _sharing(info: Any, store: Any, prefix: str, pool: set[int]) -> int:
    """How many ranks of this host may run on CPUs of ``pool``: the local size when ``pool`` is
    every online CPU, else counted from every rank's CPUs (published by every rank)."""
    if info.local_size <= 1 or len(pool) >= online() or store is None:
        return max(info.local_size, 1)
    sharing = 0
    for r in range(info.size):
        host, _, cpus = store.get(f"{prefix}cpus/{r}").decode().partition("|")
        if int(host) == info.cross_rank and pool & {int(c) for c in cpus.split(",") if c}:
            sharing += 1
    return max(sharing, 1)


def _launcher_defaults(env: Mapping[str, str]) -> tuple[set[str], tuple[int, str] | None]:
    """Variables a launcher set (not the user), and a launcher's count that caps the rule."""
    omp = env.get("OMP_NUM_THREADS")
    if omp is None:
        return set(), None
    if env.get("TORCHELASTIC_RUN_ID") and omp == "1" and _int(env.get("LOCAL_WORLD_SIZE")) != 1:
        parent = _initial_environ(os.getppid())  # torchrun's agent
        if parent is not None and b"OMP_NUM_THREADS" not in parent:
            return {"OMP_NUM_THREADS"}, None
    if "ray" in sys.modules:
        mine = _initial_environ(os.getpid())  # Ray sets it in the worker process itself
        if mine is not None and b"OMP_NUM_THREADS" not in mine and _int(omp):
            return {"OMP_NUM_THREADS"}, (_int(omp) or 1, "the Ray actor's CPU reservation")
    return set(), None


def _initial_environ(pid: int) -> set[bytes] | None:
    """The names in ``pid``'s environment as it started (``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return {entry.partition(b"=")[0] for entry in f.read().split(b"\0") if entry}
    except OSError:
        return None


# frameworks already imported at init() -----------------------------------------------------------
def _torch(torch: Any, plan: Plan, sharing: int, cores: int,
           defaults: set[int]) -> tuple[str, str]:
    have = torch.get_num_threads()
    if have == plan.threads:
        return f"torch {have} thread{'s' * (have != 1)}", ""
    if have not in defaults:
        note = _oversubscribed({}, sharing, cores, plan.rule, {"torch.set_num_threads": have})
        return f"torch.set_num_threads({have}) kept (yours)", note
    torch.set_num_threads(plan.threads)
    return f"torch.set_num_threads({plan.threads}) (was {have})", ""


def _started_with() -> dict[str, str]:
    try:
        with open("/proc/self/environ", "rb") as f:
            pairs = [e.partition(b"=") for e in f.read().split(b"\0") if e]
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}
    except OSError:
        return {}


def _tensorflow(tf: Any, plan: Plan, sharing: int, cores: int,
                defaults: set[int]) -> tuple[str, str]:
    threading = tf.config.threading
    intra = threading.get_intra_op_parallelism_threads()
    if intra not in (0, plan.threads) or "TF_NUM_INTRAOP_THREADS" in plan.user:
        return f"TensorFlow's {intra or plan.user.get('TF_NUM_INTRAOP_THREADS')} intra-op " \
               "threads kept (yours)", ""
    if intra == 0 and _started_with().get("TF_NUM_INTRAOP_THREADS") == str(plan.threads):
        # a launcher of ringflow's put it there: TensorFlow reads it when its runtime starts
        return f"TensorFlow follows TF_NUM_INTRAOP_THREADS={plan.threads}", ""
    try:
        threading.set_intra_op_parallelism_threads(plan.threads)
        if "TF_NUM_INTEROP_THREADS" not in plan.user:
            threading.set_inter_op_parallelism_threads(plan.threads)
    except RuntimeError:  # its runtime started before init(): the pools keep their size
        return "TensorFlow had started: its thread pools keep their size (set " \
               "TF_NUM_INTRAOP_THREADS, or call init() before its first operation)", ""
    return f"TensorFlow intra/inter-op threads {plan.threads}", ""


_FRAMEWORKS: dict[str, Callable[[Any, Plan, int, int, set[int]], tuple[str, str]]] = {
    "torch": _torch, "tensorflow": _tensorflow}
