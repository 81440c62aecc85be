"""How a process of a job finds the rendezvous store, whichever launcher started it.

:func:`connect_store` tries, in order:

1. **ringflow-run / ringflow.run** (``detector == "ringflow"``): the launcher's store, named by
   ``RINGFLOW_RENDEZVOUS_ADDR/PORT``, with the job secret on the inherited descriptor
   ``RINGFLOW_SECRET_FD`` (DESIGN.md section 5).
2. **An address variable** (any launcher: ``srun``, ``torchrun``, ``mpirun`` without mpi4py, or a
   script of your own): ``RINGFLOW_RENDEZVOUS_ADDR`` and ``RINGFLOW_RENDEZVOUS_PORT`` name a host
   and port that *rank 0* listens on (it starts the store there; the others connect to it), and
   ``RINGFLOW_SECRET_FILE`` names a file holding the job secret as hex text (mode 0600). Under
   ``torchrun`` the address defaults to ``MASTER_ADDR``; the port does not default to
   ``MASTER_PORT``, which torchrun's own store already holds. The secret is the one part that
   needs care: it must reach every rank without entering a command line or a world-readable
   place, e.g. created in a private directory of a shared filesystem before ``srun``::

       umask 077; openssl rand -hex 32 > ~/.ringflow/job.key
       RINGFLOW_RENDEZVOUS_ADDR=$(scontrol show hostnames | head -n1) \\
       RINGFLOW_RENDEZVOUS_PORT=29400 RINGFLOW_SECRET_FILE=~/.ringflow/job.key \\
       srun -N2 --ntasks-per-node=2 python train.py

   Anyone who can read that file can join the job, exactly as anyone who knows ringflow-run's
   secret could; ringflow cannot protect a secret that the filesystem does not.
3. **MPI** (``detector`` ``openmpi`` or ``pmi``, and mpi4py importable; imported only here):
   rank 0 of ``MPI.COMM_WORLD`` draws a fresh secret, starts a store -- on 127.0.0.1 when every
   rank is on its host, else on ``RINGFLOW_BIND_ADDR`` or the address its host name resolves to --
   and broadcasts (address, port, secret) over MPI, which is the launcher's own channel; an error
   on rank 0 is broadcast too, so no rank waits. Nothing is written to the environment, so a
   later ``init()`` (after ``shutdown()``) takes the same path and gets a fresh store and secret.

Otherwise :class:`~ringflow.errors.ConfigError` says which of these to set up. A store started
here lives until the process exits (a later ``init()`` reuses the one at a fixed port; keys of
each ``init()`` have their own prefix).

``ringflow.init(comm=...)`` (an mpi4py communicator) skips the environment: :func:`comm_info`
derives the RankInfo from the communicator, and ``connect_store(..., comm=comm)`` runs step 3
over that communicator instead of ``COMM_WORLD`` (needed only when RINGFLOW_TRANSPORT names a
transport other than ``mpi``, which needs no store).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from . import rendezvous
from .errors import ConfigError, RingflowError
from .topology import RankInfo

__all__ = ["comm_info", "connect_store"]

# Stores this process serves, by (address, port); a fixed-port one is reused by a later init().
_servers: dict[tuple[str, int], Any] = {}


def _close_servers() -> None:
    while _servers:
        with contextlib.suppress(RingflowError, OSError):
            _servers.popitem()[1].close()


atexit.register(_close_servers)


def comm_info(comm: Any) -> RankInfo:
    """This process's RankInfo in the job made of the ranks of mpi4py communicator ``comm``.

    Collective over ``comm``. Local values come from ``MPI_Comm_split_type(SHARED)`` (the ranks
    of ``comm`` on this host), cross values from splitting by local rank (as Horovod does), so
    they are exact whatever the mapping of ranks to hosts.

    Raises:
        ConfigError: ``comm`` is not an mpi4py intracommunicator.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"init(comm=...) needs mpi4py ({exc}); pip install 'ringflow[mpi]'"
                          ) from exc
    if not isinstance(comm, MPI.Comm) or comm.Is_inter():
        raise ConfigError(f"init(comm=...) needs an mpi4py intracommunicator (e.g. "
                          f"MPI.COMM_WORLD.Split(color, key)), got {type(comm).__name__}")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(local.Get_rank(), comm.Get_rank())
    try:
        return RankInfo(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(),
                        cross.Get_rank(), cross.Get_size(), socket.gethostname(), "mpi")
    finally:
        local.Free()
        cross.Free()


