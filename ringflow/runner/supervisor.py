"""The supervisor each worker runs under, on this host and (as :mod:`.remote`) over ssh.

::

    python -I -S .../ringflow/runner/supervisor.py [--grace S] [--parent PID] -- COMMAND ARGS...

A launcher's death must take every process of its job with it, whatever the worker command is:
``sh -c "python train.py > log"`` and ``bash train.sh`` put a shell between the launcher and
Python, and a worker may start helpers that leave its session (``setsid``, daemons).
``PR_SET_PDEATHSIG`` reaches only the launcher's direct child and process groups only the
processes that stay in them, so each worker runs under this supervisor, which outlives nothing:

1. It reads the job secret, one line of hex text, from stdin, and starts ``COMMAND`` with stdin
   from ``/dev/null``, stdout and stderr inherited (the launcher's pipes, or ssh's), the secret on
   an inherited pipe named by ``RINGFLOW_SECRET_FD``, and ``RINGFLOW_LAUNCHER_PID`` set to its own
   pid. The worker leads a session of its own and, on Linux, dies with the supervisor
   (``PR_SET_PDEATHSIG``). That reaches the worker only, which may be a shell; so the worker
   also inherits the read end of a *lifeline* pipe whose only write end the supervisor holds
   (``RINGFLOW_LIFELINE``): a rank that imports ringflow leaves when it reads end of file
   there, however the supervisor died (:mod:`ringflow.lifeline`).
2. On Linux it is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): a process of the worker's
   whose parent exits is re-parented to the supervisor, not to init, so every process the worker
   ever started stays its descendant, whatever session it moved to.
3. The rest of stdin is the liveness channel: end-of-file means the launcher is gone (it died;
   or, over ssh, the connection closed). So does a parent pid other than ``--parent``. Either,
   or SIGTERM, SIGINT or SIGHUP, *stops* the worker: SIGTERM to its session, then after
   ``--grace`` seconds SIGKILL to every descendant still there.
4. When the worker exits, whatever it left behind is stopped the same way (it would hold the
   job's output pipes open and outlive the job), and the supervisor exits with the worker's
   status: the same signal when a signal ended it (``128 + signal`` over ssh, see :mod:`.remote`).
5. Before it exits it removes the job's names left in ``/dev/shm`` (``rfj<RINGFLOW_JOB_ID>_*``,
   :mod:`ringflow.algorithms.shm`): a rank killed while it grew its shared-memory segments
   leaves its name behind. Every name is unlinked once all local ranks have mapped it, so at
   this point (the worker is gone, and with it the job or this rank's part in it) any that is
   left is garbage.

The launcher starts it with ``-I -S`` by path: it imports the standard library only, so it starts
in ~10-20 ms, without the site packages' start-up hooks or the package's ``__init__`` (~50 ms,
now that ``import ringflow`` leaves numpy for first use). Processes are found through
``/proc``; elsewhere only the worker's session is signalled.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["DEFAULT_GRACE_S", "PATH", "main", "read_secret_line", "remove_shm_names",
           "supervise"]

#: Seconds between SIGTERM and SIGKILL (the launcher's ``DEFAULT_GRACE_S``).
DEFAULT_GRACE_S = 5.0
#: This file: what the launcher runs (``python -I -S PATH``).
PATH = os.path.abspath(__file__)
_MAX_SECRET_LINE = 64 * 1024
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.05
#: ringflow.algorithms.shm.JOB_PREFIX (this file imports nothing of ringflow).
_SHM_JOB_PREFIX = "/dev/shm/rfj"


def read_secret_line(fd: int = 0) -> bytes:
    """One line from ``fd``, byte by byte, so that nothing after the newline is consumed: the
    rest of the stream is the liveness channel."""
    data = bytearray()
    while len(data) < _MAX_SECRET_LINE:
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            break
        data += byte
    return bytes(data)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _die_with_parent(parent: int, prctl: Callable[..., int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets SIGKILL when ``parent`` dies (Linux)."""
    if prctl is None:
        return None

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def descendants(pid: int) -> list[int]:
    """Every live (not zombie) descendant of ``pid``, from ``/proc``; empty where there is none."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields and fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


class _Worker:
    """The worker process and everything it started."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.status: int | None = None  # os.waitpid's status once reaped

    def reap(self) -> None:
        """Reap exited children: the worker (its status is kept) and adopted orphans."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.proc.pid:
                self.status = status
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    @property
    def done(self) -> bool:
        self.reap()
        return self.status is not None

    def signal_all(self, sig: int) -> bool:
        """``sig`` to the worker's session and to every descendant; whether any was left."""
        targets = descendants(os.getpid())
        if not self.done:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return bool(targets) or not self.done

    def stop(self, grace: float) -> None:
        """SIGTERM to everything, SIGKILL to what is left after ``grace`` seconds."""
        if not self.signal_all(signal.SIGTERM):
            return
        end = time.monotonic() + grace
        while time.monotonic() < end:
            time.sleep(0.02)
            self.reap()
            if self.done and not descendants(os.getpid()):
                return
        for _ in range(100):  # processes forked meanwhile are found on the next round
            if not self.signal_all(signal.SIGKILL):
                break
            time.sleep(0.01)
            self.reap()
        while not self.done:
            time.sleep(0.01)


