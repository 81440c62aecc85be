"""The bootstrap that ``ringflow-run`` starts over ssh on a remote host (:mod:`.ssh`).

::

    python -m ringflow.runner.remote [--bind-interface IF] [--grace S] -- COMMAND ARGS...

1. Reads the job secret, one line of hex text, from stdin (the launcher writes it into ssh's
   stdin; it is never in an argv or an environment value).
2. With ``--bind-interface IF``, sets ``RINGFLOW_BIND_ADDR`` to *this* host's IPv4 address on
   ``IF``; ``RINGFLOW_LAUNCHER_PID`` is its own pid (the worker's parent).
3. Puts the thread counts of :mod:`ringflow.threads` in the worker's environment, decided on
   this host (its CPUs, its cgroup), as the launcher does for its own host's workers.
4. Supervises ``COMMAND`` exactly as a local worker's supervisor does
   (:mod:`.supervisor`): the secret on an inherited pipe named by ``RINGFLOW_SECRET_FD``, stdout
   and stderr inherited (they travel back through ssh), a child subreaper, so that nothing the
   worker starts escapes it; end-of-file on stdin (the launcher or its ssh is gone), SIGTERM,
   SIGINT or SIGHUP stop the worker and every process it started (SIGTERM, then SIGKILL after
   the grace period), and so does the worker's own exit for what it left behind.
5. Exits with the worker's exit code, or ``128 + signal`` when a signal ended it (the launcher
   reads a remote status above 128 as that signal).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bootstrap; returns the exit status (see the module doc)."""
    from .netif import interface_ipv4
    from .supervisor import DEFAULT_GRACE_S, read_secret_line, supervise

    parser = argparse.ArgumentParser(prog="python -m ringflow.runner.remote")
    parser.add_argument("--bind-interface")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    secret = read_secret_line()
    if not secret:
        sys.stderr.write("ringflow remote bootstrap: no job secret on stdin; it is started by "
                         "ringflow-run, not by hand\n")
        return 1
    env = dict(os.environ)
    if args.bind_interface:
        try:
            env["RINGFLOW_BIND_ADDR"] = interface_ipv4(args.bind_interface)
        except Exception as exc:
            sys.stderr.write(f"ringflow remote bootstrap: {exc}\n")
            return 1
    env.update(_thread_defaults(env))
    code = supervise(command, env, secret, grace=args.grace)
    return 128 - code if code < 0 else code


def _thread_defaults(env: dict[str, str]) -> dict[str, str]:
    """The worker's thread variables, decided on this host (:mod:`ringflow.threads`); local rank
    0 notes on stderr where the user's counts oversubscribe the cores."""
    from .. import threads

    try:
        local_rank, local_size = int(env["RINGFLOW_LOCAL_RANK"]), int(env["RINGFLOW_LOCAL_SIZE"])
    except (KeyError, ValueError):
        return {}  # not ringflow-run's contract: init() decides
    plan = threads.for_launcher(env, local_rank, local_size, env.get("RINGFLOW_BIND_TO") or "none")
    if plan.note and local_rank == 0:
        sys.stderr.write(f"ringflow: note: {plan.note}\n")
    return plan.environ()


if __name__ == "__main__":
    sys.exit(main())
