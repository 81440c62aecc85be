"""The horovodrun, torchrun and mpirun spellings that ``ringflow-run`` answers (see :mod:`.cli`).

Three kinds, one table each:

* :data:`MAPPED` -- spellings with a ringflow meaning. The options themselves live in
  :func:`ringflow.runner.cli._parser` (aliases of ringflow's flags, or flags that
  :mod:`.cli` resolves); this table is what ``--help`` and the docs list.
* :data:`NOTES` -- accepted, without effect in ringflow; each one used writes a one-line note to
  stderr that says why, and the job runs.
* :data:`REFUSED` -- ringflow cannot do what they ask; each is a one-line usage error (exit 2)
  that says why and what to do instead.

:func:`add_foreign` registers :data:`NOTES` and :data:`REFUSED` on a parser (hidden from the
option list: the epilog, :func:`epilog`, lists them); :func:`answers` says what a parsed
namespace used of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["MAPPED", "NOTES", "REFUSED", "Foreign", "add_foreign", "answers", "epilog",
           "spelled"]

#: (spellings, meaning) of the foreign spellings that ringflow-run maps onto its own behaviour.
MAPPED: tuple[tuple[str, str], ...] = (
    ("--num-proc N", "-np N (horovodrun)"),
    ("-cb", "--check-build (horovodrun)"),
    ("-hostfile FILE, -machinefile FILE, --machinefile FILE", "--hostfile FILE"),
    ("-prefix-timestamp, --prefix-output-with-timestamp", "--prefix-timestamp (horovodrun)"),
    ("--gloo", "--transport auto: ringflow's own TCP and shared-memory transports play Gloo's "
               "part"),
    ("--tcp", "--transport tcp: TCP only, no shared memory"),
    ("--stall-check", "undoes --no-stall-check (the stall check is on by default)"),
    ("--gloo-timeout-seconds S", "the workers' RINGFLOW_TIMEOUT_S (how long one wait on a peer "
                                 "may take; else --start-timeout's)"),
    ("--nproc-per-node N, --nproc_per_node N",
     "-np N on this host (torchrun); N may be cpu, gpu or auto as in torchrun"),
    ("--nnodes 1, --standalone, --node-rank 0, --max-restarts 0",
     "accepted: one host, never restarted, as every ringflow-run job without -H"),
    ("--master-addr A, --master_addr A", "the workers' MASTER_ADDR (default: rank 0's host)"),
    ("--master-port P, --master_port P",
     "the workers' MASTER_PORT (default: a free port, reserved for the job)"),
    ("-m, --module", "COMMAND is a module: run `python -m COMMAND` (torchrun)"),
    ("--no-python, --no_python", "run COMMAND as given, even a .py file"),
    ("--run-path, --run_path", "run COMMAND (a file) with this Python"),
    ("--log-dir DIR, --log_dir DIR", "--output-filename DIR (DIR/rank.N/stdout and stderr)"),
    ("-x NAME=VALUE", "set NAME=VALUE for every worker (mpirun); -x NAME forwards the "
                      "launcher's value to remote workers"),
    ("--timestamp-output, --output-filename, --bind-to core|none", "as in mpirun"),
)

_NODES = ("ringflow-run starts the whole job from one host: list every host with "
          "-H node1:N,node2:N (or --hostfile) and the total with -np, instead of one launcher "
          "per node")
_RDZV = ("ringflow-run runs the job's rendezvous itself (an authenticated store on a free port); "
         "for several hosts list them with -H node1:N,node2:N")
_NO_MPIRUN = "ringflow-run does not start mpirun"


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A foreign flag answered with a note (accepted) or a refusal (usage error)."""

    flags: tuple[str, ...]
    text: str
    #: Values it takes: 0 (a switch), 1 or 2.
    nargs: int = 0
    #: Whether the switch turns something on; an "off" switch (``--no-autotune``) is silent.
    on: bool = True
    dest: str = ""

    @property
    def key(self) -> str:
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")


def _off(flag: str, dest: str) -> Foreign:
    return Foreign((flag,), "", on=False, dest=dest)


