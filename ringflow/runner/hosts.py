"""Host lists and rank assignment for ``ringflow-run``.

``-H host1:2,host2:2`` is parsed by :func:`parse_hosts` into ``[Host("host1", 2), Host("host2",
2)]`` (a host without ``:slots`` has one slot; IPv6 literals go in brackets, ``[::1]:2``).
:func:`assign_ranks` fills the hosts in order, slot by slot: ranks ``0..s0-1`` on the first host,
the next ``s1`` on the second, and so on, until ``np`` ranks are placed. Hosts that receive no rank
are not part of the job. For each rank it computes ``local_rank`` / ``local_size`` (its index
among, and the count of, the ranks on its host) and ``cross_rank`` / ``cross_size`` (its host's
index among, and the count of, the hosts used). More ranks than slots is an error raised before
anything starts: ``-np`` is honoured exactly, never silently reduced or oversubscribed.

:func:`parse_hostfile` reads horovodrun's / Open MPI's host file: one ``HOST [slots=N]`` per line
(``HOST:N`` is accepted too), ``#`` starts a comment, blank lines are skipped. A line that is none
of these is rejected with its file name and line number.
"""

from __future__ import annotations

import dataclasses
import re
import socket

from ..errors import LaunchError

__all__ = ["Host", "WorkerSpec", "assign_ranks", "is_local", "parse_hostfile", "parse_hosts"]

_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclasses.dataclass(frozen=True)
class Host:
    """A host name and how many ranks it may run."""

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One rank's placement; what the launcher turns into the worker's ``RINGFLOW_*`` variables."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str


_ENTRY = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<name>[^:\[\]]+))(?::(?P<slots>[^:]*))?$")


def parse_hosts(spec: str) -> list[Host]:
    """Parse ``"host1:2,host2,[::1]:4"``.

    Raises:
        LaunchError: an empty entry or name, slots that are not a positive integer, or a host named
            twice; the message names the entry and shows the expected form.
    """
    hosts: list[Host] = []
    seen: set[str] = set()
    for entry in spec.split(","):
        entry = entry.strip()
        match = _ENTRY.match(entry)
        if not entry or match is None:
            raise LaunchError(
                f"host entry {entry!r} in -H {spec!r} is not valid; expected HOST[:SLOTS] "
                "separated by commas, e.g. -H host1:2,host2:2"
            )
        name = match.group("v6") or match.group("name").strip()
        raw = match.group("slots")
        if raw is None:
            slots = 1
        else:
            try:
                slots = int(raw)
            except ValueError:
                slots = 0
            if slots < 1:
                raise LaunchError(
                    f"host entry {entry!r} in -H {spec!r} has slots {raw!r}; expected a positive "
                    f"integer, e.g. {name}:2"
                )
        if name in seen:
            raise LaunchError(
                f"host {name!r} appears twice in -H {spec!r}; "
                "list it once with the sum of its slots"
            )
        seen.add(name)
        hosts.append(Host(name, slots))
    return hosts


_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+?)(?:\s+slots\s*=\s*(?P<slots>\S+))?$")


def parse_hostfile(path: str) -> list[Host]:
    """Parse a host file: ``HOST slots=N`` (or ``HOST:N``, or ``HOST`` for one slot) per line.

    Raises:
        LaunchError: the file cannot be read, lists no host, or has a line that is not one of the
            forms above (the message names the file, the line number and the line), or names a
            host twice.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LaunchError(f"cannot read --hostfile {path!r}: {exc}") from exc
    hosts: list[Host] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path!r} line {number} ({raw.strip()!r})"
        match = _HOSTFILE_LINE.match(line)
        host = match.group("host") if match else ""
        slots = match.group("slots") if match else None
        if match is None or (slots is not None and ":" in host and not host.startswith("[")):
            raise LaunchError(
                f"{where} is not valid; expected 'HOST slots=N' (or 'HOST:N' or 'HOST'), "
                "e.g. 'node1 slots=4'"
            )
        try:
            (parsed,) = parse_hosts(host if slots is None else f"{host}:{slots}")
        except LaunchError as exc:
            raise LaunchError(f"{where}: {exc}") from None
        if any(h.name == parsed.name for h in hosts):
            raise LaunchError(
                f"{where} names host {parsed.name!r} a second time; list it once with the sum "
                "of its slots"
            )
        hosts.append(parsed)
    if not hosts:
        raise LaunchError(f"--hostfile {path!r} lists no host; add lines such as 'node1 slots=4'")
    return hosts


def assign_ranks(hosts: list[Host], np: int) -> list[WorkerSpec]:
    """Place ``np`` ranks on ``hosts`` host by host; returns the specs in rank order.

    Raises:
        LaunchError: ``np < 1``, or more ranks than the hosts have slots.
    """
    if np < 1:
        raise LaunchError(f"-np {np} is not a valid number of processes; expected -np >= 1")
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise LaunchError(
            f"-np {np} asks for more processes than the {total} slots of -H {listed}; "
            f"lower -np or add slots to -H"
        )
    counts: list[tuple[str, int]] = []
    left = np
    for host in hosts:
        if left == 0:
            break
        take = min(host.slots, left)
        counts.append((host.name, take))
        left -= take
    specs: list[WorkerSpec] = []
    for cross_rank, (name, count) in enumerate(counts):
        for local_rank in range(count):
            specs.append(
                WorkerSpec(len(specs), np, local_rank, count, cross_rank, len(counts), name)
            )
    return specs


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine (so a worker there starts without ssh)."""
    return host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())
