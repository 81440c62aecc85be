"""Harnesses that run the ranks of a test: :func:`run_ranks` and :func:`run_engines` (threads
of this process), :func:`spawn_ranks` (processes running a plain function), and
:func:`run_commands` (processes started as commands: ``ringflow-run``, torchrun, mpirun, a
script). Every test that starts processes does so through one of the last two.

``run_ranks(n, fn)`` starts ``n`` daemon threads; thread ``r`` builds the transport of rank ``r``
and calls ``fn(t, *args)``. ``run_engines(n, fn)`` does the same with a whole
:class:`~ringflow.engine.Engine` per rank over one loopback world, and calls ``fn(r, rf,
*args)``, where ``rf`` is ringflow's public API acting for rank ``r`` (:class:`EngineRank`).
Contract (both):

- Returns the ``n`` results in rank order once every rank has returned.
- The first exception on any rank aborts every rank -- loopback: ``world.abort``; tcp: every
  rank's transport is closed -- so ranks blocked on the failed one are released instead of
  hanging, and is re-raised as :class:`~ringflow.errors.RankFailure` naming that rank, with the
  exception type, message and traceback, chained from the original. Failures that the abort
  itself causes on the other ranks are not reported.
- Past ``deadline`` seconds, the lowest unfinished rank is reported as a RankFailure ("did not
  finish within ...", with the stack it is stuck in) and every rank is aborted.
- Each rank closes its own transport (``run_engines``: shuts its engine down, which says
  goodbye) when ``fn`` returns (all ranks concurrently, as processes would at exit); after a
  failure the harness closes them all. Closing is bounded in time, so a transport whose
  ``close`` hangs cannot hang the test run.

Transports: ``"loopback"`` (one :class:`~ringflow.transport.loopback.LoopbackWorld`) or ``"tcp"``
(real sockets on this host, through ``ringflow.transport.create("tcp", rank, n, store, config)``
with a shared :class:`ringflow.rendezvous.MemoryStore`). Their per-operation timeouts are twice
the deadline, so a hang is always reported by the deadline.

Engines (``run_engines``): each rank's :class:`~ringflow.engine.Engine` runs on
``world.transport(r)`` with the ring allreduce (``Backends(transport, (Ring(),))``; with
``shm=True`` shared memory first, as for processes of one host) and ``config`` (default:
``Config()`` with ``timeout_s`` twice the deadline; the environment is not read). The rank's
thread is bound to its engine (:func:`ringflow.runtime.bound`) while ``fn`` runs, so
``ringflow.rank()``, ``ProcessSet.included()`` and the collectives called on it act for that
rank; ``rf`` binds every call it makes, so it works on any thread (done-callbacks run on the
engine's threads). ``ringflow.get_client()`` is one in-memory store shared by the ranks.

Commands (``run_commands(commands, env=, cwd=, timeout=, check=)``), for tests whose subject is
a launcher or a script, or whose ranks are started by one. Contract:

- Every command starts at once, each in a session (and process group) of its own, with stdin
  from /dev/null; all share one deadline, ``timeout`` seconds from the start.
- A command ends when its process has exited and its output is closed. Returns one
  :class:`CommandResult` per command, in order: ``args``, ``returncode``, ``stdout`` and
  ``stderr`` (``stderr`` is merged into ``stdout`` unless ``merge_stderr=False``; bytes that are
  not UTF-8 are replaced), ``killed`` (why the harness killed it, else empty).
- At the deadline, every command's process group that has not ended is killed (SIGKILL to the
  group: the command and everything it started that stayed in its group), and the call raises
  :class:`CommandFailure`, whatever ``check`` says: a hang always fails the test. With ``check``
  (the default), a command that exits non-zero fails the call too, and gets the others' groups
  killed at once (they are usually its peers, waiting for it); without it, every command runs
  to its end and its exit code is the caller's to judge. A command that exited on its own is
  never killed, nor what it left behind in its group (tests of orphans need to see that),
  unless its output is still open at the deadline. A process that left its group (a new
  session) is out of reach: if it holds a command's output open, the call fails at the deadline
  with the output read until then. The failure's message shows every command's exit code or why
  it was killed, and the end of its output.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .config import Config
from .errors import ConfigError, PeerError, RankFailure, RingflowError
from .transport import Transport, create
from .transport.loopback import LoopbackWorld

__all__ = [
    "CommandFailure",
    "CommandResult",
    "EngineRank",
    "free_port",
    "run_commands",
    "run_engines",
    "run_ranks",
    "spawn_ranks",
]

# After an abort, how long (at most, and never longer than the deadline) run_ranks waits for the
# released threads to return before it raises anyway (they are daemon threads; a rank stuck
# outside ringflow cannot be interrupted).
_JOIN_GRACE_S = 5.0
# Transport and store timeouts are a multiple of the deadline, so that a stuck test is reported
# by the deadline (with the stack of the stuck rank), not by whichever rank's timeout fires first.
_OP_TIMEOUT_FACTOR = 2.0
# How long closing the transports may take in all (tcp lingers up to 2 s for goodbyes).
_CLOSE_WAIT_S = 10.0


class _Closable(Protocol):
    def close(self) -> None: ...


class _Run:
    """Shared state of one harness call; every field is guarded by ``cond``."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.results: list[Any] = [None] * n
        self.finished = [False] * n
        self.ranks: list[_Closable | None] = [None] * n  # what each rank closes at the end
        self.failure: tuple[int, BaseException, str] | None = None
        self.aborted = False


