"""One frozen :class:`Config`, the only reader of the ``RINGFLOW_*`` tuning knobs.

Each field ``name`` is read from ``RINGFLOW_<NAME>``; ``ringflow-run`` flags set the same variables
for the workers, so a flag wins over the environment it was started from. Bad values raise
:class:`~ringflow.errors.ConfigError` naming the variable; an unknown ``RINGFLOW_*`` name logs a
warning with the closest known name.

Horovod's tuning variables are read too (:func:`read_horovod_env`), under any launcher
(``ringflow-run``, ``mpirun``, ``torchrun``), with Horovod's names, units and parsing
(``horovod/common/operations.cc``, ``logging.cc``, ``gloo_context.cc``):

* ``HOROVOD_FUSION_THRESHOLD`` (bytes) -> ``RINGFLOW_FUSION_THRESHOLD_BYTES``
* ``HOROVOD_CYCLE_TIME`` (ms) -> ``RINGFLOW_CYCLE_TIME_MS``
* ``HOROVOD_CACHE_CAPACITY`` -> ``RINGFLOW_CACHE_CAPACITY``
* ``HOROVOD_TIMELINE`` (a path) -> ``RINGFLOW_TIMELINE_PATH``; ``DYNAMIC`` (Horovod: no file until
  ``start_timeline()``) is what ringflow does without one, so nothing is read
* ``HOROVOD_STALL_CHECK_DISABLE`` (> 0) -> ``RINGFLOW_STALL_WARNING_S``, ``_STALL_SHUTDOWN_S`` and
  ``_DEADLOCK_SHUTDOWN_S`` = 0, as ``ringflow-run --no-stall-check``
* ``HOROVOD_STALL_CHECK_TIME_SECONDS`` -> ``RINGFLOW_STALL_WARNING_S``
* ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` -> ``RINGFLOW_STALL_SHUTDOWN_S``
* ``HOROVOD_LOG_LEVEL`` -> ``RINGFLOW_LOG_LEVEL`` (trace -> debug, fatal -> error)
* ``HOROVOD_GLOO_TIMEOUT_SECONDS`` -> ``RINGFLOW_TIMEOUT_S`` (both: how long one wait on a peer may
  take; both default to 30 s)

Each one read logs a warning that names the mapping (``HOROVOD_CYCLE_TIME=5 read as
RINGFLOW_CYCLE_TIME_MS=5.0``). A ``RINGFLOW_*`` variable that is set wins, and the Horovod one is
then ignored (logged at INFO). ``HOROVOD_AUTOTUNE`` (> 0), ``HOROVOD_AUTOTUNE_LOG``,
``_AUTOTUNE_WARMUP_SAMPLES`` and ``_AUTOTUNE_STEPS_PER_SAMPLE`` are read as ``RINGFLOW_AUTOTUNE``,
``_AUTOTUNE_LOG_FILE``, ``_AUTOTUNE_WARMUP_SAMPLES`` and ``_AUTOTUNE_STEPS_PER_SAMPLE``
(:mod:`ringflow.autotune`). ``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``_HIERARCHICAL_ALLGATHER``,
``_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` and ``_TIMELINE_MARK_CYCLES`` have no ringflow meaning: turned
on, they log a warning that says why. A worker of ``ringflow-run`` (``RINGFLOW_LAUNCHER_PID`` set)
logs these notes at INFO only: the launcher has already written them once, and it passes what it
read on as ``RINGFLOW_*`` variables.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Callable, Mapping

from .errors import ConfigError

__all__ = ["ENV_CONTRACT", "HOROVOD_LOG_LEVELS", "Config", "HorovodEnv", "read_horovod_env"]

log = logging.getLogger(__name__)

#: Variables of the launcher -> worker contract (DESIGN.md section 5); read by topology/rendezvous.
ENV_CONTRACT = (
    "RINGFLOW_RANK", "RINGFLOW_SIZE", "RINGFLOW_LOCAL_RANK", "RINGFLOW_LOCAL_SIZE",
    "RINGFLOW_CROSS_RANK", "RINGFLOW_CROSS_SIZE", "RINGFLOW_HOSTNAME",
    "RINGFLOW_RENDEZVOUS_ADDR", "RINGFLOW_RENDEZVOUS_PORT", "RINGFLOW_SECRET_FD",
    "RINGFLOW_SECRET_FILE", "RINGFLOW_JOB_ID", "RINGFLOW_LAUNCHER_PID", "RINGFLOW_LIFELINE",
    "RINGFLOW_THREADS",  # the thread counts a launcher decided (ringflow.threads)
    "RINGFLOW_ELASTIC_ID", "RINGFLOW_ELASTIC_TIMEOUT_S",  # an elastic worker (ringflow.world)
)

_MIB = 1024 * 1024
_WIRE = ("none", "fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class Config:
    #: Largest fused buffer; 0 disables fusion. Horovod's default, 128 MiB.
    fusion_threshold_bytes: int = 128 * _MIB
    #: The fusion window: while some submitted names still wait for a rank, names that are ready
    #: wait up to this long for them, so that a burst fuses into few collectives (a lone name is
    #: planned at once). Also the longest the engine sleeps while operations are pending before
    #: it looks at its queue, heartbeats and the stall inspector again (it wakes on every
    #: enqueue and message; an idle engine sleeps until one arrives or the heartbeat,
    #: ``min(1 s, timeout_s / 4)``).
    cycle_time_ms: float = 1.0
    #: Response-cache entries; 0 disables the cache (every op takes the slow path).
    cache_capacity: int = 1024
    #: How long any single wait on a peer (connect, handshake, receive) may take before the peer is
    #: declared unresponsive. Engine threads answer within milliseconds even while the framework is
    #: busy, so a silent peer for this long is frozen or gone.
    timeout_s: float = 30.0
    #: Warn when some ranks have submitted a tensor and others have not for this long.
    stall_warning_s: float = 60.0
    #: Fail the job on every rank when a stall lasts this long; 0 disables. Long, because the
    #: rank the others wait for may be busy on its own (evaluating, writing a checkpoint).
    stall_shutdown_s: float = 600.0
    #: Fail the job sooner when the stall is a deadlock: every rank that a collective waits for
    #: is itself waiting in another collective (ranks called collectives in different orders, or
    #: one skipped a collective), with no submission for this long; 0 disables. 30 s: long
    #: enough for any gap between two asynchronous submissions of a training step, short
    #: enough that a test file with a bug fails in seconds, not in ten minutes (DESIGN.md §3).
    deadlock_shutdown_s: float = 30.0
    #: Write a Chrome-trace timeline here (rank 0); empty disables.
    timeline_path: str = ""
    #: Level of the ``ringflow`` logger: debug, info, warning, error.
    log_level: str = "warning"
    #: Data transport: ``auto`` (mpi under mpirun with mpi4py; else shm between ranks of one host,
    #: tcp across hosts), or a registry name (``tcp``, ``shm``, ``mpi``, ``loopback``).
    transport: str = "auto"
    #: Address this rank's listening sockets bind to; empty picks one from the rendezvous route.
    bind_addr: str = ""
    #: ``core``: at init(), pin this process (every thread it has, and so every thread it starts
    #: later) to its share of the CPUs it may use: local rank ``i`` of ``L`` gets the ``i``-th of
    #: ``L`` equal slices, or one CPU round-robin when there are more ranks than CPUs (what
    #: ``mpirun --bind-to core`` does). ``none`` leaves placement to the OS scheduler. ``auto``
    #: (ringflow-run's default, as mpirun binds by default): ``core`` where that is safe
    #: (:func:`ringflow.topology.auto_binding`), else ``none``.
    bind_to: str = "none"
    #: How long a small cached allreduce posted on the same-host lane (:mod:`ringflow.lane`; every
    #: rank on one host, shared memory) waits for the other ranks to post it before it goes to
    #: the coordinator as any operation does; 0 turns the lane off.
    lane_wait_us: int = 500
    #: The gradient buckets of the optimizers (:mod:`ringflow.batching`): gradients are submitted
    #: in the order they become ready, in buckets closed at this many bytes (the first bucket of
    #: a backward pass at 1 MiB), so that the exchange overlaps the rest of the pass; 0 submits
    #: everything when the pass ends. The autotuner may change it.
    bucket_bytes: int = 4 * _MIB
    #: Largest message of a pipelined collective (the ring, broadcast; :mod:`ringflow.algorithms.
    #: buffers`); 0: the built-in 1 MiB. The autotuner may change it (every rank at the same
    #: plan item).
    chunk_bytes: int = 0
    #: ``fp16`` / ``bf16``: float32 allreduces larger than 64 KiB travel in 16 bits whatever
    #: compression their call asked for (changes results: what ``--autotune-compression`` lets
    #: the autotuner choose, pinned); ``none``: as each call asks.
    wire_compression: str = "none"
    #: The gradient compression of the optimizers whose ``compression=`` is left at its default
    #: (``Compression.none``): ``none``, ``fp16``, ``bf16``, ``powersgd[:rank=R]``,
    #: ``randomk[:fraction=F]``, ``onebit``, ``auto`` (:func:`ringflow.compression.parse`).
    compression: str = "none"
    #: Tune fusion_threshold_bytes, cycle_time_ms, bucket_bytes, chunk_bytes (and
    #: wire_compression where autotune_compression allows) online from the measured step rate
    #: (:mod:`ringflow.autotune`); a knob set in the environment stays as set.
    autotune: bool = False
    #: Rank 0 writes each sample of the autotuner here (CSV, :mod:`ringflow.autotune`).
    autotune_log_file: str = ""
    #: The 16-bit wire format the autotuner may try (``fp16``, ``bf16``); ``none``: it never
    #: compresses (compression changes results, so only the user can allow it).
    autotune_compression: str = "none"
    #: Samples the autotuner ignores at the start (the first steps are slow).
    autotune_warmup_samples: int = 2
    #: Steps per sample of the autotuner (the first step after a change is not counted).
    autotune_steps_per_sample: int = 4
    #: Faults to inject, for tests (``ringflow.injection``: rank, protocol point, action); empty:
    #: none, and no cost.
    fault: str = ""

    def __post_init__(self) -> None:
        checks = {
            "fusion_threshold_bytes": self.fusion_threshold_bytes >= 0,
            "cycle_time_ms": self.cycle_time_ms > 0,
            "cache_capacity": self.cache_capacity >= 0,
            "timeout_s": self.timeout_s > 0,
            "stall_warning_s": self.stall_warning_s >= 0,
            "stall_shutdown_s": self.stall_shutdown_s >= 0,
            "deadlock_shutdown_s": self.deadlock_shutdown_s >= 0,
            "log_level": self.log_level.lower() in ("debug", "info", "warning", "error"),
            "bind_to": self.bind_to in ("none", "core", "auto"),
            "lane_wait_us": self.lane_wait_us >= 0,
            "bucket_bytes": self.bucket_bytes >= 0,
            "chunk_bytes": self.chunk_bytes == 0 or self.chunk_bytes >= 4096,
            "wire_compression": self.wire_compression in _WIRE,
            "autotune_compression": self.autotune_compression in _WIRE,
            "autotune_warmup_samples": self.autotune_warmup_samples >= 0,
            "autotune_steps_per_sample": self.autotune_steps_per_sample >= 2,
        }
        if self.compression != "none":  # the default needs no parsing (and no numpy)
            from .compression import parse  # the base layer, as this module

            try:
                parse(self.compression)
            except ConfigError as exc:
                raise _OutOfRange("compression", f"RINGFLOW_COMPRESSION: {exc}") from None
        for name, ok in checks.items():
            if not ok:
                raise _OutOfRange(
                    name,
                    f"{_env_name(name)}={getattr(self, name)!r} is out of range; "
                    f"the default is {_DEFAULTS[name]!r}",
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build a Config from ``RINGFLOW_*`` variables; keyword ``overrides`` win."""
        env = os.environ if environ is None else environ
        _warn_unknown(env)
        horovod = read_horovod_env(env)
        quiet = bool(env.get("RINGFLOW_LAUNCHER_PID"))  # ringflow-run has reported them
        for line in (*horovod.read, *horovod.unused):
            log.log(logging.INFO if quiet else logging.WARNING, "%s", line)
        for line in horovod.ignored:
            log.info("%s", line)
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            var = _env_name(field.name)
            raw = env.get(var)
            if raw is None or raw == "":
                raw = horovod.values.get(var)
            if raw is None or raw == "":
                continue
            values[field.name] = _parse(field.name, raw)
        values.update(overrides)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except _OutOfRange as exc:
            source = horovod.sources.get(_env_name(exc.field))
            if source is None or exc.field in overrides:
                raise
            raise ConfigError(
                f"{source}={env[source]!r} (read as {_env_name(exc.field)}="
                f"{values[exc.field]!r}) is out of range; the default is "
                f"{_DEFAULTS[exc.field]!r}"
            ) from None


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
_KNOWN = {*(f"RINGFLOW_{n.upper()}" for n in _DEFAULTS), *ENV_CONTRACT}


