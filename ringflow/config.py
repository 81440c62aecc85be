"""One frozen :class:`Config`, the only reader of the ``RINGFLOW_*`` tuning knobs.

Each field ``name`` is read from ``RINGFLOW_<NAME>``; ``ringflow-run`` flags set the same variables
for the workers, so a flag wins over the environment it was started from. Bad values raise
:class:`~ringflow.errors.ConfigError` naming the variable; an unknown ``RINGFLOW_*`` name logs a
warning with the closest known name.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["ENV_CONTRACT", "Config"]

log = logging.getLogger(__name__)

#: Variables of the launcher -> worker contract (DESIGN.md section 5); read by topology/rendezvous.
ENV_CONTRACT = (
    "RINGFLOW_RANK", "RINGFLOW_SIZE", "RINGFLOW_LOCAL_RANK", "RINGFLOW_LOCAL_SIZE",
    "RINGFLOW_CROSS_RANK", "RINGFLOW_CROSS_SIZE", "RINGFLOW_HOSTNAME",
    "RINGFLOW_RENDEZVOUS_ADDR", "RINGFLOW_RENDEZVOUS_PORT", "RINGFLOW_SECRET_FD",
    "RINGFLOW_SECRET_FILE", "RINGFLOW_JOB_ID", "RINGFLOW_LAUNCHER_PID",
)

_MIB = 1024 * 1024


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
    #: ``mpirun --bind-to core`` does). ``none`` leaves placement to the OS scheduler.
    bind_to: str = "none"

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
            "bind_to": self.bind_to in ("none", "core"),
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"{_env_name(name)}={getattr(self, name)!r} is out of range; "
                    f"the default is {_DEFAULTS[name]!r}"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build a Config from ``RINGFLOW_*`` variables; keyword ``overrides`` win."""
        env = os.environ if environ is None else environ
        _warn_unknown(env)
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(_env_name(field.name))
            if raw is None or raw == "":
                continue
            kind = type(_DEFAULTS[field.name])
            try:
                values[field.name] = kind(float(raw)) if kind is int else kind(raw)
            except ValueError as exc:
                raise ConfigError(
                    f"{_env_name(field.name)}={raw!r} is not a valid {kind.__name__}"
                ) from exc
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
_KNOWN = {*(f"RINGFLOW_{n.upper()}" for n in _DEFAULTS), *ENV_CONTRACT}


def _env_name(field: str) -> str:
    return f"RINGFLOW_{field.upper()}"


def _warn_unknown(env: Mapping[str, str]) -> None:
    for key in env:
        if key.startswith("RINGFLOW_") and key not in _KNOWN:
            close = difflib.get_close_matches(key, sorted(_KNOWN), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            log.warning("unknown variable %s is ignored%s", key, hint)