def run_ranks(
    n: int,
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    deadline: float = 60.0,
    transport: str = "loopback",
) -> list[Any]:
    """Run ``fn(t, *args)`` on ``n`` ranks as threads; return the results in rank order.

    Raises RankFailure for the first rank that raised or, past ``deadline``, for the lowest rank
    that did not finish; every rank is aborted first.
    """
    if n < 1:
        raise ConfigError(f"run_ranks needs at least 1 rank, got n={n}")
    store = None
    if transport == "loopback":
        world = LoopbackWorld(n, timeout=_OP_TIMEOUT_FACTOR * deadline)

        def make(rank: int) -> Transport:
            return world.transport(rank)

        def abort(exc: BaseException) -> None:
            world.abort(exc)

    elif transport == "tcp":
        from .rendezvous import MemoryStore  # written alongside the tcp transport

        store = MemoryStore(_OP_TIMEOUT_FACTOR * deadline)
        config = Config(timeout_s=_OP_TIMEOUT_FACTOR * deadline)

        def make(rank: int) -> Transport:
            return create("tcp", rank, n, store, config)

        def abort(exc: BaseException) -> None:
            store.close()  # releases ranks still in the rendezvous; transports are closed below
    else:
        raise ConfigError(
            f"run_ranks supports transport='loopback' or 'tcp', got {transport!r}"
        )

    return _run(n, make, lambda t: fn(t, *args), abort, deadline, store)


class EngineRank:
    """What ``fn`` of :func:`run_engines` gets: one rank of the in-process job.

    ``rf.<name>`` for a name of ``ringflow.__all__`` is ringflow's public API acting for this
    rank: functions (``rf.allreduce(x, name="g", op=rf.Sum)``, ``rf.rank()``,
    ``rf.add_process_set([0, 1])``, ``rf.join()``, ``rf.stats()``, ``rf.shutdown()``, ...) run
    bound to this rank's engine on whichever thread calls them; classes and constants
    (``rf.Sum``, ``rf.ProcessSet``, ``rf.Compression``) are ringflow's own. Two more attributes:
    ``engine`` (this rank's :class:`~ringflow.engine.Engine`, None once shut down) and ``world``
    (the shared :class:`~ringflow.transport.loopback.LoopbackWorld`, with its message counts).
    """

    def __init__(self, rank: int, world: LoopbackWorld, binding: Any) -> None:
        self.world = world
        self._rank = rank
        self._binding = binding

    @property
    def engine(self) -> Any:
        return self._binding.engine

    def __getattr__(self, name: str) -> Any:
        import ringflow

        if name not in ringflow.__all__:
            raise AttributeError(f"ringflow has no public name {name!r} (see ringflow.__all__)")
        value = getattr(ringflow, name)
        if not inspect.isfunction(value):
            return value
        from .runtime import bound

        binding = self._binding

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            with bound(binding):
                return value(*args, **kwargs)

        return call

    def close(self) -> None:
        """Shut this rank's engine down (a goodbye to the others); idempotent."""
        self.shutdown()

    def __repr__(self) -> str:
        return f"EngineRank(rank={self._rank}, size={self.world.size})"