def supervise(
    command: Sequence[str], env: Mapping[str, str], secret: bytes, *, grace: float,
    parent: int | None = None, watch_fd: int = 0,
) -> int:
    """Run ``command`` as described in the module doc; its Popen-style return code (negative: the
    signal that ended it; 127: it could not be started)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    env = dict(env)
    env["RINGFLOW_LAUNCHER_PID"] = str(os.getpid())
    read_fd, write_fd = os.pipe()
    os.write(write_fd, secret + b"\n")  # a few dozen bytes: never blocks on a fresh pipe
    os.close(write_fd)
    env["RINGFLOW_SECRET_FD"] = str(read_fd)
    # The lifeline (module doc, 1): this process keeps the write end, not inheritable, until it
    # ends; nothing is ever written to it.
    life_r, _life_w = os.pipe()
    env["RINGFLOW_LIFELINE"] = f"{life_r}:{os.fstat(life_r).st_ino}"
    try:
        proc = subprocess.Popen(
            list(command), env=env, stdin=subprocess.DEVNULL, pass_fds=(read_fd, life_r),
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid(), prctl),
        )
    except OSError as exc:
        sys.stderr.write(f"ringflow: could not start {list(command)}: {exc}\n")
        return 127
    finally:
        os.close(read_fd)
        os.close(life_r)

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(watch_fd, 4096):
                pass
        stopping.set()

    threading.Thread(target=watch, name="ringflow-supervisor-stdin", daemon=True).start()
    worker = _Worker(proc)
    while not worker.done and not stopping.wait(_POLL_S):
        if parent is not None and os.getppid() != parent:
            break  # the launcher died and this process was re-parented
    # Whether the worker ended or is being stopped: nothing of it may outlive this process.
    worker.stop(grace)
    remove_shm_names(env.get("RINGFLOW_JOB_ID", ""))
    return proc.returncode


def remove_shm_names(job: str) -> list[str]:
    """Unlink the shared-memory names of job ``job`` left in /dev/shm; the paths removed."""
    if not job.isalnum():
        return []
    directory, _, start = f"{_SHM_JOB_PREFIX}{job}_".rpartition("/")
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(start):
                with contextlib.suppress(OSError):
                    os.unlink(f"{directory}/{name}")
                    removed.append(f"{directory}/{name}")
    return removed


def exit_like(code: int) -> None:
    """End this process as the worker ended: the same signal, or the same exit code."""
    if code < 0:
        sig = -code
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker dumped core already
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
            time.sleep(1.0)  # a signal whose default is to ignore it (SIGCHLD) ends up here
        os._exit(128 + sig)
    sys.stdout.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ringflow supervisor")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    parser.add_argument("--parent", type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    secret = read_secret_line()
    if not secret:
        sys.stderr.write("ringflow supervisor: no job secret on stdin; ringflow-run starts it\n")
        os._exit(1)
    exit_like(supervise(command, os.environ, secret, grace=args.grace, parent=args.parent))


if __name__ == "__main__":
    main()
