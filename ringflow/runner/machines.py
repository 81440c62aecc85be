"""MegEngine's multi-machine launch: the same program on every machine (:func:`join`).

``@ringflow.launcher(world_size=W, n_gpus=n, rank_start=s, master_ip=ADDR, port=P)`` runs on
each machine, and on each it starts ``n`` ranks, ``s .. s+n-1`` of a job of ``W``. The machine
with ``rank_start=0`` is the *master*: its launcher serves the job's rendezvous store
(:class:`~ringflow.rendezvous.StoreServer`) on ``ADDR:P`` for the whole job, as MegEngine's
``Server`` does; every launcher (the master's too) is a client of it, and so are the workers.

The machine rendezvous, run by every launcher before it starts a worker (keys under ``mge/``):

1. Connect to ``ADDR:P`` (retrying a refused connection until ``start_timeout``: the machines
   start in any order) and authenticate with the job secret (HMAC, :mod:`ringflow.wire`).
2. The master has written its ``world_size`` (``mge/world_size``); another machine compares its
   own with it: a difference fails that machine, naming both values.
3. Claim each rank of its range: ``add("mge/rank/r", 1)``. A result above 1 means two machines
   claim rank ``r`` (overlapping ``rank_start`` / ``n_gpus``): the machine that finds it writes
   ``mge/error`` (every launcher polls it) and raises; the owner's name is in ``mge/owner/r``.
4. Take a machine number (``add("mge/machines", 1)``), describe itself under it (host name,
   ``rank_start``, ``n_gpus``), then add ``n`` to ``mge/ranks``.
5. Poll until ``mge/ranks`` is ``W`` (every rank claimed), ``mge/error`` is set, or
   ``start_timeout`` passes (the error lists the ranks nobody claimed). Then every machine
   reads every description and derives the same placement: machines ordered by ``rank_start``
   are hosts ``0 .. m-1`` (cross rank and size), and its ranks' local rank is ``r - s``.

Cost: ``n + 5`` round trips per machine, plus one per 50 ms of waiting and ``m`` to read the
descriptions. Each launcher then runs its workers as ``ringflow.run`` does (:mod:`.pyrun`), with
``RINGFLOW_RENDEZVOUS_ADDR/PORT`` naming the master's store; what the workers do there is
unchanged.

The end. A launcher adds its ``n`` to ``mge/done`` once it has read its ranks' outcomes. The
master keeps serving until ``mge/done`` reaches ``W`` (the other machines' workers and launchers
still use the store), and gives up on a machine whose launcher stopped beating
(``mge/beat/s``, every second, for :data:`LOST_S`), or after :data:`FAILED_WAIT_S` when its own
ranks failed (the others fail of it within seconds).

The secret. Every connection to the store proves knowledge of one secret, so the master accepts
only machines that hold it. A job of one machine draws a fresh one. A job of several needs the
same one on each: ``secret=`` (bytes, or hex text) or ``RINGFLOW_SECRET_FILE`` (a file holding it
as hex, mode 0600), else :class:`~ringflow.errors.ConfigError`. It is never taken from an
environment value (inherited by every child, printed by job schedulers) or a command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import AuthenticationError, ConfigError, LaunchError, RingflowError
from .hosts import WorkerSpec

__all__ = ["FAILED_WAIT_S", "LOST_S", "Machine", "join", "resolve_secret"]

log = logging.getLogger(__name__)

_PREFIX = "mge/"
_POLL_S = 0.05
#: How long the master keeps its store up for the other machines after its own ranks failed:
#: their ranks fail within ``timeout_s`` of a dead peer (30 s by default), their launchers then
#: read their outcomes.
FAILED_WAIT_S = 60.0
#: A machine whose launcher has not beaten for this long is taken for gone (beats every second).
LOST_S = 15.0
_BEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class Machine:
    """This machine's part of a MegEngine-style job (the launcher's arguments)."""

    world_size: int
    n: int
    rank_start: int
    master_ip: str
    port: int

    @property
    def master(self) -> bool:
        return self.rank_start == 0

    @property
    def alone(self) -> bool:
        """Whether this machine runs the whole job."""
        return self.n == self.world_size

    def check(self) -> Machine:
        """Raise ConfigError for arguments no job can have (MegEngine asserts or hangs)."""
        for name in ("world_size", "n", "rank_start", "port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"launcher({_arg(name)}={value!r}): expected an integer")
        if self.n < 1:
            raise ConfigError(f"launcher(n_gpus={self.n}): a machine runs at least one process")
        if self.world_size < 1:
            raise ConfigError(f"launcher(world_size={self.world_size}): expected >= 1")
        if self.rank_start < 0 or self.rank_start + self.n > self.world_size:
            raise ConfigError(
                f"launcher(rank_start={self.rank_start}, n_gpus={self.n}, world_size="
                f"{self.world_size}): this machine would run ranks {self.rank_start} to "
                f"{self.rank_start + self.n - 1}, but the job's ranks are 0 to "
                f"{self.world_size - 1}; give each machine the rank_start of its first process "
                "(0 on the master, the sum of the n_gpus of the machines before it elsewhere)"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"launcher(port={self.port}): expected a port number (0 to 65535)")
        if not self.alone and self.port == 0:
            raise ConfigError(
                f"launcher(world_size={self.world_size}, n_gpus={self.n}) spans several "
                "machines, which find the master's store at master_ip:port; pass port= a free "
                "port on the master, the same on every machine (MegEngine: 'you have to assign a "
                "port for distributed server')"
            )
        if not self.master_ip:
            raise ConfigError("launcher(master_ip=''): expected the master's address")
        return self


def _arg(name: str) -> str:
    return "n_gpus" if name == "n" else name


def resolve_secret(secret: bytes | str | None, machine: Machine,
                   environ: Mapping[str, str] | None = None) -> bytes:
    """The job secret: ``secret``, else ``RINGFLOW_SECRET_FILE``'s, else a fresh one for a job
    of one machine.

    Raises:
        ConfigError: a job of several machines without a secret, or one that cannot be read.
    """
    from .. import wire
    from ..rendezvous import read_secret

    env = os.environ if environ is None else environ
    if isinstance(secret, str):
        try:
            secret = bytes.fromhex(secret.strip())
        except ValueError:
            raise ConfigError("launcher(secret=...): a str secret must be hex text (or pass "
                              "bytes)") from None
    if secret is not None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ConfigError("launcher(secret=...): expected at least 16 bytes (or 32 hex "
                              "digits); draw one with secrets.token_hex(32)")
        return secret
    if env.get("RINGFLOW_SECRET_FILE"):
        return read_secret({"RINGFLOW_SECRET_FILE": env["RINGFLOW_SECRET_FILE"]})
    if machine.alone:
        return wire.new_secret()
    raise ConfigError(
        f"launcher(world_size={machine.world_size}, n_gpus={machine.n}) spans several machines, "
        "and the master accepts only machines that hold the job's secret: write one to a file "
        "readable only by you (python -c 'import secrets; print(secrets.token_hex(32))' > "
        "~/.ringflow_secret; chmod 600 ~/.ringflow_secret), copy it to every machine, and set "
        "RINGFLOW_SECRET_FILE to its path on each (or pass secret= to the launcher)"
    )


def bind_address(master_ip: str) -> str:
    """The address the master's store listens on: ``master_ip``'s, never every interface."""
    if master_ip in ("localhost", ""):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(master_ip)
    except OSError as exc:
        raise ConfigError(f"launcher(master_ip={master_ip!r}) does not resolve: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Joined:
    """What the machine rendezvous gives a launcher."""

    workers: list[WorkerSpec]
    master_port: int  # the workers' MASTER_PORT (the master reserved it)


class _Where:
    """The (host, port) that :func:`ringflow.runner.launch.run_job` takes for a store."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port


