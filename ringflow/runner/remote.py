"""The bootstrap that ``ringflow-run`` starts over ssh on a remote host (:mod:`.ssh`).

::

    python -m ringflow.runner.remote [--bind-interface IF] [--grace S] -- COMMAND ARGS...

1. Reads the job secret, one line of hex text, from stdin (the launcher writes it into ssh's
   stdin; it is never in an argv or an environment value).
2. With ``--bind-interface IF``, sets ``RINGFLOW_BIND_ADDR`` to *this* host's IPv4 address on
   ``IF``; sets ``RINGFLOW_LAUNCHER_PID`` to its own pid (the worker's parent).
3. Starts ``COMMAND`` in its own session with stdin from ``/dev/null``, stdout and stderr inherited
   (they travel back through ssh), and the secret on an inherited pipe named by
   ``RINGFLOW_SECRET_FD`` -- exactly as a local worker gets it. On Linux the worker also gets
   ``PR_SET_PDEATHSIG`` so that it dies with the bootstrap.
4. Watches stdin: end-of-file means the launcher or its ssh is gone, so the worker's session gets
   SIGTERM and, after the grace period, SIGKILL. SIGTERM, SIGINT and SIGHUP to the bootstrap do
   the same.
5. Exits with the worker's exit code, or ``128 + signal`` when a signal ended it (the launcher
   reads a remote status above 128 as that signal).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["main"]

_MAX_SECRET_LINE = 64 * 1024


def _read_secret_line() -> bytes:
    # Byte by byte, so nothing after the newline is consumed: the rest of stdin is the liveness
    # channel that step 4 watches.
    data = bytearray()
    while len(data) < _MAX_SECRET_LINE:
        byte = os.read(0, 1)
        if not byte or byte == b"\n":
            break
        data += byte
    return bytes(data)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bootstrap; returns the exit status (see the module doc)."""
    from .launch import DEFAULT_GRACE_S, _child_setup, _killpg
    from .netif import interface_ipv4

    parser = argparse.ArgumentParser(prog="python -m ringflow.runner.remote")
    parser.add_argument("--bind-interface")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    secret = _read_secret_line()
    if not secret:
        sys.stderr.write("ringflow remote bootstrap: no job secret on stdin; it is started by "
                         "ringflow-run, not by hand\n")
        return 1
    env = dict(os.environ)
    env["RINGFLOW_LAUNCHER_PID"] = str(os.getpid())
    if args.bind_interface:
        try:
            env["RINGFLOW_BIND_ADDR"] = interface_ipv4(args.bind_interface)
        except Exception as exc:
            sys.stderr.write(f"ringflow remote bootstrap: {exc}\n")
            return 1

    read_fd, write_fd = os.pipe()
    os.write(write_fd, secret + b"\n")  # a few dozen bytes: never blocks on a fresh pipe
    os.close(write_fd)
    env["RINGFLOW_SECRET_FD"] = str(read_fd)
    try:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, pass_fds=(read_fd,),
            start_new_session=True, preexec_fn=_child_setup(os.getpid()),
        )
    except OSError as exc:
        sys.stderr.write(f"ringflow remote bootstrap: could not start {command}: {exc}\n")
        return 127
    finally:
        os.close(read_fd)

    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)

    def watch_stdin() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        stopping.set()

    threading.Thread(target=watch_stdin, name="ringflow-remote-stdin", daemon=True).start()
    while proc.poll() is None and not stopping.wait(0.05):
        pass
    if proc.poll() is None:
        _killpg(proc, signal.SIGTERM)
        end = time.monotonic() + args.grace
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        if proc.poll() is None:
            _killpg(proc, signal.SIGKILL)
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