def run_engines(
    n: int,
    fn: Callable[..., Any],
    config: Config | None = None,
    *,
    args: Sequence[Any] = (),
    deadline: float = 60.0,
    shm: bool = False,
) -> list[Any]:
    """Run ``fn(rank, rf, *args)`` on ``n`` ranks, each a thread with its own
    :class:`~ringflow.engine.Engine` over one loopback world; return the results in rank order.

    ``rf`` is the rank's :class:`EngineRank`. ``config`` applies to every engine (default:
    ``Config(timeout_s=2 * deadline)``). Allreduces of the global set run on the ring, or with
    ``shm`` on :class:`~ringflow.algorithms.shm.ShmAllreduce` (as for processes on one host;
    the ring stays for process sets). Every engine is shut down before this returns.

    Raises:
        RankFailure: the first rank that raised or, past ``deadline``, the lowest rank that did
            not finish (every rank is aborted first: the engines' pending operations fail).
        ConfigError: ``n < 1``.
    """
    from .algorithms.shm import ShmAllreduce
    from .backends import Backends, Ring, SharedMemory
    from .client import Client
    from .engine import Engine
    from .lane import TSO
    from .rendezvous import MemoryStore
    from .runtime import Binding, bound
    from .topology import RankInfo

    if n < 1:
        raise ConfigError(f"run_engines needs at least 1 rank, got n={n}")
    timeout = _OP_TIMEOUT_FACTOR * deadline
    config = config if config is not None else Config(timeout_s=timeout)
    world = LoopbackWorld(n, timeout=timeout)
    store = MemoryStore(timeout)
    client = Client(store)
    host = socket.gethostname()

    def make(rank: int) -> EngineRank:
        t = world.transport(rank)
        if shm:
            local = ShmAllreduce(rank, n, store, "engines/", timeout, t.check_peers)
            lane = local.open_lane() if TSO else None
            backends = Backends(t, (SharedMemory(local), Ring()), local, lane)
        else:
            backends = Backends(t, (Ring(),))
        try:
            engine = Engine(rank, n, backends, config)
        except BaseException:
            backends.close(linger=0)
            raise
        info = RankInfo(rank, n, rank, n, 0, 1, host, detector="threads")
        return EngineRank(rank, world, Binding(engine, info, client))

    def call(rf: EngineRank) -> Any:
        with bound(rf._binding):
            return fn(rf._rank, rf, *args)

    def abort(exc: BaseException) -> None:
        world.abort(exc)
        store.close()  # releases ranks still setting up (shared memory) or in user_get

    return _run(n, make, call, abort, deadline, store)


def _run(n: int, make: Callable[[int], _Closable], call: Callable[[Any], Any],
         abort: Callable[[BaseException], None], deadline: float, store: Any = None) -> list[Any]:
    """The machinery of both harnesses: rank ``r``'s thread runs ``call(make(r))`` and closes
    what ``make`` returned; the first failure or the deadline aborts every rank."""
    run = _Run(n)

    def body(rank: int) -> None:
        try:
            t = make(rank)
            with run.cond:
                run.ranks[rank] = t
                late = run.aborted
            if late:  # the abort closed the others before this one existed
                t.close()
                raise PeerError(f"rank {rank}: the test was aborted while it was connecting")
            result = call(t)
            # Each rank closes its own transport when done, as a process would at exit; the
            # ranks close concurrently, so a transport that lingers for its peers' goodbyes
            # waits once, not once per rank.
            t.close()
        except BaseException as exc:
            text = traceback.format_exc()
            with run.cond:
                if run.failure is None and not run.aborted:
                    run.failure = (rank, exc, text)
                run.finished[rank] = True
                run.cond.notify_all()
            return
        with run.cond:
            run.results[rank] = result
            run.finished[rank] = True
            run.cond.notify_all()

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"ringflow-rank-{rank}", daemon=True)
        for rank in range(n)
    ]
    for thread in threads:
        thread.start()

    end = time.monotonic() + deadline
    with run.cond:
        while run.failure is None and not all(run.finished):
            left = end - time.monotonic()
            if left <= 0:
                break
            run.cond.wait(left)
        failure = run.failure
        stuck = None if failure or all(run.finished) else run.finished.index(False)
        run.aborted = failure is not None or stuck is not None
        ranks = list(run.ranks)

    error: RankFailure | None = None
    cause: BaseException | None = None
    if failure is not None:
        rank, cause, text = failure
        error = RankFailure(rank, f"{type(cause).__name__}: {cause}\n{text}")
        reason = f"rank {rank} failed ({type(cause).__name__}: {cause})"
    elif stuck is not None:
        frame = sys._current_frames().get(threads[stuck].ident or -1)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(exited)\n"
        error = RankFailure(
            stuck,
            f"did not finish within {deadline:g}s; raise deadline= if the test is slow, else "
            f"look for a collective that this rank and its peers do not both call. "
            f"It was at:\n{where}",
        )
        reason = f"rank {stuck} did not finish within {deadline:g}s"

    if error is not None:
        abort(PeerError(f"{reason}; the test harness aborted every rank"))
        _close_all(ranks)
        grace_end = time.monotonic() + min(_JOIN_GRACE_S, deadline)
        for thread in threads:
            thread.join(max(0.0, grace_end - time.monotonic()))
    else:
        for thread in threads:  # each has closed its own; let it return before we do
            thread.join(_CLOSE_WAIT_S)
    with run.cond:
        ranks = list(run.ranks)
    _close_all(ranks)  # idempotent for those the ranks closed themselves
    if store is not None:
        store.close()
    if error is not None:
        raise error from cause
    return run.results