def join(machine: Machine, secret: bytes, start_timeout: float,
         run: Callable[[Any, Joined, tuple[bytes, Any]], Any]) -> Any:
    """Serve the store (master), take part in the machine rendezvous, then call
    ``run(store, joined, (secret, where))`` and keep the store up as the module doc says.

    Raises:
        ConfigError: the machines disagree (world size, overlapping ranks), the master cannot
            listen on ``master_ip:port``, or the secret differs from the master's.
        LaunchError: not every rank was claimed within ``start_timeout``; the master's store
            could not be reached.
    """
    from ..rendezvous import StoreServer, TCPStore

    server = None
    host = machine.master_ip
    if machine.master:
        host = bind_address(machine.master_ip)
        try:
            server = StoreServer(secret, host=host, port=machine.port, timeout=start_timeout)
        except ConfigError as exc:
            raise ConfigError(
                f"rank_start=0 makes this machine the master, whose store must listen on "
                f"master_ip:port = {machine.master_ip}:{machine.port}: {exc}; run it on the "
                "machine that has that address, with a free port"
            ) from exc
    port = server.port if server is not None else machine.port
    reserved = None
    try:
        try:
            store = TCPStore(host, port, secret, start_timeout)
        except AuthenticationError as exc:
            raise ConfigError(
                f"the master at {host}:{port} refused this machine's secret: every machine needs "
                "the same one (the same RINGFLOW_SECRET_FILE content, or secret=)"
            ) from exc
        except RingflowError as exc:
            raise LaunchError(
                f"cannot reach the master's store at {host}:{port} within {start_timeout:g} s "
                f"({exc}); start the machine with rank_start=0 on master_ip, or raise "
                "start_timeout"
            ) from exc
        with store:
            if machine.master:
                from .launch import reserve_port

                reserved = reserve_port()
                store.set(_PREFIX + "master_port", str(reserved.getsockname()[1]).encode())
                store.set(_PREFIX + "world_size", str(machine.world_size).encode())
            joined = _rendezvous(store, machine, start_timeout)
            beat = _Beat(store, machine) if not machine.master else None
            ok = False
            try:
                result = run(store, joined, (secret, _Where(host, port)))
                ok = True
                return result
            finally:
                with contextlib.suppress(RingflowError, OSError):
                    store.add(_PREFIX + "done", machine.n)
                if beat is not None:
                    beat.stop()
                if server is not None:
                    _serve_until_done(store, machine, ok)
    finally:
        if reserved is not None:
            reserved.close()
        if server is not None:
            server.close()