def _env_name(field: str) -> str:
    return f"RINGFLOW_{field.upper()}"


class _OutOfRange(ConfigError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _parse(field: str, raw: str) -> object:
    """``raw`` as the type of Config field ``field``.

    Raises:
        ConfigError: ``raw`` is not a number where the field is one.
    """
    kind = type(_DEFAULTS[field])
    if kind is bool:
        text = raw.strip().lower()
        if text not in _BOOLS:
            raise ConfigError(f"{_env_name(field)}={raw!r} is not one of "
                              f"{', '.join(sorted(_BOOLS))}")
        return _BOOLS[text]
    try:
        return kind(float(raw)) if kind is int else kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{_env_name(field)}={raw!r} is not a valid {kind.__name__}") from exc


# --- Horovod's variables -------------------------------------------------------------------------

#: Horovod's log level names (horovod/common/logging.cc, case-insensitive) -> ringflow's.
HOROVOD_LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning",
                      "error": "error", "fatal": "error"}
_STALL_OFF = ("RINGFLOW_STALL_WARNING_S", "RINGFLOW_STALL_SHUTDOWN_S",
              "RINGFLOW_DEADLOCK_SHUTDOWN_S")


def _horovod_int(raw: str) -> int:
    return int(raw.strip())


def _horovod_flag(raw: str) -> bool:
    """Horovod's booleans: ``strtol(value) > 0`` (``"1"`` on, ``"0"`` or junk off)."""
    try:
        return int(raw.strip()) > 0
    except ValueError:
        return False