#: Accepted with a one-line note: no effect in ringflow.
NOTES: tuple[Foreign, ...] = (
    Foreign(("--disable-cache",), "ringflow-run keeps no cache between runs (it checks every "
                                  "host each time); nothing to disable"),
    Foreign(("--hierarchical-allreduce",),
            "ringflow picks the hierarchical allreduce itself (shared memory within each host, a "
            "ring across hosts) whenever every host runs the same number of ranks; "
            "--transport tcp gives a flat ring"),
    Foreign(("--no-hierarchical-allreduce",),
            "ringflow picks the hierarchical allreduce itself whenever every host runs the same "
            "number of ranks; --transport tcp gives a flat ring", dest="no_hierarchical_allreduce"),
    Foreign(("--hierarchical-allgather",),
            "ringflow's allgather is a ring over all ranks; there is no hierarchical variant"),
    _off("--no-hierarchical-allgather", "hierarchical_allgather"),
    *(Foreign((f"--autotune-{name}",), "ringflow's autotuner is a coordinate search, not "
                                      "Bayesian optimisation; --autotune-steps-per-sample sets "
                                      "its sample length", nargs=1)
      for name in ("bayes-opt-max-samples", "gaussian-process-noise")),
    Foreign(("--timeline-mark-cycles",), "ringflow has no cycles to mark (negotiation is "
                                         "event-driven); the timeline is written without them"),
    _off("--no-timeline-mark-cycles", "timeline_mark_cycles"),
    Foreign(("--mpi-threads-disable",), "ringflow-run starts no MPI (under mpirun the mpi "
                                        "transport needs MPI_THREAD_MULTIPLE)"),
    _off("--no-mpi-threads-disable", "mpi_threads_disable"),
    Foreign(("--num-nccl-streams",), "ringflow takes no number of NCCL streams", nargs=1),
    Foreign(("--ccl-bgt-affinity",), "ringflow does not use oneCCL", nargs=1),
    Foreign(("--thread-affinity",), "ringflow does not pin its background thread alone; "
                                    "--bind-to core pins each rank to its slice of the CPUs",
            nargs=1),
    Foreign(("--log-with-timestamp", "--no-log-hide-timestamp"),
            "ringflow's log lines carry no timestamp; --prefix-timestamp stamps every output "
            "line", dest="log_with_timestamp"),
    _off("--log-without-timestamp", "log_with_timestamp"),
    _off("--log-hide-timestamp", "log_with_timestamp"),
    Foreign(("--monitor-interval", "--monitor_interval"),
            "ringflow-run checks its workers every 20 ms", nargs=1),
    Foreign(("--start-method", "--start_method"),
            "ringflow-run starts every worker as a new process running COMMAND", nargs=1),
    Foreign(("--role",), "ringflow jobs have one role (ROLE_NAME=default)", nargs=1),
    Foreign(("-r", "--redirects", "-t", "--tee"),
            "ringflow-run relays every rank's stdout and stderr prefixed [rank]:; "
            "--output-filename DIR writes them to files instead", nargs=1, dest="redirects"),
    Foreign(("--local-ranks-filter", "--local_ranks_filter"),
            "ringflow-run shows every rank's output", nargs=1),
    Foreign(("--allow-run-as-root",), "ringflow-run runs as any user; nothing to allow"),
    Foreign(("--tag-output",), "ringflow-run always prefixes each output line with [rank]:"),
)

#: Refused with a one-line reason (exit code 2).
REFUSED: tuple[Foreign, ...] = (
    Foreign(("--mpi",), "", dest="mpi"),  # its text names the mpirun command: see cli
    Foreign(("--jsrun",), "ringflow-run does not start jsrun; start the job with jsrun "
                          "yourself, as with mpirun"),
    Foreign(("--mpi-args",), f"{_NO_MPIRUN}; run `mpirun ARGS python train.py` yourself "
                             "(ringflow joins mpirun jobs)", nargs=1),
    Foreign(("--binding-args",), f"{_NO_MPIRUN}; --bind-to core pins each rank to its slice of "
                                 "its host's CPUs", nargs=1),
    *(Foreign((f"--rdzv-{n}", f"--rdzv_{n}"), _RDZV, nargs=1)
      for n in ("backend", "endpoint", "id", "conf")),
    Foreign(("--local-addr", "--local_addr"), "use --network-interface IF (the interface that "
                                              "connects the hosts)", nargs=1),
    Foreign(("-mca", "--mca"), f"MCA parameters configure Open MPI, and {_NO_MPIRUN}; run "
                               "mpirun yourself (ringflow joins mpirun jobs)", nargs=2),
    Foreign(("--map-by",), "ringflow-run places ranks host by host, filling the slots of "
                           "-H host:N in order", nargs=1),
    Foreign(("--oversubscribe",), "ringflow-run never oversubscribes: -np must fit in the slots "
                                  "of -H host:N; raise the slots"),
)

