"""The ``ringflow-run`` command line (horovodrun's flags; DESIGN.md sections 5 and 6).

::

    ringflow-run -np N [-H HOST:SLOTS,... | --hostfile FILE] [options] COMMAND [ARGS...]

``-np`` is honoured exactly: asking for more processes than the listed slots is an error before
anything starts (exit code 2, like every usage error). Without ``-H`` / ``--hostfile`` the job runs
``localhost:N``. Hosts other than this machine are reached with ``ssh`` (:mod:`.ssh`). The exit
code is the first failing rank's (``128 + signal`` when a signal ended it), 0 when every rank
succeeded, ``128 + signal`` when ringflow-run itself got SIGINT or SIGTERM.

Tuning flags become the workers' ``RINGFLOW_*`` variables (:data:`TUNING`) and win over the same
variables in the launcher's environment; they are validated through
:class:`ringflow.config.Config` before anything starts. ``--config-file`` is YAML with the long
flag names as keys (``fusion-threshold-mb: 32`` or ``fusion_threshold_mb: 32``); a flag given on
the command line wins over the file. As a command-line program this module writes to stdout and
stderr; the library does not.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, LaunchError
from .hosts import Host, assign_ranks, is_local, parse_hostfile, parse_hosts
from .launch import run_job
from .ssh import SshOptions

__all__ = ["TUNING", "main", "worker_overrides"]

PROG = "ringflow-run"
#: Exit code of a usage error, as argparse and POSIX utilities use it.
USAGE_ERROR = 2


_MIB = 1024 * 1024
#: horovodrun's --log-level names -> ringflow's levels.
_LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning",
               "error": "error", "fatal": "error"}

#: flag dest -> (RINGFLOW_ variable, value conversion).
TUNING: dict[str, tuple[str, Callable[[Any], str]]] = {
    "fusion_threshold_mb": ("RINGFLOW_FUSION_THRESHOLD_BYTES", lambda mb: str(int(mb * _MIB))),
    "cycle_time_ms": ("RINGFLOW_CYCLE_TIME_MS", str),
    "cache_capacity": ("RINGFLOW_CACHE_CAPACITY", str),
    "timeline_filename": ("RINGFLOW_TIMELINE_PATH", lambda p: os.path.abspath(p)),
    "stall_check_warning_time_seconds": ("RINGFLOW_STALL_WARNING_S", str),
    "stall_check_shutdown_time_seconds": ("RINGFLOW_STALL_SHUTDOWN_S", str),
    "log_level": ("RINGFLOW_LOG_LEVEL", lambda level: _LOG_LEVELS[level.lower()]),
    "start_timeout": ("RINGFLOW_TIMEOUT_S", str),
    "bind_to": ("RINGFLOW_BIND_TO", str),
}


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("ringflow")
    except (ImportError, PackageNotFoundError):
        import ringflow

        return str(getattr(ringflow, "__version__", "unknown"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run COMMAND as N ranks of a ringflow job.",
        epilog="example: ringflow-run -np 4 -H node1:2,node2:2 python train.py --epochs 3",
    )
    add = p.add_argument
    add("-np", dest="np", type=int, metavar="N", help="number of processes (exact)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots (default localhost:N)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="file with one 'HOST slots=N' per line ('#' comments)")
    ssh = p.add_argument_group("ssh (hosts other than this one)")
    ssh.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port on every host")
    ssh.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    ssh.add_argument("--ssh-config-file", metavar="FILE", help="ssh client config (ssh -F)")
    ssh.add_argument("--disable-host-key-checking", action="store_true",
                     help="accept unknown host keys (off by default: ssh checks them)")
    ssh.add_argument("-x", "--export", action="append", default=[], metavar="NAME",
                     help="also forward this environment variable to remote workers")
    add("--start-timeout", type=float, metavar="S",
        help="seconds to wait for starting workers; also the workers' RINGFLOW_TIMEOUT_S "
             "(default 30)")
    add("--network-interface", "--network-interfaces", dest="network_interface", metavar="IF",
        help="interface that connects the hosts (sets RINGFLOW_BIND_ADDR on each host)")
    add("--output-filename", metavar="DIR",
        help="write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr")
    add("--prefix-timestamp", "--timestamp-output", dest="prefix_timestamp",
        action="store_true", help="prefix each output line with the time")
    add("--verbose", action="store_true", help="log what the launcher does to stderr")
    tune = p.add_argument_group("tuning (passed to the workers as RINGFLOW_* variables)")
    tune.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                      help="fusion buffer size in MiB; 0 disables fusion (default 128)")
    tune.add_argument("--cycle-time-ms", type=float, metavar="MS",
                      help="engine cycle time (default 1)")
    tune.add_argument("--cache-capacity", type=int, metavar="N",
                      help="response cache entries; 0 disables (default 1024)")
    tune.add_argument("--timeline-filename", metavar="FILE", help="write a Chrome-trace timeline")
    tune.add_argument("--no-stall-check", action="store_true",
                      help="disable stall warnings and the stall shutdown")
    tune.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                      help="warn about a stalled tensor after S seconds (default 60)")
    tune.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                      help="fail a stalled tensor after S seconds; 0 never (default 600)")
    tune.add_argument("--log-level", type=str.lower, choices=sorted(_LOG_LEVELS),
                      help="log level of the workers' ringflow logger")
    tune.add_argument("--bind-to", choices=("none", "core"),
                      help="core: pin each rank to its slice of its host's CPUs (default none)")
    add("--config-file", metavar="FILE", help="YAML file with long flag names as keys")
    add("--check-build", action="store_true", help="list what this installation can do and exit")
    add("-v", "--version", action="version", version=f"%(prog)s {_version()}")
    add("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _load_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The flag values of a YAML config file, converted and checked like the flags.

    Raises:
        ConfigError: unreadable file, not a mapping, an unknown key, or a bad value.
    """
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("--config-file needs PyYAML; pip install pyyaml") from exc
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config-file {path!r} cannot be read as YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config-file {path!r} holds a {type(data).__name__}; expected a mapping of long "
            "flag names to values, e.g. 'fusion-threshold-mb: 32'"
        )
    actions = {
        a.dest: a for a in parser._actions
        if a.option_strings and a.dest not in ("help", "version", "config_file")
    }
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None:
            names = sorted(n.replace("_", "-") for n in actions)
            close = difflib.get_close_matches(str(key).replace("_", "-"), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--config-file {path!r}: unknown key {key!r}{hint}")
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not true or false"
                )
        elif isinstance(action, argparse._AppendAction):
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        else:
            try:
                value = action.type(str(value)) if action.type else str(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not a valid value for {flag}"
                ) from None
            if action.choices is not None and value not in action.choices:
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not one of "
                    f"{sorted(action.choices)}"
                )
        values[action.dest] = value
    return values