def _horovod_on(raw: str) -> str | bool:
    """A Horovod switch that turns a ringflow one on: ``"1"``, or False when off."""
    return "1" if _horovod_flag(raw) else False


def _horovod_level(raw: str) -> str:
    level = raw.strip().lower()
    if level not in HOROVOD_LOG_LEVELS:
        raise ValueError(raw)
    return HOROVOD_LOG_LEVELS[level]


#: Horovod variable -> (what its value is, the RINGFLOW_* variables it sets, the conversion).
#: Processed in this order; a variable already set by an earlier Horovod one is not set again
#: (HOROVOD_STALL_CHECK_DISABLE=1 beats HOROVOD_STALL_CHECK_TIME_SECONDS, as in Horovod).
_HOROVOD: dict[str, tuple[str, tuple[str, ...], Callable[[str], object]]] = {
    "HOROVOD_FUSION_THRESHOLD": ("an integer number of bytes",
                                 ("RINGFLOW_FUSION_THRESHOLD_BYTES",), _horovod_int),
    "HOROVOD_CYCLE_TIME": ("a number of milliseconds", ("RINGFLOW_CYCLE_TIME_MS",), float),
    "HOROVOD_CACHE_CAPACITY": ("an integer", ("RINGFLOW_CACHE_CAPACITY",), _horovod_int),
    "HOROVOD_TIMELINE": ("a file path", ("RINGFLOW_TIMELINE_PATH",), str),
    "HOROVOD_STALL_CHECK_DISABLE": ("0 or 1", _STALL_OFF, _horovod_flag),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("an integer number of seconds",
                                         ("RINGFLOW_STALL_WARNING_S",), _horovod_int),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("an integer number of seconds",
                                            ("RINGFLOW_STALL_SHUTDOWN_S",), _horovod_int),
    "HOROVOD_LOG_LEVEL": ("one of " + ", ".join(HOROVOD_LOG_LEVELS),
                          ("RINGFLOW_LOG_LEVEL",), _horovod_level),
    "HOROVOD_GLOO_TIMEOUT_SECONDS": ("an integer number of seconds", ("RINGFLOW_TIMEOUT_S",),
                                     _horovod_int),
    "HOROVOD_AUTOTUNE": ("0 or 1", ("RINGFLOW_AUTOTUNE",), _horovod_on),
    "HOROVOD_AUTOTUNE_LOG": ("a file path", ("RINGFLOW_AUTOTUNE_LOG_FILE",), str),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": ("an integer", ("RINGFLOW_AUTOTUNE_WARMUP_SAMPLES",),
                                        _horovod_int),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": ("an integer", ("RINGFLOW_AUTOTUNE_STEPS_PER_SAMPLE",),
                                          _horovod_int),
}