def _fail(store: Any, text: str) -> ConfigError:
    with contextlib.suppress(RingflowError, OSError):
        store.set(_PREFIX + "error", text.encode())
    return ConfigError(text)


def _rendezvous(store: Any, machine: Machine, timeout: float) -> Joined:
    me = f"{socket.gethostname()} (rank_start={machine.rank_start}, n_gpus={machine.n})"
    if not machine.master:
        try:
            theirs = int(store.get(_PREFIX + "world_size", timeout))
        except RingflowError as exc:
            raise LaunchError(f"the master did not say its world_size within {timeout:g} s "
                              f"({exc})") from exc
        if theirs != machine.world_size:
            raise _fail(store, f"the machines disagree on world_size: the master has "
                        f"{theirs}, {me} has {machine.world_size}; pass the same world_size on "
                        "every machine")
    ranks = range(machine.rank_start, machine.rank_start + machine.n)
    for r in ranks:
        if store.add(f"{_PREFIX}rank/{r}", 1) > 1:
            owner = "another machine"
            with contextlib.suppress(RingflowError):
                owner = store.get(f"{_PREFIX}owner/{r}", 5.0).decode()
            raise _fail(store, f"rank {r} is claimed by two machines: {owner} and {me}; the "
                        "ranks of the machines must not overlap (the rank_start of a machine is "
                        "the sum of the n_gpus of the machines before it)")
        store.set(f"{_PREFIX}owner/{r}", me.encode())
    index = store.add(_PREFIX + "machines", 1) - 1
    store.set(f"{_PREFIX}machine/{index}", json.dumps(
        {"host": socket.gethostname(), "rank_start": machine.rank_start, "n": machine.n}).encode())
    store.add(_PREFIX + "ranks", machine.n)
    deadline = time.monotonic() + timeout
    while True:
        error = None
        with contextlib.suppress(RingflowError):
            error = store.get(_PREFIX + "error", 0.0).decode()
        if error is not None:
            raise ConfigError(error)
        if store.add(_PREFIX + "ranks", 0) >= machine.world_size:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(machine.world_size)
                       if store.add(f"{_PREFIX}rank/{r}", 0) == 0]
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            raise LaunchError(
                f"not every machine joined within {timeout:g} s: nobody runs ranks {shown} of "
                f"world_size={machine.world_size}; start the launcher on the missing machines "
                "(with their rank_start), check world_size, or raise start_timeout"
            )
        time.sleep(_POLL_S)
    machines = [json.loads(store.get(f"{_PREFIX}machine/{i}", timeout))
                for i in range(store.add(_PREFIX + "machines", 0))]
    machines.sort(key=lambda m: m["rank_start"])
    cross = [m["rank_start"] for m in machines].index(machine.rank_start)
    host = socket.gethostname()
    workers = [WorkerSpec(machine.rank_start + i, machine.world_size, i, machine.n, cross,
                          len(machines), host) for i in range(machine.n)]
    master_port = int(store.get(_PREFIX + "master_port", timeout))
    return Joined(workers, master_port)


class _Beat:
    """A machine's launcher beating in the master's store, so the master can tell it is there."""

    def __init__(self, store: Any, machine: Machine) -> None:
        self._store, self._key = store, f"{_PREFIX}beat/{machine.rank_start}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringflow-machine-beat",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(_BEAT_S):
            try:
                self._store.add(self._key, 1)
            except (RingflowError, OSError):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _serve_until_done(store: Any, machine: Machine, ok: bool) -> None:
    """The master: wait until every machine has read its outcomes (see the module doc)."""
    deadline = None if ok else time.monotonic() + FAILED_WAIT_S
    others = [json.loads(store.get(f"{_PREFIX}machine/{i}"))["rank_start"]
              for i in range(store.add(_PREFIX + "machines", 0))]
    others = [s for s in others if s != machine.rank_start]
    seen: dict[int, tuple[int, float]] = {}
    while store.add(_PREFIX + "done", 0) < machine.world_size:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            log.warning("the master stops serving before every machine finished (its own ranks "
                        "failed %g s ago)", FAILED_WAIT_S)
            return
        for start in others:
            count = store.add(f"{_PREFIX}beat/{start}", 0)
            if seen.get(start, (None, 0.0))[0] != count:
                seen[start] = (count, now)
            elif now - seen[start][1] > LOST_S:
                log.warning("the launcher of the machine with rank_start=%d stopped beating "
                            "%g s ago; the master stops serving", start, LOST_S)
                return
        time.sleep(_POLL_S * 4)