def _close_all(ranks: Sequence[_Closable | None]) -> None:
    """Close the ranks' transports (or engines) concurrently, waiting at most ``_CLOSE_WAIT_S``
    for all of them.

    Concurrently because a transport may linger in ``close`` for its peers' goodbyes; bounded
    because a transport whose ``close`` hangs must not hang the test run (the close threads are
    daemons and their errors are ignored: the ranks' outcome is already known).
    """

    def close(t: _Closable) -> None:
        with contextlib.suppress(Exception):
            t.close()

    closers = [
        threading.Thread(target=close, args=(t,), name="ringflow-close", daemon=True)
        for t in ranks
        if t is not None
    ]
    for thread in closers:
        thread.start()
    end = time.monotonic() + _CLOSE_WAIT_S
    for thread in closers:
        thread.join(max(0.0, end - time.monotonic()))


# --- spawn_ranks (processes) -------------------------------------------------------------------
# spawn_ranks is ringflow.run (ringflow.runner.pyrun) with a test deadline: one implementation.


def spawn_ranks(
    n: int, fn: Callable[..., Any], *, args: tuple[Any, ...] = (), deadline: float = 120.0
) -> list[Any]:
    """Run ``fn(*args)`` in ``n`` processes, one per rank; return the results in rank order.

    The processes are started by :func:`ringflow.run` (through
    :func:`ringflow.runner.launch.run_job`), as ``ringflow-run -np n`` would start them: each has
    the full ``RINGFLOW_*`` environment contract (rank, size, rendezvous store, secret), so ``fn``
    can call ``ringflow.init()``. ``fn``, ``args`` and the return values travel pickled through the
    job's store; the workers get this process's ``sys.path`` and working directory. Output is
    relayed prefixed ``[rank]:``.

    Raises:
        RankFailure: the first rank whose ``fn`` raised (message: ``"<type>: <msg>"`` and the
            remote traceback) or whose process died; every other rank is killed first. When
            ``deadline`` seconds pass, every rank is killed and the lowest unfinished rank is named.
        ConfigError: ``n < 1``, or ``fn`` / ``args`` cannot be pickled.
    """
    from .runner.pyrun import run

    if n < 1:
        raise ConfigError(f"spawn_ranks(n={n}) needs at least one rank; pass n >= 1")
    return run(fn, args, np=n, timeout=deadline)