def worker_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The ``RINGFLOW_*`` variables the tuning flags set for every worker."""
    env = {var: convert(getattr(args, dest)) for dest, (var, convert) in TUNING.items()
           if getattr(args, dest) is not None}
    if args.no_stall_check:
        env["RINGFLOW_STALL_WARNING_S"] = env["RINGFLOW_STALL_SHUTDOWN_S"] = "0"
        env["RINGFLOW_DEADLOCK_SHUTDOWN_S"] = "0"
    return env


def _error(text: str, code: int = USAGE_ERROR) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return code


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.config_file:
            parser.set_defaults(**_load_config_file(parser, args.config_file))
            args = parser.parse_args(argv)  # the command line wins over the file
    except SystemExit as exc:  # --help, --version, usage errors: argparse already wrote the text
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except ConfigError as exc:
        return _error(str(exc))
    command = list(args.command)
    args.command = command[1:] if command[:1] == ["--"] else command
    if args.check_build:
        return args
    if args.np is None:
        parser.print_usage(sys.stderr)
        return _error("the following arguments are required: -np")
    if not args.command:
        parser.print_usage(sys.stderr)
        return _error(f"no command given; e.g. {PROG} -np 2 python train.py")
    if args.start_timeout is not None and args.start_timeout <= 0:
        return _error(f"--start-timeout {args.start_timeout} must be > 0")
    return args


def _log_to_stderr() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    runner_log = logging.getLogger("ringflow.runner")
    runner_log.addHandler(handler)
    runner_log.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ringflow-run`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = _parse(argv)
    if isinstance(args, int):
        return args
    if args.check_build:
        from .check_build import check_build

        sys.stdout.write(check_build(_version()))
        return 0
    try:
        if args.hostfile:
            hosts = parse_hostfile(args.hostfile)
        elif args.hosts:
            hosts = parse_hosts(args.hosts)
        else:
            hosts = [Host("localhost", max(args.np, 1))]
        workers = assign_ranks(hosts, args.np)
        overrides = worker_overrides(args)
        env: Mapping[str, str] = {**os.environ, **overrides}
        from ..config import Config

        Config.from_env(env)  # bad tuning values fail here, before anything starts
        if args.network_interface and any(is_local(w.host) for w in workers):
            from .netif import interface_ipv4

            env = {**env, "RINGFLOW_BIND_ADDR": interface_ipv4(args.network_interface)}
    except (LaunchError, ConfigError) as exc:
        return _error(str(exc))

    if args.verbose:
        _log_to_stderr()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="replace")
    ssh = SshOptions(
        port=args.ssh_port, identity_file=args.ssh_identity_file,
        config_file=args.ssh_config_file, host_key_checking=not args.disable_host_key_checking,
        export=tuple(args.export), bind_interface=args.network_interface,
    )
    try:
        result = run_job(
            args.command, workers, base_env=env, handle_signals=True, ssh=ssh,
            start_timeout_s=args.start_timeout or 30.0,
            network_interface=args.network_interface, output_dir=args.output_filename,
            timestamps=args.prefix_timestamp,
        )
    except LaunchError as exc:
        return _error(str(exc), 1)
    report = result.report(PROG)
    if report:
        print(report, file=sys.stderr, flush=True)
    return result.returncode