#: The texts of the torchrun flags that cli resolves itself (accepted with one value only).
NODES_TEXT = _NODES
RESTARTS_TEXT = "ringflow jobs are not restarted: the first failing rank ends the job"


class _Record(argparse.Action):
    """Stores the value (``True``/``False`` for a switch) and how the flag was spelled."""

    def __init__(self, option_strings: Sequence[str], dest: str, on: bool = True,
                 **kwargs: Any) -> None:
        self.on = on
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        value = self.on if self.nargs == 0 else values
        setattr(namespace, self.dest, value[0] if isinstance(value, list) and
                self.nargs == 1 else value)
        spelled(namespace)[self.dest] = option_string or self.option_strings[0]


def spelled(namespace: argparse.Namespace) -> dict[str, str]:
    """dest -> the option string the command line used for it (foreign flags only)."""
    found = getattr(namespace, "_spelled", None)
    if found is None:
        found = {}
        setattr(namespace, "_spelled", found)  # noqa: B010 - a private attribute
    return found


def add_foreign(parser: argparse.ArgumentParser) -> None:
    """Register :data:`NOTES` and :data:`REFUSED` (hidden from the option list)."""
    for entry in (*NOTES, *REFUSED):
        kwargs: dict[str, Any] = {"default": None, "help": argparse.SUPPRESS,
                                  "nargs": entry.nargs}
        if entry.nargs:
            kwargs["metavar"] = "X" if entry.nargs == 1 else ("X", "Y")
        parser.add_argument(*entry.flags, dest=entry.key, action=_Record, on=entry.on,
                            **kwargs)


def answers(args: argparse.Namespace, config_keys: dict[str, str]) -> tuple[
        list[tuple[str, str]], list[tuple[str, str]]]:
    """The (flag, text) notes and refusals for what ``args`` used of :data:`NOTES` and
    :data:`REFUSED`. ``config_keys`` (dest -> ``--config-file`` key) names values that came from
    the config file. Notes that share a text are merged into one."""
    typed = spelled(args)
    notes: dict[str, list[str]] = {}
    refusals: list[tuple[str, str]] = []
    for entry in (*NOTES, *REFUSED):
        value = getattr(args, entry.key, None)
        if not entry.text or not entry.on:
            continue
        if (value is not True) if entry.nargs == 0 else (value is None):
            continue
        if entry.key in typed:
            flag = typed[entry.key]
        elif entry.key in config_keys:
            flag = f"--config-file {config_keys[entry.key]}"
        else:
            flag = entry.flags[0]
        if entry in REFUSED:
            refusals.append((flag, entry.text))
        elif flag not in notes.setdefault(entry.text, []):
            notes[entry.text].append(flag)
    return [(", ".join(flags), text) for text, flags in notes.items()], refusals


def epilog() -> str:
    """The ``--help`` epilog: every foreign spelling and what ringflow-run does with it."""
    column = 36
    lines = ["horovodrun, torchrun and mpirun spellings (details: pydoc ringflow.runner.cli):"]
    for spelling, meaning in MAPPED:
        text = textwrap.wrap(f"= {meaning}", 96 - column, subsequent_indent="  ")
        if len(spelling) > column - 2:
            lines.append(f"  {spelling}")
        else:
            lines.append(f"  {spelling:{column - 2}}{text.pop(0)}")
        lines += [" " * column + part for part in text]
    lines.append("accepted; those that ask for what ringflow lacks write a one-line note on why:")
    lines += _wrapped([f for e in NOTES for f in e.flags])
    lines.append("refused with a one-line reason and what to do instead (exit code 2):")
    lines += _wrapped([f for e in REFUSED for f in e.flags]
                      + ["--transport mpi", "--nnodes N>1", "--node-rank K>0",
                         "--max-restarts N>0"])
    lines += textwrap.wrap(
        "--config-file also reads horovodrun's nested form (params:, timeline:, stall_check:, "
        "autotune:, library_options:, logging:, controller:). HOROVOD_* tuning variables are "
        "read with their RINGFLOW_* meaning, with a warning that names it.", 96)
    return "\n".join(lines)


def _wrapped(words: list[str], width: int = 96) -> list[str]:
    lines: list[str] = []
    line = " "
    for word in words:
        if len(line) + len(word) + 2 > width:
            lines.append(line.rstrip(","))
            line = " "
        line += f" {word},"
    lines.append(line.rstrip(","))
    return lines