def free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 now, for a launcher that needs a fixed one
    (torchrun's endpoint, ``MASTER_PORT``). Another process may take it before it is used."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- run_commands (processes started as commands) ----------------------------------------------

# How much of each command's output a CommandFailure shows (its end: where the error is).
_SHOWN_CHARS = 8000
# After a kill, how long the output readers may take to see end-of-file (a process that left the
# group keeps the pipe open; its output is then cut there).
_KILL_GRACE_S = 5.0
# How often the waiting loop looks at the processes; small next to any command's run time.
_POLL_S = 0.05


@dataclass(frozen=True)
class CommandResult:
    """How one command of :func:`run_commands` ended (the fields of
    :class:`subprocess.CompletedProcess`, plus ``killed``)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    #: Why run_commands killed it: ``""`` (it ended on its own), ``"deadline"`` (still running
    #: at the deadline) or ``"failure"`` (another command failed first, under ``check``).
    killed: str = ""

    @property
    def timed_out(self) -> bool:
        return self.killed == "deadline"

    @property
    def output(self) -> str:
        """``stdout`` then ``stderr``."""
        return self.stdout + self.stderr


class CommandFailure(RingflowError, RuntimeError):
    """A command of :func:`run_commands` exited non-zero or was killed; ``results`` holds every
    command's :class:`CommandResult`, and the message every output's end."""

    def __init__(self, results: Sequence[CommandResult], timeout: float) -> None:
        self.results = list(results)
        parts = []
        for i, r in enumerate(results):
            how = {"deadline": f"killed at the {timeout:g} s deadline",
                   "failure": "killed when another command failed"}.get(
                r.killed, f"exit code {r.returncode}")
            parts.append(f"--- command {i}: {' '.join(r.args)} ({how}) ---\n"
                         f"{r.output[-_SHOWN_CHARS:]}")
        failed = [i for i, r in enumerate(results)
                  if (r.returncode != 0 and r.killed != "failure") or r.timed_out]
        super().__init__(
            f"command {', '.join(map(str, failed))} of {len(results)} failed (raise timeout= if "
            f"the test is only slow); every command's output:\n" + "\n".join(parts))


class _Command:
    """One started command: its process and the threads reading its pipes."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None, cwd: str | None,
                 merge: bool) -> None:
        self.args = [str(a) for a in args]
        self.proc = subprocess.Popen(
            self.args, env=None if env is None else dict(env), cwd=cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE, start_new_session=True)
        self.chunks: tuple[list[bytes], list[bytes]] = ([], [])
        self.readers = [
            threading.Thread(target=self._read, args=(pipe, chunks), daemon=True,
                             name="ringflow-command-output")
            for pipe, chunks in zip((self.proc.stdout, self.proc.stderr), self.chunks,
                                    strict=True)
            if pipe is not None
        ]
        for reader in self.readers:
            reader.start()
        self.killed = ""

    @staticmethod
    def _read(pipe: Any, chunks: list[bytes]) -> None:
        # The reader closes its pipe itself: closing it from another thread while a read is
        # blocked (a process outside the group holds the pipe) would wait on the read's lock.
        with contextlib.suppress(OSError, ValueError), pipe:
            while data := pipe.read1(65536):
                chunks.append(data)

    def ended(self) -> bool:
        return self.proc.poll() is not None and not any(t.is_alive() for t in self.readers)

    def kill(self, why: str) -> None:
        """SIGKILL to the command's process group, unless it ended on its own."""
        if self.ended():
            return
        self.killed = self.killed or why
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def result(self) -> CommandResult:
        self.proc.wait()
        end = time.monotonic() + _KILL_GRACE_S
        for reader in self.readers:
            reader.join(max(0.0, end - time.monotonic()))
        out, err = (b"".join(c).decode(errors="replace") for c in self.chunks)
        return CommandResult(self.args, self.proc.returncode, out, err, self.killed)


def run_commands(
    commands: Sequence[Sequence[str]],
    *,
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120.0,
    check: bool = True,
    merge_stderr: bool = True,
) -> list[CommandResult]:
    """Run every command of ``commands`` (each an argv) at once under one deadline; return how
    each ended, in order (see the module doc for the contract).

    ``env``: the environment of every command, or a sequence of one per command (default: this
    process's). ``cwd``: the working directory of every command.

    Raises:
        CommandFailure: a command still running at the deadline, or with ``check`` one that
            exited non-zero (every command's group is killed first).
        ConfigError: no command, or a list of environments of another length.
    """
    if not commands:
        raise ConfigError("run_commands needs at least one command")
    envs: Sequence[Mapping[str, str] | None]
    if env is None or isinstance(env, Mapping):
        envs = [env] * len(commands)
    else:
        envs = env
        if len(envs) != len(commands):
            raise ConfigError(f"run_commands got {len(commands)} commands and {len(envs)} "
                              f"environments; pass one environment, or one per command")
    where = None if cwd is None else os.fspath(cwd)
    results = _run_commands(commands, envs, where, timeout, check, merge_stderr)
    failed = any(r.returncode != 0 for r in results)
    if (check and failed) or any(r.timed_out for r in results):
        raise CommandFailure(results, timeout)
    return results


def _run_commands(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str] | None],
                  cwd: str | None, timeout: float, check: bool,
                  merge: bool) -> list[CommandResult]:
    end = time.monotonic() + timeout
    started: list[_Command] = []
    try:
        for argv, env in zip(commands, envs, strict=True):
            started.append(_Command(argv, env, cwd, merge))
    except BaseException:  # a missing program: nothing started may outlive the call
        for c in started:
            c.kill("failure")
            c.result()
        raise
    while not all(c.ended() for c in started) and time.monotonic() < end:
        if check and any(c.proc.poll() not in (None, 0) for c in started):
            for c in started:
                if c.proc.poll() is None:
                    c.kill("failure")
        time.sleep(_POLL_S)
    for c in started:
        c.kill("deadline")  # only those that have not ended
    return [c.result() for c in started]
