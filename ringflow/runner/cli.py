"""The ``ringflow-run`` command line.

::

    ringflow-run -np N [-H localhost:N] [--verbose] [--start-timeout S] COMMAND [ARGS...]

``-np`` is honoured exactly: with ``-H``, asking for more processes than the listed slots is an
error before anything starts (exit code 2, like every usage error). Without ``-H`` the job runs
``localhost:N``. The exit code is the first failing rank's (``128 + signal`` when a signal ended
it), 0 when every rank succeeded, ``128 + signal`` when ringflow-run itself got SIGINT or SIGTERM.
As a command-line program this module writes to stdout and stderr; the library does not.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import LaunchError
from .hosts import Host, assign_ranks, is_local, parse_hosts
from .launch import run_job

__all__ = ["main"]

PROG = "ringflow-run"
#: Exit code of a usage error, as argparse and POSIX utilities use it.
USAGE_ERROR = 2


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("ringflow")
    except (ImportError, PackageNotFoundError):
        import ringflow

        return str(getattr(ringflow, "__version__", "unknown"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run COMMAND as N ranks of a ringflow job.",
        epilog="example: ringflow-run -np 4 python train.py --epochs 3",
    )
    parser.add_argument(
        "-np", dest="np", type=int, required=True, metavar="N", help="number of processes (exact)"
    )
    parser.add_argument(
        "-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
        help="hosts and their slots (default localhost:N); this version runs on this host only",
    )
    parser.add_argument(
        "--start-timeout", type=float, default=30.0, metavar="S",
        help="seconds the rendezvous store waits on a starting worker (default 30)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="log what the launcher does to stderr"
    )
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ringflow-run`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse already wrote the text
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.print_usage(sys.stderr)
        print(
            f"{PROG}: error: no command given; e.g. {PROG} -np 2 python train.py", file=sys.stderr
        )
        return USAGE_ERROR
    if args.start_timeout <= 0:
        print(f"{PROG}: error: --start-timeout {args.start_timeout} must be > 0", file=sys.stderr)
        return USAGE_ERROR
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else [Host("localhost", max(args.np, 1))]
        workers = assign_ranks(hosts, args.np)
        remote = sorted({w.host for w in workers if not is_local(w.host)})
        if remote:
            raise LaunchError(
                f"hosts {remote} are not this machine, and this version of {PROG} starts "
                "workers on this host only; use -H localhost:N"
            )
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR

    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
        runner_log = logging.getLogger("ringflow.runner")
        runner_log.addHandler(handler)
        runner_log.setLevel(logging.INFO)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="replace")

    try:
        result = run_job(
            command, workers, start_timeout_s=args.start_timeout, handle_signals=True
        )
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    report = result.report(PROG)
    if report:
        print(report, file=sys.stderr, flush=True)
    return result.returncode
