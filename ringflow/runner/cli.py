"""The ``ringflow-run`` command line (horovodrun's flags; DESIGN.md sections 5 and 6).

Over 600 lines on purpose: most of it is the table of flags, with the help text
``ringflow-run --help`` prints and the notes of the other launchers' spellings; the logic is
in :mod:`.launch` and :mod:`.dialects`.

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
flag names as keys (``fusion-threshold-mb: 32`` or ``fusion_threshold_mb: 32``), or horovodrun's
nested form (below); a flag given on the command line wins over the file. As a command-line
program this module writes to stdout and stderr; the library does not. Parsing never abbreviates
a long flag (``allow_abbrev=False``); every usage error is one line on stderr and exit code 2.

Dialects: horovodrun, torchrun and mpirun
-----------------------------------------

Users come with other launchers' flags. Each one below is mapped onto ringflow-run, or accepted
with a one-line note on stderr saying why it has no effect here, or refused with a one-line
reason and what to do instead (exit code 2); any other unknown flag is refused with the closest
known one (``did you mean``). The lists live in :mod:`.dialects`; ``ringflow-run --help`` shows
them too.

========================================= =========================================================
Spelling (origin)                         ringflow-run
========================================= =========================================================
``--num-proc N`` (horovodrun)             ``-np N``
``-cb`` (horovodrun)                      ``--check-build``
``-hostfile``, ``-machinefile``,          ``--hostfile FILE``
``--machinefile`` (horovodrun, mpirun)
``-prefix-timestamp``,                    ``--prefix-timestamp`` (mpirun's ``--timestamp-output``
``--prefix-output-with-timestamp``        too)
``--gloo`` (horovodrun)                   ``--transport auto``: ringflow's own TCP and
                                          shared-memory transports play Gloo's part
``--tcp`` (horovodrun)                    ``--transport tcp``: TCP only, no shared memory
``--mpi`` (horovodrun),                   refused: ringflow-run's workers are no MPI job, so
``--transport mpi``                       the mpi transport cannot join them; the message gives
                                          the ``mpirun -np N ... COMMAND`` that does it
``--jsrun``, ``--mpi-args``,              refused: ringflow-run starts neither jsrun nor mpirun;
``--binding-args``, ``-mca``, ``--mca``   start the job with them yourself
``--stall-check``                         the default; undoes ``--no-stall-check``
``--gloo-timeout-seconds S``              the workers' ``RINGFLOW_TIMEOUT_S`` (else
                                          ``--start-timeout``'s)
``--hierarchical-allreduce``,             note: ringflow picks the hierarchical allreduce (shared
``--no-hierarchical-allreduce``           memory within hosts, a ring across) whenever every host
                                          runs the same number of ranks
``--hierarchical-allgather``              note: the allgather is a ring; no hierarchical variant
                                          (``--no-hierarchical-allgather``: silent, as asked)
``--autotune``, ``--autotune-log-file``,  ringflow's autotuner (:mod:`ringflow.autotune`):
``--autotune-warmup-samples``,            ``RINGFLOW_AUTOTUNE``, ``_AUTOTUNE_LOG_FILE``,
``--autotune-steps-per-sample``           ``_AUTOTUNE_WARMUP_SAMPLES``, ``_STEPS_PER_SAMPLE``
``--autotune-bayes-opt-max-samples``,     note: the autotuner is a coordinate search, not
``--autotune-gaussian-process-noise``     Bayesian optimisation
``--timeline-mark-cycles``                note: ringflow has no cycles to mark
                                          (``--no-timeline-mark-cycles``: silent)
``--disable-cache``                       note: ringflow-run keeps no cache
``--mpi-threads-disable``,                note: no effect here, each says why (the ``--no-...``
``--num-nccl-streams``,                   forms, ``--log-without-timestamp`` and
``--ccl-bgt-affinity``,                   ``--log-hide-timestamp`` ask for what ringflow does
``--thread-affinity``,                    anyway: silent)
``--log-with-timestamp``,
``--no-log-hide-timestamp``,
``--no-mpi-threads-disable``,
``--log-without-timestamp``,
``--log-hide-timestamp``
``--host-discovery-script S``,            an elastic job (:mod:`ringflow.runner.elastic`):
``--min-np``, ``--max-np``,               workers join and leave while it runs, on this
``--slots-per-host``, ``--reset-limit``,  machine and over ssh on the other hosts listed
``--elastic-timeout``,                    (``--network-interface``: where its store listens)
``--blacklist-cooldown-range``
``--nproc-per-node N``,                   ``-np N`` on this host; ``N`` may also be ``cpu`` (the
``--nproc_per_node N`` (torchrun)         CPUs this process may use), ``gpu`` (``nvidia-smi -L``)
                                          or ``auto`` (GPUs if any, else CPUs), as in torchrun.
                                          With ``-H`` / ``--hostfile``: refused (give slots there)
``--nnodes 1``, ``--node-rank 0``,        accepted (one host); other values refused: list every
``--standalone``                          host with ``-H`` and start ringflow-run once
``--max-restarts 0``                      accepted; more refused (the first failure ends the job)
``--master-addr A``, ``--master-port P``  the workers' ``MASTER_ADDR`` / ``MASTER_PORT``
``--rdzv-backend``, ``--rdzv-endpoint``,  refused: ringflow-run runs the rendezvous itself
``--rdzv-id``, ``--rdzv-conf``
``--local-addr``                          refused: use ``--network-interface IF``
``-m``, ``--module``                      ``COMMAND`` is a module: ``python -m COMMAND ARGS``
``--no-python``                           run ``COMMAND`` as given
``--run-path``                            run ``COMMAND`` (a file) with this Python
``--log-dir DIR``                         ``--output-filename DIR``
``--monitor-interval``,                   note: no effect here (each says why)
``--start-method``, ``--role``,
``-r``/``--redirects``, ``-t``/``--tee``,
``--local-ranks-filter``
``-x NAME=VALUE`` (mpirun)                ``NAME=VALUE`` in every worker's environment (local and
                                          ssh); ``-x NAME`` forwards the launcher's value to
                                          remote workers. The variables ringflow-run sets itself
                                          (``RINGFLOW_RANK``, ``RANK``, ``MASTER_PORT``, ...)
                                          are refused (``--master-addr`` / ``--master-port``)
``--map-by``, ``--oversubscribe``         refused: ranks fill each host's slots in order, and
                                          ``-np`` must fit in them
``--allow-run-as-root``, ``--tag-output`` note: no effect here
``--timestamp-output``,                   as in mpirun (``--bind-to`` takes ``core`` or ``none``)
``--output-filename``, ``--bind-to``
========================================= =========================================================

torchrun's underscore spellings (``--nproc_per_node``, ``--master_port``, ...) are accepted wherever
torchrun accepts them. Like torchrun, a ``COMMAND`` that is a ``.py`` file which is not executable
(``ringflow-run -np 2 train.py``) runs with this launcher's Python (``--no-python`` turns that off).

horovodrun's ``--config-file`` (``horovod/runner/common/util/config_parser.py``) is read too: the
sections ``params`` (``fusion_threshold_mb``, ``cycle_time_ms``, ``cache_capacity``,
``hierarchical_allreduce``, ``hierarchical_allgather``), ``autotune`` (``enabled``, ``log_file``,
``warmup_samples``, ``steps_per_sample``, ``bayes_opt_max_samples``, ``gaussian_process_noise``),
``timeline`` (``filename``, ``mark_cycles``), ``stall_check`` (``enabled``,
``warning_time_seconds``, ``shutdown_time_seconds``), ``library_options``
(``mpi_threads_disable``, ``num_nccl_streams``, ``ccl_bgt_affinity``, ``gloo_timeout_seconds``),
``logging`` (``level``, ``with_timestamp``) and the key ``controller`` (``gloo`` or ``mpi``), each
meaning what its flag means.

``HOROVOD_*`` tuning variables in the environment (``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_CYCLE_TIME``, ...) are read with their ``RINGFLOW_*`` meaning by
:func:`ringflow.config.read_horovod_env`; ringflow-run writes one warning per variable naming the
mapping and passes the value on to the workers as the ``RINGFLOW_*`` variable. A flag or a set
``RINGFLOW_*`` variable wins.

``--auto`` runs an unchanged single-process torch script data-parallel (:mod:`ringflow.torch.auto`):
the workers' ``PYTHONPATH`` starts with ``ringflow/runner/_autostart``, whose ``sitecustomize``
enables auto mode once the program imports torch.

Workers get torchrun's variables as well (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...;
:mod:`.launch`), so ``torch.distributed.init_process_group("gloo")`` works inside a job.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from ..config import ENV_CONTRACT, HOROVOD_LOG_LEVELS
from ..errors import ConfigError, LaunchError
from . import dialects
from .configfile import load_config_file, read_config_file
from .hosts import Host, assign_ranks, is_local, parse_hostfile, parse_hosts
from .launch import HOROVOD_ENV, TORCHRUN_ENV, run_job
from .ssh import SshOptions

__all__ = ["TUNING", "main", "worker_overrides"]

log = logging.getLogger(__name__)

_load_config_file = load_config_file  # the name the tests and older callers use

PROG = "ringflow-run"
#: Exit code of a usage error, as argparse and POSIX utilities use it.
USAGE_ERROR = 2


_MIB = 1024 * 1024
#: horovodrun's --log-level names -> ringflow's levels.
_LOG_LEVELS = HOROVOD_LOG_LEVELS

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
    "gloo_timeout_seconds": ("RINGFLOW_TIMEOUT_S", str),  # after start_timeout: it wins
    "bind_to": ("RINGFLOW_BIND_TO", str),
    "transport": ("RINGFLOW_TRANSPORT", str),
    "autotune": ("RINGFLOW_AUTOTUNE", lambda on: "1" if on else "0"),
    "autotune_log_file": ("RINGFLOW_AUTOTUNE_LOG_FILE", lambda p: os.path.abspath(p)),
    "autotune_warmup_samples": ("RINGFLOW_AUTOTUNE_WARMUP_SAMPLES", str),
    "autotune_steps_per_sample": ("RINGFLOW_AUTOTUNE_STEPS_PER_SAMPLE", str),
    "autotune_compression": ("RINGFLOW_AUTOTUNE_COMPRESSION", str),
    "compression": ("RINGFLOW_COMPRESSION", str),
}


def _compression(text: str) -> str:
    """``--compression``'s value, checked here so that a typo fails before any worker starts."""
    from ..compression import parse

    try:
        parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class _Usage(ConfigError):
    """A usage error: one line per ``(flag, text)``; ``flag`` None for a general one."""

    def __init__(self, *lines: tuple[str | None, str]) -> None:
        super().__init__("; ".join(text for _, text in lines))
        self.lines = lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage + error
        raise _Usage((None, message))


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("ringflow")
    except (ImportError, PackageNotFoundError):
        import ringflow

        return str(getattr(ringflow, "__version__", "unknown"))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Run COMMAND as N ranks of a ringflow job.",
        epilog="example: ringflow-run -np 4 -H node1:2,node2:2 python train.py --epochs 3\n\n"
               + dialects.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    add("-np", "--num-proc", dest="np", type=int, metavar="N", help="number of processes (exact)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots (default localhost:N)")
    hosts.add_argument("--hostfile", "-hostfile", "-machinefile", "--machinefile",
                       dest="hostfile", metavar="FILE",
                       help="file with one 'HOST slots=N' per line ('#' comments)")
    ssh = p.add_argument_group("ssh (hosts other than this one)")
    ssh.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port on every host")
    ssh.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    ssh.add_argument("--ssh-config-file", metavar="FILE", help="ssh client config (ssh -F)")
    ssh.add_argument("--disable-host-key-checking", action="store_true",
                     help="accept unknown host keys (off by default: ssh checks them)")
    add("-x", "--export", action="append", default=[], metavar="NAME[=VALUE]",
        help="NAME=VALUE: set it for every worker; NAME: also forward the launcher's value to "
             "remote workers")
    add("--start-timeout", type=float, metavar="S",
        help="seconds to wait for starting workers; also the workers' RINGFLOW_TIMEOUT_S "
             "(default 30)")
    add("--network-interface", "--network-interfaces", dest="network_interface", metavar="IF",
        help="interface that connects the hosts (sets RINGFLOW_BIND_ADDR on each host)")
    add("--output-filename", metavar="DIR",
        help="write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr")
    add("--prefix-timestamp", "--timestamp-output", "-prefix-timestamp",
        "--prefix-output-with-timestamp", dest="prefix_timestamp", action="store_true",
        help="prefix each output line with the time")
    add("--verbose", action="store_true", help="log what the launcher does to stderr")
    add("--auto", action="store_true",
        help="run an unchanged single-process torch script data-parallel: every worker "
             "imports ringflow.torch.auto once it imports torch (Jittor's mpirun mode)")
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
    tune.add_argument("--stall-check", dest="no_stall_check", action="store_false",
                      help=argparse.SUPPRESS)
    tune.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                      help="warn about a stalled tensor after S seconds (default 60)")
    tune.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                      help="fail a stalled tensor after S seconds; 0 never (default 600)")
    tune.add_argument("--log-level", type=str.lower, choices=list(_LOG_LEVELS),
                      help="log level of the workers' ringflow logger")
    tune.add_argument("--bind-to", choices=("none", "core", "auto"),
                      help="core: pin each rank to its slice of its host's CPUs; auto (the "
                           "default): core where every rank gets CPUs of its own and nothing "
                           "placed the job yet")
    tune.add_argument("--transport", choices=("auto", "tcp", "shm", "mpi"),
                      help="RINGFLOW_TRANSPORT: auto (shared memory within hosts, TCP across), "
                           "tcp or shm; mpi needs mpirun (default auto)")
    tune.add_argument("--autotune", action="store_true", default=None,
                      help="tune fusion, buckets, chunk sizes and cycle time online from the "
                           "step rate (RINGFLOW_AUTOTUNE; ringflow.autotune)")
    tune.add_argument("--no-autotune", dest="autotune", action="store_false",
                      help=argparse.SUPPRESS)
    tune.add_argument("--autotune-log-file", metavar="FILE",
                      help="rank 0 writes the autotuner's samples and its choice here (CSV)")
    tune.add_argument("--autotune-warmup-samples", type=int, metavar="N",
                      help="samples the autotuner ignores at the start (default 2)")
    tune.add_argument("--autotune-steps-per-sample", type=int, metavar="N",
                      help="steps per autotuner sample (default 4)")
    tune.add_argument("--autotune-compression", choices=("none", "fp16", "bf16"),
                      help="let the autotuner send large float32 allreduces in this 16-bit "
                           "format (changes results; default none: never)")
    tune.add_argument("--compression", type=_compression, metavar="SPEC",
                      help="gradient compression of the optimizers that ask for none: none, "
                           "fp16, bf16, powersgd[:rank=R], randomk[:fraction=F], onebit, auto "
                           "(changes results; RINGFLOW_COMPRESSION)")
    tune.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    tune.add_argument("--tcp", dest="tcp_flag", action="store_true", help=argparse.SUPPRESS)
    tune.add_argument("--gloo-timeout-seconds", type=float, metavar="S", help=argparse.SUPPRESS)
    elastic = p.add_argument_group("elastic jobs (horovodrun's flags; ringflow.runner.elastic)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="makes the job elastic: an executable printing the hosts that may "
                              "run workers now, one HOST[:SLOTS] a line (run every second)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                         help="fewest workers to train with (default -np, else 1)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                         help="most workers at once (default: every listed slot)")
    elastic.add_argument("--slots-per-host", type=int, metavar="N",
                         help="slots of a discovered host whose line gives none (default 1)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="most times the job may re-form (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LO", "HI"),
                         help="a failed host may run workers again after min(HI, LO * 2**(k-1)) "
                              "s at its k-th failure (default: never)")
    elastic.add_argument("--elastic-timeout", type=float, metavar="S",
                         help="longest wait for --min-np workers, or for a worker to leave its "
                              "generation (default 600)")
    torch = p.add_argument_group("torchrun's flags (see the list below)")
    torch.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                       metavar="N", help="-np N on this host (N: a number, cpu, gpu or auto)")
    torch.add_argument("--nnodes", help=argparse.SUPPRESS)
    torch.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                       help=argparse.SUPPRESS)
    torch.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    torch.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                       help=argparse.SUPPRESS)
    torch.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="ADDR",
                       help="the workers' MASTER_ADDR (default: rank 0's host)")
    torch.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                       metavar="PORT", help="the workers' MASTER_PORT (default: a free port)")
    torch.add_argument("-m", "--module", action="store_true",
                       help="COMMAND is a Python module: run python -m COMMAND")
    torch.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                       help="run COMMAND as given, even a .py file")
    torch.add_argument("--run-path", "--run_path", dest="run_path", action="store_true",
                       help=argparse.SUPPRESS)
    torch.add_argument("--log-dir", "--log_dir", dest="log_dir", help=argparse.SUPPRESS)
    dialects.add_foreign(p)
    add("--config-file", metavar="FILE",
        help="YAML file with long flag names as keys, or horovodrun's nested sections")
    add("--check-build", "-cb", action="store_true",
        help="list what this installation can do and exit")
    add("-v", "--version", action="version", version=f"%(prog)s {_version()}")
    add("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


# --- what the flags mean --------------------------------------------------------------------------


def worker_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The ``RINGFLOW_*`` variables the tuning flags set for every worker."""
    env = {var: convert(getattr(args, dest)) for dest, (var, convert) in TUNING.items()
           if getattr(args, dest, None) is not None}
    if args.no_stall_check:
        env["RINGFLOW_STALL_WARNING_S"] = env["RINGFLOW_STALL_SHUTDOWN_S"] = "0"
        env["RINGFLOW_DEADLOCK_SHUTDOWN_S"] = "0"
    return env


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: What ringflow-run sets for every worker itself; ``-x`` may not set or forward these.
_SET_BY_LAUNCHER = frozenset(ENV_CONTRACT) | frozenset(TORCHRUN_ENV) | frozenset(HOROVOD_ENV)


def _exports(specs: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``-x`` values: the names to forward over ssh and the ``NAME=VALUE`` assignments.

    Raises:
        _Usage: not a variable name, or one that ringflow-run sets itself.
    """
    names: list[str] = []
    values: dict[str, str] = {}
    for spec in specs:
        name, eq, value = spec.partition("=")
        flag = f"-x {spec}"
        if not _NAME.match(name):
            raise _Usage((flag, f"{name!r} is not an environment variable name; expected "
                                "-x NAME or -x NAME=VALUE"))
        if name in ("MASTER_ADDR", "MASTER_PORT"):
            option = "--master-addr" if name == "MASTER_ADDR" else "--master-port"
            raise _Usage((flag, f"ringflow-run sets {name} for every worker; use {option} "
                                f"{value or name}"))
        if name in _SET_BY_LAUNCHER:
            raise _Usage((flag, f"ringflow-run sets {name} for every worker (from -np and "
                                "the hosts); it cannot be exported"))
        names.append(name)
        if eq:
            values[name] = value
    return names, values


def _count(value: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto``."""
    if value in ("cpu", "gpu", "auto"):
        from .check_build import _gpus

        gpus = len(_gpus()) if value != "cpu" else 0
        if value == "gpu" and not gpus:
            raise _Usage(("--nproc-per-node gpu", "nvidia-smi lists no GPU on this host; give "
                                                  "a number"))
        if gpus:
            return gpus
        affinity = getattr(os, "sched_getaffinity", None)
        return len(affinity(0)) if affinity else os.cpu_count() or 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise _Usage((f"--nproc-per-node {value}", "expected a number >= 1, cpu, gpu or auto"))
    return count


def _mpirun_hint(args: argparse.Namespace) -> str:
    words = ["mpirun", "-np", str(args.np or 2)]
    if args.hosts:
        words += ["-H", args.hosts]
    elif args.hostfile:
        words += ["--hostfile", args.hostfile]
    command = _command(args) or ["python", "train.py"]
    return (f"workers started by ringflow-run are not an MPI job, so the mpi transport cannot "
            f"join them; run `{shlex.join(words + command)}` instead (ringflow takes the mpi "
            "transport there when mpi4py is installed)")


def _command(args: argparse.Namespace) -> list[str]:
    """COMMAND as torchrun would run it: ``-m``, ``--run-path``, a bare ``.py`` file."""
    command = list(args.command)
    if not command or args.no_python:
        return command
    if args.module:
        return [sys.executable, "-m", *command]
    if args.run_path or (command[0].endswith(".py") and shutil.which(command[0]) is None):
        return [sys.executable, *command]
    return command


def _resolve(args: argparse.Namespace) -> None:
    """Apply the foreign flags to ``args``; collect their notes in ``args.notes``.

    Raises:
        _Usage: a refused flag (every one, one line each), or flags that contradict each other.
    """
    notes, refusals = dialects.answers(args, args.config_keys)
    refused: list[tuple[str | None, str]] = list(refusals)
    if args.module and (args.no_python or args.run_path):
        refused.append(("-m", "--module runs `python -m COMMAND`; drop --no-python/--run-path"))
    if args.mpi or args.transport == "mpi":
        dest = "mpi" if args.mpi else "transport"
        flag = dialects.spelled(args).get(dest, "--transport mpi")
        if dest in args.config_keys and dest not in dialects.spelled(args):
            flag = f"--config-file {args.config_keys[dest]}"
        refused.append((flag, _mpirun_hint(args)))
    if args.nnodes is not None and args.nnodes not in ("1", "1:1"):
        refused.append((f"--nnodes {args.nnodes}", dialects.NODES_TEXT))
    if args.node_rank not in (None, 0):
        refused.append((f"--node-rank {args.node_rank}", dialects.NODES_TEXT))
    if args.max_restarts not in (None, 0):
        refused.append((f"--max-restarts {args.max_restarts}", dialects.RESTARTS_TEXT))
    if args.nproc_per_node is not None:
        if args.hosts or args.hostfile:
            refused.append((f"--nproc-per-node {args.nproc_per_node}",
                            "it gives the ranks of this host only; with -H / --hostfile give "
                            "each host's slots there (host:N) and the total with -np"))
        else:
            count = _count(args.nproc_per_node)
            if args.np is not None and args.np != count:
                refused.append((f"--nproc-per-node {args.nproc_per_node}",
                                f"-np {args.np} says otherwise; give one of them"))
            args.np = count
    if args.log_dir is not None:
        if args.output_filename not in (None, args.log_dir):
            refused.append((f"--log-dir {args.log_dir}",
                            f"--output-filename {args.output_filename} says otherwise"))
        args.output_filename = args.log_dir
    if args.tcp_flag and args.transport not in (None, "tcp"):
        refused.append(("--tcp", f"--transport {args.transport} says otherwise"))
    try:
        args.export_names, args.assignments = _exports(args.export)
    except _Usage as exc:
        refused += exc.lines
    if refused:
        raise _Usage(*refused)
    if args.transport is None:
        args.transport = "tcp" if args.tcp_flag else "auto" if args.gloo else None
    args.command = _command(args)
    args.notes = [f"{flag}: {text}" for flag, text in notes]


def _parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        lines: list[tuple[str | None, str]] = []
        flags = list(parser._option_string_actions)
        for word in unknown:
            name = word.split("=", 1)[0]
            if not name.startswith("-"):
                lines.append((None, f"unrecognized argument {word!r}"))
                continue
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]}?" if close else f"; see {PROG} --help"
            lines.append((name, f"unknown flag{hint}"))
        raise _Usage(*lines)
    command = list(args.command)
    args.command = command[1:] if command[:1] == ["--"] else command
    return args


def _error(text: str, code: int = USAGE_ERROR) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return code


def _usage(exc: _Usage) -> int:
    for flag, text in exc.lines:
        print(f"{PROG}: {flag}: {text}" if flag else f"{PROG}: error: {text}", file=sys.stderr)
    return USAGE_ERROR


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    parser = _parser()
    try:
        args = _parse_args(parser, argv)
        keys: dict[str, str] = {}
        if args.config_file:
            values, keys = read_config_file(parser, args.config_file)
            parser.set_defaults(**values)
            args = _parse_args(parser, argv)  # the command line wins over the file
        args.config_keys = keys
        _resolve(args)
    except SystemExit as exc:  # --help, --version: argparse already wrote the text
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except _Usage as exc:
        return _usage(exc)
    except ConfigError as exc:
        return _error(str(exc))
    if args.check_build:
        return args
    elastic = ("--min-np", "--max-np", "--slots-per-host", "--reset-limit",
               "--blacklist-cooldown-range", "--elastic-timeout")
    given = [f for f in elastic if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.host_discovery_script is None and given:
        return _error(f"{given[0]} is for elastic jobs: add --host-discovery-script SCRIPT")
    if args.host_discovery_script is not None:
        return _check_elastic(args)
    if args.np is None:
        return _error(f"the following arguments are required: -np; e.g. {PROG} -np 2 python "
                      "train.py")
    if not args.command:
        return _error(f"no command given; e.g. {PROG} -np 2 python train.py")
    if args.start_timeout is not None and args.start_timeout <= 0:
        return _error(f"--start-timeout {args.start_timeout} must be > 0")
    return args


def _check_elastic(args: argparse.Namespace) -> argparse.Namespace | int:
    if args.hosts or args.hostfile:
        return _error("an elastic job takes its hosts from --host-discovery-script; drop -H / "
                      "--hostfile")
    args.min_np = args.min_np or args.np or 1
    args.max_np = args.max_np or 1 << 30
    for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                        ("--slots-per-host", args.slots_per_host or 1),
                        ("--elastic-timeout", args.elastic_timeout or 1)):
        if value <= 0:
            return _error(f"{flag} {value} must be > 0")
    if args.min_np > args.max_np:
        return _error(f"--min-np {args.min_np} is above --max-np {args.max_np}")
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        return _error(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: give "
                      "0 <= LO <= HI")
    if not args.command:
        return _error(f"no command given; e.g. {PROG} --min-np 2 --host-discovery-script "
                      "./hosts.sh python train.py")
    return args


@contextmanager
def _launcher_logging(level: str | None, verbose: bool) -> Iterator[None]:
    """The launcher's own records while the job runs: ``--log-level`` for the ``ringflow`` logger
    (as for the workers), ``--verbose`` at least INFO for ``ringflow.runner``; written by
    :class:`ringflow.logs.FallbackHandler` as ``[ringflow-run HH:MM:SS.mmm] LEVEL name: text``.
    The label and levels are put back afterwards (``main`` may run inside another program)."""
    from .. import logs

    ringflow_log, runner_log = logging.getLogger("ringflow"), logging.getLogger("ringflow.runner")
    saved = logs.label(), ringflow_log.level, runner_log.level
    logs.install()
    logs.set_label(PROG)
    if level is not None:
        ringflow_log.setLevel(_LOG_LEVELS[level.lower()].upper())
    if verbose and runner_log.getEffectiveLevel() > logging.INFO:
        runner_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        logs.set_label(saved[0])
        ringflow_log.setLevel(saved[1])
        runner_log.setLevel(saved[2])


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        kind = "warning" if record.levelno >= logging.WARNING else "note"
        self.lines.append(f"{PROG}: {kind}: {record.getMessage()}")


@contextmanager
def _config_messages() -> Iterator[list[str]]:
    """What :class:`~ringflow.config.Config` logs meanwhile (unknown ``RINGFLOW_*`` names,
    ``HOROVOD_*`` variables read or ignored), as lines for stderr."""
    logger = logging.getLogger("ringflow.config")
    handler, level, propagate = _Collect(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _worker_env(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[
        dict[str, str], list[str]]:
    """The environment every worker starts from, and the lines to write about it.

    ``environ``, then ``-x NAME=VALUE``, then the RINGFLOW_* variables of the flags, then what
    ``HOROVOD_*`` variables mean where no RINGFLOW_* variable is set.

    Raises:
        ConfigError: a bad tuning value (flag, RINGFLOW_* or HOROVOD_* variable).
    """
    from ..config import Config, read_horovod_env

    env = {**environ, **args.assignments, **worker_overrides(args)}
    env.setdefault("RINGFLOW_BIND_TO", "auto")  # as mpirun binds by default (topology.py)
    with _config_messages() as messages:
        Config.from_env(env)  # bad tuning values fail here, before anything starts
    env.update(read_horovod_env(env).values)
    return env, messages


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ringflow-run`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = _parse(argv)
    if isinstance(args, int):
        return args
    if args.check_build:
        from .check_build import check_build

        sys.stdout.write(check_build(_version()))
        return 0
    if args.host_discovery_script is not None:
        return _main_elastic(args)
    try:
        if args.hostfile:
            hosts = parse_hostfile(args.hostfile)
        elif args.hosts:
            hosts = parse_hosts(args.hosts)
        else:
            hosts = [Host("localhost", max(args.np, 1))]
        workers = assign_ranks(hosts, args.np)
        where = sorted({w.host for w in workers})
        if args.standalone and not all(is_local(h) for h in where):
            raise _Usage(("--standalone", f"it runs on this host only, but the job uses "
                                          f"{', '.join(where)}; drop --standalone or -H"))
        if args.transport == "shm" and len(where) > 1:
            raise _Usage(("--transport shm", f"shared memory joins the ranks of one host, but "
                                             f"the job spans {len(where)} hosts; use "
                                             "--transport auto (shared memory within hosts, "
                                             "TCP across)"))
        env, messages = _worker_env(args, os.environ)
        if args.auto:  # ringflow.torch.auto in every worker (ringflow/runner/_autostart)
            from ._autostart import worker_pythonpath

            env["PYTHONPATH"] = worker_pythonpath(env)
        if args.network_interface and any(is_local(w.host) for w in workers):
            from .netif import interface_ipv4

            env = {**env, "RINGFLOW_BIND_ADDR": interface_ipv4(args.network_interface)}
    except _Usage as exc:
        return _usage(exc)
    except (LaunchError, ConfigError) as exc:
        return _error(str(exc))
    for line in [f"{PROG}: note: {note}" for note in args.notes] + messages:
        print(line, file=sys.stderr)

    with _launcher_logging(args.log_level, args.verbose):
        return _run(args, workers, where, env)


def _main_elastic(args: argparse.Namespace) -> int:
    from .elastic import ElasticSettings, run_elastic

    try:
        env, messages = _worker_env(args, os.environ)
    except (LaunchError, ConfigError) as exc:
        return _error(str(exc))
    for line in [f"{PROG}: note: {note}" for note in args.notes] + messages:
        print(line, file=sys.stderr)
    if args.network_interface:  # the workers on this machine listen there too
        try:
            from .netif import interface_ipv4

            env = {**env, "RINGFLOW_BIND_ADDR": interface_ipv4(args.network_interface)}
        except LaunchError as exc:
            return _error(str(exc))
    cooldown = args.blacklist_cooldown_range
    settings = ElasticSettings(
        min_np=args.min_np, max_np=args.max_np,
        discovery_script=os.path.abspath(args.host_discovery_script)
        if os.sep in args.host_discovery_script else args.host_discovery_script,
        slots_per_host=args.slots_per_host or 1, reset_limit=args.reset_limit,
        cooldown=None if cooldown is None else (cooldown[0], cooldown[1]),
        elastic_timeout_s=args.elastic_timeout or 600.0, ssh=_ssh_options(args),
        network_interface=args.network_interface)
    with _launcher_logging(args.log_level, args.verbose):
        try:
            return run_elastic(args.command, settings, base_env=env, handle_signals=True,
                               start_timeout_s=args.start_timeout or 30.0)
        except LaunchError as exc:
            return _error(str(exc), 1)


def _ssh_options(args: argparse.Namespace) -> SshOptions:
    return SshOptions(
        port=args.ssh_port, identity_file=args.ssh_identity_file,
        config_file=args.ssh_config_file, host_key_checking=not args.disable_host_key_checking,
        export=tuple(args.export_names), bind_interface=args.network_interface,
    )


def _run(args: argparse.Namespace, workers: list[Any], where: list[str],
         env: dict[str, str]) -> int:
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="replace")
    ssh = _ssh_options(args)
    log.debug("%d workers on %s: %s", len(workers), ", ".join(where), args.command)
    try:
        result = run_job(
            args.command, workers, base_env=env, handle_signals=True, ssh=ssh,
            start_timeout_s=args.start_timeout or 30.0,
            network_interface=args.network_interface, output_dir=args.output_filename,
            timestamps=args.prefix_timestamp, master_addr=args.master_addr,
            master_port=args.master_port,
        )
    except LaunchError as exc:
        return _error(str(exc), 1)
    report = result.report(PROG)
    if report:
        print(report, file=sys.stderr, flush=True)
    return result.returncode
