"""Start, supervise and stop the workers of one job, on this host and over ssh.

Over 600 lines on purpose: the launcher-to-worker contract (the environment) and the whole
life of a local job (start, relay, supervise, stop, root cause) are one state machine, and
split apart their shared state (processes, pipes, exits) would travel through every call.

:func:`run_job` is the whole life of a job: it generates a secret, starts a rendezvous
``StoreServer`` (on 127.0.0.1 when every host is this machine: a single-host job never listens
beyond loopback; else on the address the other hosts route to, see :mod:`.netif`), starts one
process per :class:`~ringflow.runner.hosts.WorkerSpec` with the environment contract of DESIGN.md
section 5, relays their output, and waits. ``ringflow-run`` (:mod:`ringflow.runner.cli`),
``ringflow.run`` (:mod:`ringflow.runner.pyrun`) and :func:`ringflow.testing.spawn_ranks` call it.

A worker on another host is an ``ssh`` process running the remote bootstrap
(:mod:`.ssh`, :mod:`.remote`); to the launcher it is a local child like any other: its output is
relayed, its exit status is the remote worker's (a remote status above 128 is read as the signal
``status - 128``, 255 is ssh's own failure), and stopping it (SIGTERM to the ssh process) closes
the connection, which makes the remote bootstrap stop the worker.

Each worker
    * runs ``command`` as given (an argv list, never through a shell), with ``stdin`` from
      ``/dev/null``;
    * gets ``os.environ`` (or ``base_env``) plus ``RINGFLOW_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE,
      _CROSS_RANK, _CROSS_SIZE, _HOSTNAME, _RENDEZVOUS_ADDR, _RENDEZVOUS_PORT, _JOB_ID,
      _LAUNCHER_PID``, ``GLIBC_TUNABLES`` with :data:`MEMCPY_TUNABLE` added (unless that tunable
      is set already), a worker on this host the thread counts of :mod:`ringflow.threads`
      (``OMP_NUM_THREADS``, ... and ``RINGFLOW_THREADS``; a remote worker gets them from its
      bootstrap, decided on its host), and ``RINGFLOW_SECRET_FD``: the number of an inherited
      pipe from which it reads the secret as hex text and a newline (``RINGFLOW_LAUNCHER_PID``
      is its parent's pid: its supervisor's). The secret is never in an argv, an environment
      value, or a log line;
    * also gets torchrun's variables (:data:`TORCHRUN_ENV`): ``RANK, LOCAL_RANK, WORLD_SIZE,
      LOCAL_WORLD_SIZE``, ``GROUP_RANK, GROUP_WORLD_SIZE`` (its host's index and the number of
      hosts, as torchrun's node rank and node count), ``ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME``
      (one role, ``default``), and ``MASTER_ADDR, MASTER_PORT``, so that scripts written for
      torchrun and ``torch.distributed.init_process_group()`` (``env://``) work unchanged.
      ringflow itself never reads them here (``RINGFLOW_RANK`` comes first). Likewise
      horovodrun's (:data:`HOROVOD_ENV`: ``HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE,
      _CROSS_RANK, _CROSS_SIZE, _HOSTNAME``), which scripts and Horovod's own tests read.
      ``MASTER_ADDR`` is
      rank 0's host: the store's address when rank 0 runs on this host (``127.0.0.1`` for a
      single-host job), else its name in the host list. ``MASTER_PORT`` is a port nothing of
      ringflow uses, for rank 0's torch to listen on: :func:`reserve_port` keeps it bound
      (``SO_REUSEADDR``, not listening) on this host for the life of the job, so that no other
      ``bind()`` to port 0 here -- a worker's own sockets included -- can take it in the meantime
      (for a rank 0 on another host it is merely free here; pass one known free there).
    * runs under a supervisor (:mod:`.supervisor`; over ssh the remote bootstrap, :mod:`.remote`),
      a child of the launcher in a session of its own (a Ctrl-C in the launcher's terminal
      reaches only the launcher, which forwards it). The supervisor reads the secret from its
      stdin, which the launcher keeps open: its end-of-file (the launcher died, SIGKILL
      included), or a SIGTERM from the launcher, stops the worker and *every* process it
      started -- shell wrappers, grandchildren, processes that left its session (the supervisor
      is their subreaper) -- with SIGTERM, then SIGKILL after ``grace_s``. What a worker leaves
      running when it exits is stopped the same way. A launcher killed with SIGKILL leaves no
      orphans, whatever the worker command is.

Output: every line a worker writes to stdout (stderr) is written to ``stdout`` (``stderr``) as
``[rank]:line`` (``timestamps``: ``YYYY-mm-dd HH:MM:SS.mmm [rank]:line``), live: bytes are split
on ``\\n`` and ``\\r`` (progress bars), and text without either is shown after 50 ms
(:mod:`.relay`); a final line without one is flushed at EOF; invalid UTF-8 is replaced. With
``output_dir`` the bytes go unchanged to ``output_dir/rank.N/stdout`` and ``.../stderr`` instead
(horovodrun's ``--output-filename``); the failure report still shows the stderr tail.

Failure: once a worker exits non-zero or by a signal, the others
get ``grace_s`` to end on their own (ringflow fails their collectives within seconds, and a rank
that exits by itself keeps its output and its own report); every worker session still running
then gets SIGTERM (which ``ringflow.init()`` turns into SystemExit in a Python worker, so
``finally`` blocks run and buffered output is flushed), then SIGKILL after ``grace_s`` more. The
job's *first failure* is then chosen from the failures and the statuses the workers left in the
store: the root cause, not a rank that failed because of it (:mod:`.report`). The
job's exit code is the first failure's (``128 + signal`` for a signal), 0 when every worker exits
0. A SIGINT or SIGTERM to the launcher (with ``handle_signals``) stops the workers at once the same
way (no settling) and gives ``128 + signal``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

from ..errors import ConfigError, LaunchError
from ..failure import Status, read_status
from . import relay
from .hosts import WorkerSpec, is_local
from .report import JobResult, WorkerExit, root_cause
from .ssh import SshOptions, ssh_argv
from .supervisor import PATH as SUPERVISOR

__all__ = [
    "DEFAULT_GRACE_S", "HOROVOD_ENV", "MEMCPY_TUNABLE", "TORCHRUN_ENV", "JobResult", "LocalJob",
    "WorkerExit",
    "glibc_tunables", "reserve_port", "run_job", "start_store", "worker_environ",
]

log = logging.getLogger(__name__)

#: Seconds the other workers get to end on their own after the first failure, and then again
#: between SIGTERM and SIGKILL: long enough for a Python worker to run its ``finally`` blocks and
#: flush its output (ringflow.init() makes SIGTERM raise SystemExit in ringflow-run's workers),
#: short enough that a hung job does not outlive a failure or a Ctrl-C by much.
DEFAULT_GRACE_S = 5.0
#: Lines of a failed rank's stderr kept for the failure report.
TAIL_LINES = 20
_POLL_S = 0.02
_SSH_FAILED = 255
#: What OpenSSH's client prints when an established session ends under it (its sshd killed, the
#: connection reset, ServerAlive probes unanswered); a connection never made says otherwise
#: ("Connection timed out", "Permission denied", "Host key verification failed").
_SSH_LOST = ("closed by remote host", "Connection reset by", "Broken pipe",
             "not responding")
_PR_SET_PDEATHSIG = 1
#: How much longer than ``grace_s`` a supervisor may take to stop its worker before it gets
#: SIGKILL itself: it sends SIGKILL at ``grace_s`` and then reaps.
_SUPERVISOR_MARGIN_S = 2.0

Command = Sequence[str] | Callable[[WorkerSpec], Sequence[str]]


#: Appended to every worker's ``GLIBC_TUNABLES`` unless that already names this tunable: glibc's
#: memcpy writes copies of 1 MiB and more with non-temporal stores, past the cache. glibc derives
#: its own threshold from the L3 size the CPU reports; this machine (a 2-CPU VM) reports 480 MiB,
#: so glibc streamed only copies above 181 MiB, while copies beyond ~64 MiB already ran from
#: memory at half speed (64 MiB: 8.8 ms cached, 5.1 ms streamed). The shared-memory allreduce
#: writes whole blocks of this size (:func:`ringflow.algorithms.local.reduce_parts`): 2 ranks,
#: 64 MiB, 19.4 -> 15.0 ms. Other C libraries and CPUs ignore it.
MEMCPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"


def glibc_tunables(env: Mapping[str, str]) -> str:
    """``env``'s ``GLIBC_TUNABLES`` plus :data:`MEMCPY_TUNABLE`, unless it sets that one."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "x86_non_temporal_threshold" in tunables:
        return tunables
    return ":".join(filter(None, (tunables, MEMCPY_TUNABLE)))