#: Horovod variables without a ringflow meaning -> why, said when they are turned on (> 0).
_HOROVOD_UNUSED = {
    "HOROVOD_HIERARCHICAL_ALLREDUCE": (
        "ringflow picks the hierarchical allreduce itself (shared memory within each host, "
        "a ring across hosts) whenever every host runs the same number of ranks"),
    "HOROVOD_HIERARCHICAL_ALLGATHER": (
        "ringflow's allgather is a ring over all ranks; there is no hierarchical variant"),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": (
        "ringflow's autotuner is a coordinate search, not Bayesian optimisation "
        "(RINGFLOW_AUTOTUNE_STEPS_PER_SAMPLE sets its sample length)"),
    "HOROVOD_TIMELINE_MARK_CYCLES": (
        "ringflow has no cycles to mark (negotiation is event-driven); the timeline is "
        "written without them"),
}


@dataclasses.dataclass(frozen=True)
class HorovodEnv:
    """What :func:`read_horovod_env` made of an environment's ``HOROVOD_*`` variables."""

    #: ``RINGFLOW_*`` values read from Horovod variables (only where no RINGFLOW_* is set).
    values: dict[str, str]
    #: RINGFLOW_* variable -> the Horovod variable its value came from.
    sources: dict[str, str]
    #: One line per Horovod variable read: ``"HOROVOD_X=v read as RINGFLOW_Y=w"``.
    read: tuple[str, ...] = ()
    #: One line per Horovod variable that a set RINGFLOW_* variable overrides.
    ignored: tuple[str, ...] = ()
    #: One line per Horovod variable turned on that has no ringflow meaning, saying why.
    unused: tuple[str, ...] = ()


