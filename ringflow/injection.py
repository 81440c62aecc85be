"""Fault injection for tests: kill, stop or delay one rank at a named point of the protocol.

``RINGFLOW_FAULT`` holds one or more faults separated by ``;``, each a comma-separated list of
``key=value``::

    RINGFLOW_FAULT="rank=1,point=plan,action=kill,after=3"

* ``rank``: the global rank that acts (required);
* ``point``: where, one of :data:`POINTS` (required);
* ``action``: ``kill`` (SIGKILL to itself), ``stop`` (SIGSTOP: a frozen process), ``delay:S``
  (sleep ``S`` seconds on the thread that reached the point), ``exit:CODE`` (``os._exit``), or
  ``raise`` (a RuntimeError where the point is, as a bug there would);
* ``after``: how many times the point is passed before the fault acts (default 0: the first
  time); a fault acts once.
* ``size``: act only where the point concerns at least this many bytes (data points; default 0).

The points, in protocol order:

``init``            the transport and shared memory are connected, before the engine starts
``submit``          a rank is about to send its requests to the coordinator (or take them in,
                    on the coordinator)
``negotiate``       the coordinator received a submission and is about to plan
``plan``            a rank took in a plan (before executing any of it)
``data_start``      the engine thread starts the data plane of a plan item
``data_mid``        half-way through a data-plane collective (after the ring's reduce-scatter,
                    between the shared-memory barriers)
``data_end``        the data plane of an item is done, before its handles complete
``shm_growth``      a rank grows its shared-memory segments: its new one is created, not yet
                    mapped by the others (its name exists)
``shutdown``        ``shutdown()`` was called

Cost when unset: code at a point reads the module global :data:`ARMED` and calls nothing
(``if injection.ARMED: injection.hit(...)``). The variable is read by
:class:`~ringflow.config.Config` (``RINGFLOW_FAULT``) and armed by ``init()`` for this
process's rank; a bad specification is a ConfigError there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from .errors import ConfigError

__all__ = ["ARMED", "POINTS", "Fault", "arm", "disarm", "hit", "parse"]

log = logging.getLogger(__name__)

POINTS = ("init", "submit", "negotiate", "plan", "data_start", "data_mid", "data_end",
          "shm_growth", "shutdown")

#: Whether any fault is armed in this process (read at every point; the only cost when unset).
ARMED = False


@dataclasses.dataclass
class Fault:
    rank: int
    point: str
    action: str
    after: int = 0
    size: int = 0
    seen: int = 0
    done: bool = False


_faults: list[Fault] = []
_lock = threading.Lock()


def parse(spec: str) -> list[Fault]:
    """The faults of a ``RINGFLOW_FAULT`` value. Raises ConfigError naming what is wrong."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields: dict[str, str] = {}
        for item in part.split(","):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in ("rank", "point", "action", "after", "size"):
                raise ConfigError(f"RINGFLOW_FAULT: {item!r} is not one of rank=, point=, "
                                  f"action=, after=, size= (in {part!r})")
            fields[key.strip()] = value.strip()
        if "rank" not in fields or "point" not in fields:
            raise ConfigError(f"RINGFLOW_FAULT: {part!r} needs rank= and point=")
        if fields["point"] not in POINTS:
            raise ConfigError(f"RINGFLOW_FAULT: point {fields['point']!r} is not one of {POINTS}")
        action = fields.get("action", "kill")
        kind, _, arg = action.partition(":")
        try:
            if kind == "delay":
                float(arg)
            elif kind == "exit":
                int(arg)
            elif kind not in ("kill", "stop", "raise") or arg:
                raise ValueError(action)
            fault = Fault(int(fields["rank"]), fields["point"], action,
                          int(fields.get("after", "0")), int(fields.get("size", "0")))
        except ValueError:
            raise ConfigError(
                f"RINGFLOW_FAULT: {part!r}: rank, after and size are integers; action is kill, "
                "stop, raise, delay:SECONDS or exit:CODE") from None
        faults.append(fault)
    return faults


def arm(spec: str, rank: int) -> None:
    """Arm the faults of ``spec`` that belong to ``rank`` (replacing any armed before)."""
    global ARMED
    mine = [f for f in parse(spec) if f.rank == rank]
    with _lock:
        _faults[:] = mine
        ARMED = bool(mine)


def disarm() -> None:
    global ARMED
    with _lock:
        _faults.clear()
        ARMED = False


def hit(point: str, nbytes: int = 0) -> None:
    """``point`` is reached (concerning ``nbytes`` bytes): act if an armed fault says so."""
    with _lock:
        todo = None
        for f in _faults:
            if f.point == point and not f.done and nbytes >= f.size:
                if f.seen >= f.after:
                    f.done = True
                    todo = f
                    break
                f.seen += 1
    if todo is None:
        return
    # The wall-clock time lets a test measure how long the other ranks took to notice.
    log.warning("ringflow fault injection at %.3f: rank %d, point %s: %s", time.time(),
                todo.rank, point, todo.action)
    kind, _, arg = todo.action.partition(":")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "delay":
        time.sleep(float(arg))
    elif kind == "exit":
        os._exit(int(arg))
    else:
        raise RuntimeError(f"fault injected at {point} (RINGFLOW_FAULT)")
