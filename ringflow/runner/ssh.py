"""How ``ringflow-run`` starts a worker on another host: one ``ssh`` per rank.

For the worker of rank ``r`` on ``host`` the launcher runs (an argv list, no local shell)::

    ssh -T -o BatchMode=yes -o ConnectTimeout=START_TIMEOUT [-p PORT] [-i IDENTITY] [-F CONFIG] \\
        [HOST-KEY OPTIONS] HOST -- \\
        'cd CWD && exec env -- NAME=VALUE ... PYTHON -m ringflow.runner.remote \\
         [--bind-interface IF] -- COMMAND ARGS...'

* The remote command line is built with :func:`shlex.quote` for every word (the working directory,
  each variable, each argument), since sshd hands it to the remote user's shell. Host names that
  start with ``-`` are rejected, so a host can never become an ssh option.
* ``ConnectTimeout``: ``--start-timeout`` (default 30 s), so a host that does not answer ends the
  job with ssh's exit status 255 and its "timed out" in the report instead of hanging it.
* ``BatchMode=yes``: ssh never prompts for a password or a host key; an unknown host fails at once.
  Host-key checking stays as the user's ssh configuration has it; only ``host_key_checking=False``
  (``--disable-host-key-checking``) adds ``StrictHostKeyChecking=no`` and a throwaway
  ``UserKnownHostsFile``.
* The environment is not the launcher's: only the ``RINGFLOW_*`` contract and knobs, torchrun's
  variables (``RANK``, ``MASTER_ADDR``, ...: :data:`~ringflow.runner.launch.TORCHRUN_ENV`), and
  the allow-list :data:`FORWARDED` / :data:`FORWARDED_PREFIXES` (interpreter and library paths,
  locale, thread counts, NCCL and CUDA settings), plus names given with ``-x`` (``-x NAME=VALUE``
  puts that value in the worker's environment first). Tokens and keys in the launcher's
  environment stay on the launcher's host.
* The secret is written to ssh's stdin (one line of hex), never to its argv; the remote bootstrap
  (:mod:`ringflow.runner.remote`) reads it and hands it to the worker on a pipe
  (``RINGFLOW_SECRET_FD``). ssh's stdin stays open for the life of the job: when the launcher dies,
  the connection closes, the bootstrap sees end-of-file and kills the worker.
* ``PYTHON`` is this launcher's ``sys.executable``: like horovodrun, ringflow-run expects the same
  installation path on every host (a shared filesystem, an image, or a virtualenv at one path).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from ..errors import LaunchError

__all__ = ["FORWARDED", "FORWARDED_PREFIXES", "SshOptions", "remote_environ", "ssh_argv"]

#: Variables copied from the launcher's environment to remote workers when set.
FORWARDED = frozenset({
    "PATH", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
    "PYTHONWARNINGS", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV",
    "LANG", "LANGUAGE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GLIBC_TUNABLES",
    # torchrun's contract, which every worker gets (launch.TORCHRUN_ENV).
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    # horovodrun's (launch.HOROVOD_ENV)
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
})
#: Prefixes of variables copied likewise (ringflow's own knobs, locale, NCCL tuning).
FORWARDED_PREFIXES = ("RINGFLOW_", "LC_", "NCCL_")
#: Never forwarded: the secret's carriers and the supervisor's lifeline, which are per process
#: and host.
_NEVER = frozenset({"RINGFLOW_SECRET_FD", "RINGFLOW_SECRET_FILE", "RINGFLOW_LAUNCHER_PID",
                    "RINGFLOW_LIFELINE"})


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach remote hosts (``-p``, ``-i``, ``--ssh-config-file``, ...)."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    host_key_checking: bool = True
    #: Extra variable names to forward (``-x NAME``, and the names of ``-x NAME=VALUE``).
    export: tuple[str, ...] = ()
    #: ``--network-interface``: resolved on each remote host into ``RINGFLOW_BIND_ADDR``.
    bind_interface: str | None = None
    #: ssh's ``ConnectTimeout`` in seconds (``None``: ssh's own, which for a host that drops
    #: SYNs is the kernel's, minutes). :func:`~ringflow.runner.launch.run_job` sets it to
    #: ``--start-timeout`` unless given; on the command line it wins over any ssh config file.
    connect_timeout: float | None = None
    python: str = dataclasses.field(default_factory=lambda: sys.executable)
    cwd: str = dataclasses.field(default_factory=os.getcwd)


def remote_environ(env: Mapping[str, str], export: Sequence[str] = ()) -> dict[str, str]:
    """The part of a worker's environment that travels to a remote host (see the module doc)."""
    names = FORWARDED | set(export)
    return {
        k: v for k, v in env.items()
        if k not in _NEVER and (k in names or k.startswith(FORWARDED_PREFIXES))
    }


def ssh_argv(
    host: str, command: Sequence[str], env: Mapping[str, str], opts: SshOptions
) -> list[str]:
    """The local argv that runs ``command`` on ``host`` under the remote bootstrap.

    ``env`` is the worker's full environment; :func:`remote_environ` filters it.

    Raises:
        LaunchError: ``host`` starts with ``-`` or is empty.
    """
    if not host or host.startswith("-"):
        raise LaunchError(
            f"host {host!r} is not a valid host name for ssh (it must not be empty or start "
            "with '-'); fix -H / --hostfile"
        )
    argv = ["ssh", "-T", "-o", "BatchMode=yes"]
    if opts.connect_timeout is not None:
        argv += ["-o", f"ConnectTimeout={max(1, math.ceil(opts.connect_timeout))}"]
    if opts.port is not None:
        argv += ["-p", str(opts.port)]
    if opts.identity_file:
        argv += ["-i", opts.identity_file]
    if opts.config_file:
        argv += ["-F", opts.config_file]
    if not opts.host_key_checking:
        argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                 "-o", "LogLevel=ERROR"]
    bootstrap = [opts.python, "-m", "ringflow.runner.remote"]
    if opts.bind_interface:
        bootstrap += ["--bind-interface", opts.bind_interface]
    assignments = [f"{k}={v}" for k, v in sorted(remote_environ(env, opts.export).items())]
    remote = (
        f"cd {shlex.quote(opts.cwd)} && exec env -- "
        + shlex.join([*assignments, *bootstrap, "--", *command])
    )
    # IPv6 literals are given to ssh without brackets; ssh takes the host as one argv word.
    return [*argv, host, "--", remote]