def read_horovod_env(environ: Mapping[str, str] | None = None) -> HorovodEnv:
    """Horovod's tuning variables of ``environ`` (default ``os.environ``) as ``RINGFLOW_*`` values.

    A ``RINGFLOW_*`` variable set in ``environ`` wins over the Horovod one; one equal to what the
    Horovod one means is not reported at all (ringflow-run passes what it read on that way).

    Raises:
        ConfigError: a Horovod variable's value is not what Horovod expects there (the message
            names the variable, the expected form and the RINGFLOW_* variable it is read as).
    """
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    read: list[str] = []
    ignored: list[str] = []
    for name, (form, targets, convert) in _HOROVOD.items():
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = convert(raw)
        except ValueError:
            raise ConfigError(
                f"{name}={raw!r} is not {form} (Horovod's meaning; ringflow reads it as "
                f"{', '.join(targets)}); fix or unset it"
            ) from None
        if value is False or (name == "HOROVOD_TIMELINE" and raw.strip() in ("DYNAMIC",
                                                                             "DISABLED")):
            continue  # Horovod's "off": nothing to read
        text = "0" if value is True else str(value)
        used: list[str] = []
        overridden: list[str] = []
        for var in targets:
            set_to = env.get(var)
            if set_to:
                if not _same(var, set_to, text):
                    overridden.append(f"{var}={set_to}")
            elif var not in values:
                values[var] = text
                sources[var] = name
                used.append(f"{var}={text}")
        if used:
            read.append(f"{name}={raw} read as {', '.join(used)}")
        if overridden:
            ignored.append(f"{name}={raw} is ignored: {', '.join(overridden)} is set")
    unused = [f"{name}={env[name]} has no effect: {why}"
              for name, why in _HOROVOD_UNUSED.items() if _horovod_flag(env.get(name, ""))]
    return HorovodEnv(values, sources, tuple(read), tuple(ignored), tuple(unused))


def _same(var: str, a: str, b: str) -> bool:
    field = var[len("RINGFLOW_"):].lower()
    try:
        return _parse(field, a) == _parse(field, b)
    except ConfigError:
        return False


def _warn_unknown(env: Mapping[str, str]) -> None:
    for key in env:
        if key.startswith("RINGFLOW_") and key not in _KNOWN:
            close = difflib.get_close_matches(key, sorted(_KNOWN), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            log.warning("unknown variable %s is ignored%s", key, hint)