def connect_store(info: RankInfo, timeout: float, environ: Mapping[str, str] | None = None,
                  comm: Any = None) -> Any:
    """The job's rendezvous store for a process of a multi-process job (see the module doc).

    With ``comm`` (an mpi4py communicator, from ``init(comm=...)``) rank 0 of ``comm`` starts
    the store and broadcasts it over ``comm``, whatever the environment says.

    Raises:
        ConfigError: the environment names no way to reach the other ranks, or names one that
            cannot be used (no secret, a bad port, an address rank 0 cannot listen on).
        PeerError / RingflowTimeoutError: the store could not be reached within ``timeout``.
    """
    env = os.environ if environ is None else environ
    if comm is not None:
        from mpi4py import MPI

        return _over_mpi(MPI, info, timeout, comm)
    if info.detector == "ringflow":
        return rendezvous.connect(env, timeout=timeout)
    addr = env.get("RINGFLOW_RENDEZVOUS_ADDR", "")
    if not addr and info.detector == "torchrun":
        addr = env.get("MASTER_ADDR", "")
    if addr or env.get("RINGFLOW_RENDEZVOUS_PORT"):
        return _served_by_rank0(info, addr, env, timeout)
    if info.detector in ("openmpi", "pmi"):
        try:
            from mpi4py import MPI
        except ImportError:
            pass
        else:
            return _over_mpi(MPI, info, timeout)
    raise ConfigError(
        f"this process was started by {info.detector} as rank {info.rank} of {info.size}, but no "
        "ringflow rendezvous is configured; start the job with ringflow-run, install mpi4py "
        "(under mpirun), or set RINGFLOW_RENDEZVOUS_ADDR, RINGFLOW_RENDEZVOUS_PORT and "
        "RINGFLOW_SECRET_FILE (see ringflow.bootstrap)"
    )


def _served_by_rank0(info: RankInfo, addr: str, env: Mapping[str, str], timeout: float) -> Any:
    port_text = env.get("RINGFLOW_RENDEZVOUS_PORT", "")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not addr or not 0 < port < 65536:
        raise ConfigError(
            f"RINGFLOW_RENDEZVOUS_ADDR={addr!r} / RINGFLOW_RENDEZVOUS_PORT={port_text!r}: "
            f"a {info.detector} job needs both, a host that rank 0 runs on and a free port "
            "(1 to 65535) that every rank can reach"
        )
    try:
        secret = rendezvous.read_secret(env)
    except ConfigError as exc:
        raise ConfigError(
            f"RINGFLOW_RENDEZVOUS_ADDR is set for a {info.detector} job, but the job secret is "
            f"missing ({exc}); write a secret (hex) to a file readable only by you and set "
            "RINGFLOW_SECRET_FILE to it on every rank"
        ) from exc
    if info.rank == 0 and (addr, port) not in _servers:
        try:
            _servers[addr, port] = rendezvous.StoreServer(secret, host=addr, port=port,
                                                         timeout=timeout)
        except ConfigError as exc:
            raise ConfigError(
                f"rank 0 cannot start the rendezvous store at RINGFLOW_RENDEZVOUS_ADDR={addr!r} "
                f"RINGFLOW_RENDEZVOUS_PORT={port}: {exc}; rank 0 must run on that host and the "
                "port must be free"
            ) from exc
    return rendezvous.TCPStore(addr, port, secret, timeout)


def _mpi_store_host(info: RankInfo) -> str:
    if info.local_size >= info.size:
        return "127.0.0.1"
    explicit = os.environ.get("RINGFLOW_BIND_ADDR", "")
    if explicit:
        return explicit
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = ""
    if not host or host.startswith("127."):
        raise ConfigError(
            f"rank 0 cannot tell which address the other hosts reach it on (its host name "
            f"{socket.gethostname()!r} resolves to {host or 'nothing'}); set RINGFLOW_BIND_ADDR "
            "to this host's address on the network that connects the hosts (mpirun -x)"
        )
    return host


def _over_mpi(mpi: Any, info: RankInfo, timeout: float, comm: Any = None) -> Any:
    from . import wire

    comm = mpi.COMM_WORLD if comm is None else comm
    if comm.Get_size() != info.size or comm.Get_rank() != info.rank:
        raise ConfigError(
            f"the MPI communicator has rank {comm.Get_rank()} of {comm.Get_size()}, but the "
            f"{info.detector} environment says rank {info.rank} of {info.size}; unset stale "
            "launcher variables"
        )
    message: tuple[str, ...]
    if info.rank == 0:
        try:
            secret = wire.new_secret()
            server = rendezvous.StoreServer(secret, _mpi_store_host(info), 0, timeout)
            _servers[server.host, server.port] = server
            message = ("ok", server.host, str(server.port), secret.hex())
        except (RingflowError, OSError) as exc:
            message = ("error", f"{type(exc).__name__}: {exc}")
        comm.bcast(message, root=0)
    else:
        message = comm.bcast(None, root=0)
    if message[0] != "ok":
        raise ConfigError(f"rank 0 could not start the rendezvous store: {message[1]}")
    _, host, port, secret_hex = message
    return rendezvous.TCPStore(host, int(port), bytes.fromhex(secret_hex), timeout)