#: torchrun's launcher -> worker variables (torch/distributed/elastic/agent/server/
#: local_elastic_agent.py) that every worker gets too; ``TORCHELASTIC_*`` are left out, so that
#: nothing mistakes a ringflow job for an elastic agent's.
TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)


#: horovodrun's launcher -> worker variables (horovod/runner/gloo_run.py) that every worker
#: gets too, for scripts written for horovodrun.
HOROVOD_ENV = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
               "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")


def worker_environ(
    spec: WorkerSpec,
    *,
    rendezvous_addr: str,
    rendezvous_port: int,
    job_id: str,
    base_env: Mapping[str, str] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> dict[str, str]:
    """The environment of one worker (without ``RINGFLOW_SECRET_FD``, which is per process).

    ``MASTER_ADDR`` / ``MASTER_PORT`` are set when given (``run_job`` always gives them);
    otherwise those of ``base_env`` are removed, since they would name another job's master.
    """
    env = dict(os.environ if base_env is None else base_env)
    for stale in ("RINGFLOW_SECRET_FD", "RINGFLOW_SECRET_FILE", "RINGFLOW_LIFELINE"):
        env.pop(stale, None)
    env.update({
        "RINGFLOW_RANK": str(spec.rank),
        "RINGFLOW_SIZE": str(spec.size),
        "RINGFLOW_LOCAL_RANK": str(spec.local_rank),
        "RINGFLOW_LOCAL_SIZE": str(spec.local_size),
        "RINGFLOW_CROSS_RANK": str(spec.cross_rank),
        "RINGFLOW_CROSS_SIZE": str(spec.cross_size),
        "RINGFLOW_HOSTNAME": spec.host,
        "RINGFLOW_RENDEZVOUS_ADDR": rendezvous_addr,
        "RINGFLOW_RENDEZVOUS_PORT": str(rendezvous_port),
        "RINGFLOW_JOB_ID": job_id,
        "RINGFLOW_LAUNCHER_PID": str(os.getpid()),
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.local_rank),
        "WORLD_SIZE": str(spec.size),
        "LOCAL_WORLD_SIZE": str(spec.local_size),
        "GROUP_RANK": str(spec.cross_rank),
        "GROUP_WORLD_SIZE": str(spec.cross_size),
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(spec.size),
        "ROLE_NAME": "default",
        "HOROVOD_RANK": str(spec.rank),
        "HOROVOD_SIZE": str(spec.size),
        "HOROVOD_LOCAL_RANK": str(spec.local_rank),
        "HOROVOD_LOCAL_SIZE": str(spec.local_size),
        "HOROVOD_CROSS_RANK": str(spec.cross_rank),
        "HOROVOD_CROSS_SIZE": str(spec.cross_size),
        "HOROVOD_HOSTNAME": spec.host,
    })
    for name, value in (("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env["GLIBC_TUNABLES"] = glibc_tunables(env)
    return env


def _thread_defaults(env: Mapping[str, str], spec: WorkerSpec, told: set[str]) -> dict[str, str]:
    """The thread variables of a worker on this host (:mod:`ringflow.threads`); the first worker
    of a host says what they are (INFO: ``--verbose``) and whether the user's oversubscribe."""
    from .. import threads

    plan = threads.for_launcher(env, spec.local_rank, spec.local_size,
                                env.get("RINGFLOW_BIND_TO") or "none")
    if spec.host not in told:
        told.add(spec.host)
        log.info("threads on %s: %s", spec.host, plan.describe())
        if plan.note:
            log.warning("%s", plan.note)
    return plan.environ()


def reserve_port() -> socket.socket:
    """A TCP socket bound to a free port on every IPv4 address of this host, not listening.

    With ``SO_REUSEADDR`` set on it, Linux gives its port to no other ``bind()`` to port 0 while
    it is open, yet lets a socket that sets ``SO_REUSEADDR`` too bind the port and listen, as
    torch's ``TCPStore`` does on rank 0 for ``init_process_group()``. The caller closes it.

    Raises:
        LaunchError: no port could be bound.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", 0))
    except OSError as exc:
        sock.close()
        raise LaunchError(
            f"could not reserve a port for MASTER_PORT: {exc}; pass --master-port PORT"
        ) from exc
    return sock


class LocalJob:
    """The worker processes of one job (local children, or ssh for other hosts): start, relay
    output, wait, stop.

    ``stop(signum)`` only sets a flag, so it is safe to call from a signal handler or another
    thread; :meth:`wait` acts on it.
    """

    def __init__(
        self,
        command: Command,
        workers: Sequence[WorkerSpec],
        *,
        secret: bytes,
        rendezvous: tuple[str, int],
        job_id: str,
        base_env: Mapping[str, str] | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        ssh: SshOptions | None = None,
        output_dir: str | None = None,
        timestamps: bool = False,
        master: tuple[str, int] | None = None,
        status: Callable[[int], Status | None] | None = None,
    ) -> None:
        self._ssh = ssh if ssh is not None else SshOptions()
        self._status = status
        self._master = master
        self._remote = [not is_local(w.host) for w in workers]
        self._output_dir = output_dir
        self._timestamps = timestamps
        self._stdins: list[IO[bytes]] = []
        self._command = command
        self._workers = list(workers)
        self._secret = secret
        self._rendezvous = rendezvous
        self._job_id = job_id
        self._base_env = base_env
        self._out = stdout if stdout is not None else sys.stdout
        self._err = stderr if stderr is not None else sys.stderr
        self._grace_s = grace_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._started: list[float] = []  # time.monotonic() of each spawn
        self._ended: dict[int, float] = {}  # and of each exit seen
        self._stopping: set[int] = set()  # positions this launcher signalled (_terminate)
        self._threads: list[threading.Thread] = []
        self._tails = [collections.deque[str](maxlen=TAIL_LINES) for _ in self._workers]
        # Lists are indexed by position in ``workers``; a job of one machine of a multi-machine
        # launch (:mod:`.machines`) runs ranks that do not start at 0.
        self._position = {w.rank: i for i, w in enumerate(self._workers)}
        self._screen = relay.Screen()  # the terminal that stdout and stderr share
        self._stop_signal: int | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self, signum: int) -> None:
        """Ask :meth:`wait` to stop every worker and report ``signum``."""
        self._stop_signal = signum

    def start(self) -> None:
        """Start every worker; on any error, stop those already started.

        Raises:
            LaunchError: a worker could not be started (command not found, not executable, ...).
        """
        setup = _child_setup(os.getpid())
        addr, port = self._rendezvous
        files = self._open_output_files()
        told: set[str] = set()
        try:
            for spec in self._workers:
                argv = list(self._command(spec) if callable(self._command) else self._command)
                master_addr, master_port = self._master or (None, None)
                env = worker_environ(
                    spec, rendezvous_addr=addr, rendezvous_port=port, job_id=self._job_id,
                    base_env=self._base_env, master_addr=master_addr, master_port=master_port,
                )
                if not self._remote[self._position[spec.rank]]:  # remote: its bootstrap decides
                    env.update(_thread_defaults(env, spec, told))
                log.info("starting rank %d on %s: %s", spec.rank, spec.host, argv)
                self._procs.append(self._spawn(spec, argv, env, setup))
                self._started.append(time.monotonic())
        except BaseException:
            self._terminate(range(len(self._procs)))
            for f in files.values():
                f.close()
            raise
        for spec, proc in zip(self._workers, self._procs, strict=True):
            for stream, out, tail, name in (
                (proc.stdout, self._out, None, "stdout"),
                (proc.stderr, self._err, self._tails[self._position[spec.rank]], "stderr"),
            ):
                target: IO[str] | IO[bytes] = files.get((spec.rank, name), out)
                thread = threading.Thread(
                    target=self._pump, args=(stream, spec.rank, target, tail),
                    name=f"ringflow-run-rank{spec.rank}-output", daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _open_output_files(self) -> dict[tuple[int, str], IO[bytes]]:
        """``output_dir/rank.N/{stdout,stderr}``, opened before any worker starts."""
        files: dict[tuple[int, str], IO[bytes]] = {}
        if self._output_dir is None:
            return files
        try:
            for spec in self._workers:
                folder = os.path.join(self._output_dir, f"rank.{spec.rank}")
                os.makedirs(folder, exist_ok=True)
                for name in ("stdout", "stderr"):
                    # Closed by the thread that pumps into it.
                    files[spec.rank, name] = open(os.path.join(folder, name), "wb")  # noqa: SIM115
        except OSError as exc:
            for f in files.values():
                f.close()
            raise LaunchError(
                f"cannot write the output files under --output-filename {self._output_dir!r}: "
                f"{exc}; pick a writable directory"
            ) from exc
        return files

    def _spawn(
        self,
        spec: WorkerSpec,
        argv: list[str],
        env: dict[str, str],
        setup: Callable[[], None] | None,
    ) -> subprocess.Popen[bytes]:
        """Start the worker of ``spec`` under its supervisor: :mod:`.supervisor` here, the
        remote bootstrap over ssh. Either reads the secret from its stdin, which then stays open
        for the life of the job: its end-of-file (this process died) stops the worker and
        everything it started."""
        if self._remote[self._position[spec.rank]]:
            what = "ssh"
            command = ssh_argv(spec.host, argv, env, self._ssh)
            env = None
            hint = "install the OpenSSH client (ssh) on this host"
        else:
            what = "the supervisor"
            problem = _not_executable(argv[0], env.get("PATH", os.defpath))
            if problem:  # found here rather than by the supervisor, which could only exit 127
                raise LaunchError(
                    f"could not start rank {spec.rank} on {spec.host} with {argv}: {problem}; "
                    "check that the program exists and is executable"
                )
            command = [sys.executable, "-I", "-S", SUPERVISOR, "--grace", str(self._grace_s),
                       "--parent", str(os.getpid()), "--", *argv]
            hint = "check the Python installation"
            # Not tied to this process by PR_SET_PDEATHSIG: when this process dies, the
            # supervisor must live on long enough to stop what the worker started.
            setup = None
        try:
            proc = subprocess.Popen(
                command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=setup, bufsize=0,
            )
        except OSError as exc:
            raise LaunchError(
                f"could not start {what} for rank {spec.rank} on {spec.host}: {exc}; {hint}"
            ) from exc
        stdin = proc.stdin
        if stdin is None:  # pragma: no cover - stdin=PIPE always gives one
            raise LaunchError(f"{what} for rank {spec.rank} has no stdin pipe")
        # Kept open for the life of the job: its end-of-file tells the supervisor to stop.
        self._stdins.append(stdin)
        with contextlib.suppress(OSError):  # one that died at once is reported by wait()
            stdin.write((self._secret.hex() + "\n").encode("ascii"))
        return proc

    def _pump(
        self,
        stream: IO[bytes],
        rank: int,
        out: IO[str] | IO[bytes],
        tail: collections.deque[str] | None,
    ) -> None:
        if self._output_dir is not None:  # a per-rank file: the bytes as written
            relay.pump(stream, None, raw=out, tail=tail)  # type: ignore[arg-type]
        else:
            text: IO[str] = out  # type: ignore[assignment]
            relay.pump(stream, relay.Relay(text, self._prefix(rank), self._screen, tail))
        with contextlib.suppress(OSError):
            stream.close()
        if self._output_dir is not None:
            with contextlib.suppress(OSError):
                out.close()

    def _prefix(self, rank: int) -> Callable[[], str]:
        prefix = f"[{rank}]:"
        if not self._timestamps:
            return lambda: prefix

        def stamped() -> str:
            now = time.time()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
            return f"{stamp}.{int(now % 1 * 1000):03d} {prefix}"

        return stamped

    def wait(self, timeout: float | None = None) -> JobResult:
        """Wait until every worker exits, the first fails, :meth:`stop` is called, or ``timeout``
        seconds pass; stop the rest; return the result, whose first failure is the root cause
        (:mod:`.report`). Any exception (KeyboardInterrupt included) also stops every worker
        before it propagates."""
        deadline = None if timeout is None else time.monotonic() + timeout
        exits: list[WorkerExit | None] = [None] * len(self._procs)
        failed: list[int] = []  # ranks that failed on their own, in the order seen
        timed_out = False
        try:
            while True:
                failed += [r for r in self._note_exits(exits) if exits[r].returncode != 0]
                if self._stop_signal is not None:
                    break
                if failed:
                    # Give the others a moment to end on their own: ringflow fails every
                    # rank's collectives within seconds, a rank left to exit keeps its
                    # output, its finally blocks and its own report of what happened, and
                    # the rank that failed first may exit after those that failed because of it.
                    settle = time.monotonic() + self._grace_s
                    while time.monotonic() < settle and any(
                            e is None and p.poll() is None
                            for e, p in zip(exits, self._procs, strict=True)):
                        time.sleep(_POLL_S)
                    failed += [r for r in self._note_exits(exits) if exits[r].returncode != 0]
                    break
                if all(e is not None for e in exits):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(_POLL_S)
        finally:
            self._terminate([r for r, e in enumerate(exits) if e is None])
            for stdin in self._stdins:
                with contextlib.suppress(OSError):
                    stdin.close()
            self._join_output()
        # Again, now that their output is in: what ssh said of a lost session (_exit).
        exits = [None if e is None else self._exit(r, self._procs[r].returncode)
                 for r, e in enumerate(exits)]
        stopped = [self._exit(r, self._procs[r].returncode) for r, e in enumerate(exits)
                   if e is None]
        first, secondary = root_cause([exits[r] for r in failed], stopped, self._status)
        if first is not None:
            first = dataclasses.replace(
                first, stderr_tail=tuple(self._tails[self._position[first.rank]]))
            code = first.exit_status
        elif self._stop_signal is not None:
            code = 128 + self._stop_signal
        elif timed_out:
            code = 124  # what timeout(1) returns
        else:
            code = 0
        return JobResult(code, tuple(exits), first, self._stop_signal, timed_out, secondary)

    def _exit(self, index: int, code: int) -> WorkerExit:
        remote = self._remote[index]
        spec = self._workers[index]
        reason = ""
        if remote and code < 0 and index not in self._stopping:
            # The signal ended ssh here, not the rank there, which its bootstrap stops when
            # the session closes.
            reason = (f"lost its ssh client: the ssh process on this host was killed by signal "
                      f"{_signame(-code)}; the remote bootstrap on {spec.host} stops the rank "
                      "when its session ends")
        if remote and 128 < code < 128 + 65:  # the bootstrap's 128 + signal
            code = 128 - code
        ran = self._ended.setdefault(index, time.monotonic()) - self._started[index]
        if remote and code == _SSH_FAILED and not reason and (
                ran > (self._ssh.connect_timeout or 30.0) + 1
                or any(words in line for line in self._tails[index] for words in _SSH_LOST)):
            # ssh was connected (past ConnectTimeout, or its own words say so): its 255 is a
            # session lost while the rank ran, not one that could not be made, for which
            # report.WorkerExit.describe gives the hint about ssh's configuration.
            reason = (f"lost its ssh session after {ran:.0f} s (ssh exited with code 255: the "
                      f"connection to host {spec.host} broke, or its sshd session there was "
                      "killed; the remote bootstrap stops the rank when its session ends)")
        return WorkerExit(spec.rank, spec.host, code, (), remote, reason=reason)

    def _note_exits(self, exits: list[WorkerExit | None]) -> list[int]:
        """Record the workers that have exited since the last call; their ranks, in order."""
        new = []
        for rank, proc in enumerate(self._procs):
            if exits[rank] is None and (code := proc.poll()) is not None:
                exits[rank] = self._exit(rank, code)
                new.append(rank)
        return new

    def _terminate(self, ranks: Sequence[int] | range) -> None:
        """SIGTERM the supervisors of ``ranks`` (each stops its worker: SIGTERM, then SIGKILL
        after the grace period); SIGKILL those still there a moment after that."""
        running = [r for r in ranks if self._procs[r].poll() is None]
        self._stopping.update(running)
        if running:
            log.info("stopping ranks %s", running)
        for rank in running:
            _killpg(self._procs[rank], signal.SIGTERM)
        end = time.monotonic() + self._grace_s + _SUPERVISOR_MARGIN_S
        while running and time.monotonic() < end:
            running = [r for r in running if self._procs[r].poll() is None]
            time.sleep(_POLL_S)
        for rank in running:
            _killpg(self._procs[rank], signal.SIGKILL)
        for rank in running:
            self._procs[rank].wait()

    def _join_output(self) -> None:
        # A grandchild that inherited the pipes can hold them open after its worker is gone;
        # wait briefly for the last lines, then give up on it (the threads are daemons).
        end = time.monotonic() + 2.0
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))


def run_job(
    command: Command,
    workers: Sequence[WorkerSpec],
    *,
    base_env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    start_timeout_s: float = 30.0,
    timeout_s: float | None = None,
    handle_signals: bool = False,
    on_start: Callable[[LocalJob], None] | None = None,
    ssh: SshOptions | None = None,
    network_interface: str | None = None,
    output_dir: str | None = None,
    timestamps: bool = False,
    store: tuple[bytes, Any] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> JobResult:
    """Run ``command`` once per worker spec, with a fresh secret and rendezvous store.

    ``command`` is an argv list, or a function of the :class:`WorkerSpec` that returns one.
    ``start_timeout_s`` bounds each wait of the store on a connecting worker. ``timeout_s`` bounds
    the whole job (``None``: no bound). ``handle_signals`` (main thread only) turns SIGINT and
    SIGTERM into :meth:`LocalJob.stop` for the job's duration. ``on_start`` sees the started job.
    ``ssh`` says how to reach workers on other hosts (its ``connect_timeout`` defaults to
    ``start_timeout_s``); ``network_interface`` picks the interface
    the store listens on (see :mod:`.netif`). ``store`` is a ``(secret, StoreServer)`` pair from
    :func:`start_store` that the caller keeps and closes (to read what the workers left in it);
    by default :func:`run_job` starts and closes its own. ``master_addr`` / ``master_port`` are the
    workers' ``MASTER_ADDR`` / ``MASTER_PORT`` (default: rank 0's host, and a port reserved on
    this host for the job's duration; see the module doc).

    Raises:
        LaunchError: the store or a worker could not be started.
    """
    ssh = ssh if ssh is not None else SshOptions()
    if ssh.connect_timeout is None:
        ssh = dataclasses.replace(ssh, connect_timeout=start_timeout_s)
    owned = store is None
    secret, server = start_store(workers, network_interface, start_timeout_s) if owned else store
    reserved: socket.socket | None = None
    statuses = _StatusReader(server.host, server.port, secret)
    try:
        if master_addr is None:
            first = workers[0].host if workers else "localhost"
            master_addr = server.host if is_local(first) else first
        if master_port is None:
            reserved = reserve_port()
            master_port = int(reserved.getsockname()[1])
        job = LocalJob(
            command, workers, secret=secret, rendezvous=(server.host, server.port),
            job_id=secrets.token_hex(8), base_env=base_env, stdout=stdout, stderr=stderr,
            grace_s=grace_s, ssh=ssh, output_dir=output_dir, timestamps=timestamps,
            master=(master_addr, master_port), status=statuses,
        )
        log.info("rendezvous store on %s:%d", server.host, server.port)
        with _signals_to(job if handle_signals else None):
            job.start()
            if on_start is not None:
                on_start(job)
            return job.wait(timeout_s)
    finally:
        statuses.close()
        if reserved is not None:
            reserved.close()
        if owned:
            server.close()


class _StatusReader:
    """Reads the workers' failure statuses from the job's store (:mod:`ringflow.failure`),
    through a client of its own, connected on first use."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._where = (host, port, secret)
        self._store: Any = None

    def __call__(self, rank: int) -> Status | None:
        from ..errors import RingflowError
        from ..rendezvous import TCPStore

        if self._store is None:
            try:
                self._store = TCPStore(*self._where, timeout=5.0)
            except (RingflowError, OSError) as exc:
                log.info("cannot read the workers' statuses: %s", exc)
                return None
        return read_status(self._store, rank)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def start_store(
    workers: Sequence[WorkerSpec], network_interface: str | None = None, timeout_s: float = 30.0,
    host: str | None = None,
) -> tuple[bytes, Any]:
    """A fresh job secret and a ``StoreServer`` on the address the workers can reach (``host``
    where the caller decided it).

    Raises:
        LaunchError: no usable address, or the store could not listen.
    """
    from .. import wire
    from ..rendezvous import StoreServer
    from .netif import store_address

    if host is None:
        host = store_address(sorted({w.host for w in workers if not is_local(w.host)}),
                             network_interface)
    secret = wire.new_secret()
    try:
        return secret, StoreServer(secret, host=host, port=0, timeout=timeout_s)
    except (OSError, ConfigError) as exc:
        raise LaunchError(f"could not start the rendezvous store on {host}: {exc}") from exc


@contextlib.contextmanager
def _signals_to(job: LocalJob | None) -> Iterator[None]:
    if job is None:
        yield
        return
    previous = {}

    def handler(signum: int, _frame: object) -> None:
        job.stop(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _not_executable(program: str, path: str) -> str:
    """Why ``program`` cannot be executed (as ``execvp`` would look for it), or ``""``."""
    if shutil.which(program, path=path) is not None:
        return ""
    if os.sep not in program:
        return f"{program!r} is not found on PATH"
    if not os.path.exists(program):
        return f"{program!r} does not exist"
    return f"{program!r} is not an executable file"


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    # The worker leads its own session, so its pid is its process group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _child_setup(launcher_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that ties the worker's life to the launcher's (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Resolved before fork: the child must not load libraries between fork and exec.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return setup
