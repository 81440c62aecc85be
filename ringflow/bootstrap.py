"""How a process of a job finds the rendezvous store, whichever launcher started it.

:func:`connect_store` picks the first that applies (the detector names come from
:mod:`ringflow.topology`):

- ``init(comm=...)``, or mpirun with mpi4py (detectors ``openmpi``, ``pmi``): rank 0 starts
  ringflow's store and broadcasts (address, port, a fresh secret) over the MPI communicator, the
  launcher's own channel. Closed.
- ringflow-run, ``ringflow.run``, RayExecutor (``ringflow``): the launcher's store at
  ``RINGFLOW_RENDEZVOUS_ADDR/PORT``; the secret on an inherited pipe (``RINGFLOW_SECRET_FD``).
  Closed.
- ``RINGFLOW_RENDEZVOUS_PORT`` set (any launcher): rank 0 serves ringflow's store there, on
  ``RINGFLOW_RENDEZVOUS_ADDR`` (else ``MASTER_ADDR``); the secret from ``RINGFLOW_SECRET_FILE``.
  As closed as that file.
- ``init(init_method="file:///dir")``: ringflow's FileStore in that directory (mode 0700); rank 0
  writes the data-plane secret into it. As closed as the directory.
- ``torch`` (torch.distributed already initialised): its default group's store; rank 0
  publishes a fresh data-plane secret there. Open.
- ``torchrun``: torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``; rank 0 publishes a fresh
  secret there. Open.
- ``env`` (``env://``) and ``init(init_method="tcp://host:port")``: rank 0 serves torch's
  multi-tenant TCPStore there, bound to that address (a later ``init_process_group`` with the
  same address shares it); rank 0 publishes a fresh secret. Open. Without torch, or with
  ``RINGFLOW_SECRET_FILE`` set, ringflow's own store there, keyed by that file (closed) or by
  the address (open).
- ``slurm`` (srun): rank 0 serves ringflow's store on the first node of the step
  (``SLURM_STEP_NODELIST``; a list with bracketed ranges is expanded by ``scontrol show
  hostnames`` or python-hostlist; or ``MASTER_ADDR``), port ``MASTER_PORT`` or
  ``20000 + (31 * SLURM_JOB_ID + SLURM_STEP_ID) mod 10000``; keyed by
  ``RINGFLOW_SECRET_FILE`` (closed) or by the address (open).

*Open* means: whoever can reach that port can read the keys, join the job, and send the ranks
control messages they will unpickle, exactly as with torch.distributed's own stores; use it on a
network you trust, or give every rank a ``RINGFLOW_SECRET_FILE`` (hex text, mode 0600) to close
it. ringflow never puts a secret on a command line or in a log.

Otherwise :class:`~ringflow.errors.ConfigError` says what to set up. A store this process serves
lives until the process exits; a later ``init()`` (after ``shutdown()``) reuses one at a fixed
port, and the keys of each ``init()`` have their own prefix.

``ringflow.init(comm=...)`` (an mpi4py communicator) skips the environment: :func:`comm_info`
derives the RankInfo from the communicator, and ``connect_store(..., comm=comm)`` runs the MPI
exchange over that communicator instead of ``COMM_WORLD``.

A store that rank 0 serves over MPI is served by a thread of rank 0's process, and mpi4py's
pickle-based collectives (``comm.allreduce(obj)``, ``comm.bcast(obj)``...) hold the GIL while
they block: a rank 0 that left ``init()`` and entered one could not answer a slower rank's last
store request, and both would wait for each other (seen in CI). :func:`settle` ends ``init()``
with a barrier on that communicator (``MPI_Ibarrier``, polled, so that the GIL is free and a
rank that failed in ``init()`` cannot hang the others), so no rank leaves before every rank has
its answers.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import urllib.parse
import weakref
from collections.abc import Mapping
from typing import Any

from . import rendezvous
from .errors import ConfigError, RingflowError, RingflowTimeoutError
from .polling import polls
from .topology import RankInfo

__all__ = ["comm_info", "connect_store", "settle"]

# The communicator of each store served over MPI (see the module doc and settle()).
_over_comm: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

# Stores this process serves, by (address, port); a fixed-port one is reused by a later init().
_servers: dict[tuple[str, int], Any] = {}


def _close_servers() -> None:
    while _servers:
        with contextlib.suppress(RingflowError, OSError):
            _servers.popitem()[1].close()


atexit.register(_close_servers)
# A forked child (a DataLoader worker) must not close the parent's server at its exit: closing
# shuts down the connections that parent and child share.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_servers.clear)


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
                  comm: Any = None, init_method: str | None = None) -> Any:
    """The job's rendezvous store for a process of a multi-process job (see the module doc).

    With ``comm`` (an mpi4py communicator, from ``init(comm=...)``) rank 0 of ``comm`` starts
    the store and broadcasts it over ``comm``, whatever the environment says. ``init_method``
    (``env://``, ``tcp://host:port``, ``file:///path``) names the store explicitly.

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
    if init_method:
        return _from_url(init_method, info, env, timeout)
    if env.get("RINGFLOW_RENDEZVOUS_ADDR") or env.get("RINGFLOW_RENDEZVOUS_PORT"):
        port = _port("RINGFLOW_RENDEZVOUS_PORT", env.get("RINGFLOW_RENDEZVOUS_PORT", ""))
        addr = env.get("RINGFLOW_RENDEZVOUS_ADDR") or env.get("MASTER_ADDR", "")
        return _served_by_rank0(info, addr, port, env, timeout, open_ok=False)
    if info.detector == "torch":
        from .rendezvous import torch_store

        return torch_store.default_store(_torch_prefix(env), timeout)
    if info.detector in ("torchrun", "env"):
        return _from_url("env://", info, env, timeout)
    if info.detector == "slurm":
        host, port = _slurm_address(env)
        return _served_by_rank0(info, host, port, env, timeout, open_ok=True)
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
        "(under mpirun), or set MASTER_ADDR and MASTER_PORT (torch's env:// contract), or "
        "RINGFLOW_RENDEZVOUS_ADDR, RINGFLOW_RENDEZVOUS_PORT and RINGFLOW_SECRET_FILE "
        "(see ringflow.bootstrap)"
    )


def _port(var: str, text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"{var}={text!r} is not a port number (1 to 65535)")
    return port


def _torch_prefix(env: Mapping[str, str]) -> str:
    """Keys of this job in a torch store that may outlive it: torchrun's agent store keeps its
    keys across restarts of the workers, so they carry the restart count. Only there: with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every rendezvous round has a store of its own, and
    the agents of a job of several nodes count restarts differently (an agent whose workers
    were restarted for another node's failure keeps its count), so the count would split one
    round's workers into groups that never meet."""
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if not run:
        return "ringflow/"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return f"ringflow/{run}/"
    return f"ringflow/{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def torchrun_store(suffix: str, timeout: float) -> Any:
    """A client of torchrun's agent store, keys under ``ringflow/<run id>/<suffix>/``: unlike a
    job's own keys (:func:`_torch_prefix`: one set per restart) they outlive torchrun's restarts
    of the workers (:mod:`ringflow.elastic` keeps the last commit there)."""
    from .rendezvous import torch_store

    env = os.environ
    return torch_store.open_url(env["MASTER_ADDR"].strip(),
                                _port("MASTER_PORT", env["MASTER_PORT"].strip()), 0, 0, True,
                                f"ringflow/{env.get('TORCHELASTIC_RUN_ID', '')}/{suffix}/",
                                timeout)


def _torch_importable() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available())


def _from_url(url: str, info: RankInfo, env: Mapping[str, str], timeout: float) -> Any:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = urllib.parse.unquote(parsed.path)
        if not path:
            raise ConfigError(f"init_method={url!r} names no directory; use file:///shared/path")
        return rendezvous.FileStore(path, timeout)
    if parsed.scheme == "env":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v, "").strip()]
        if missing:
            raise ConfigError(
                f"{info.detector} job (rank {info.rank} of {info.size}): {' and '.join(missing)} "
                "not set; torch's env:// contract needs MASTER_ADDR (the host of rank 0) and "
                "MASTER_PORT (a free port there) on every process"
            )
        host, port = env["MASTER_ADDR"].strip(), _port("MASTER_PORT", env["MASTER_PORT"].strip())
    elif parsed.scheme == "tcp":
        try:
            host, port = parsed.hostname or "", parsed.port or 0
        except ValueError:
            host, port = "", 0
        if not host or not port:
            raise ConfigError(f"init_method={url!r}: expected tcp://HOST:PORT (rank 0's host)")
    else:
        raise ConfigError(f"init_method={url!r}: expected env://, tcp://HOST:PORT or "
                          "file:///PATH")
    # torchrun's agent already serves MASTER_PORT: its store is the only one there.
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and parsed.scheme == "env"
    if agent or (not env.get("RINGFLOW_SECRET_FILE") and _torch_importable()):
        from .rendezvous import torch_store

        return torch_store.open_url(host, port, info.rank, info.size, agent, _torch_prefix(env),
                                    timeout)
    return _served_by_rank0(info, host, port, env, timeout, open_ok=True)


def _open_key(host: str, port: int) -> bytes:
    """The HMAC key of an open rendezvous: anyone who knows the address knows it (see the
    module doc); it keeps only strangers speaking another protocol out."""
    return hashlib.sha256(f"ringflow open rendezvous {host}:{port}".encode()).digest()


def _served_by_rank0(info: RankInfo, addr: str, port: int, env: Mapping[str, str],
                     timeout: float, open_ok: bool) -> Any:
    if not addr:
        raise ConfigError(
            f"RINGFLOW_RENDEZVOUS_PORT is set for a {info.detector} job but "
            "RINGFLOW_RENDEZVOUS_ADDR (or MASTER_ADDR) is not; set it to the host rank 0 runs on"
        )
    if env.get("RINGFLOW_SECRET_FILE") or env.get("RINGFLOW_SECRET_FD") or not open_ok:
        try:
            secret = rendezvous.read_secret(env)
        except ConfigError as exc:
            raise ConfigError(
                f"the rendezvous at {addr}:{port} of this {info.detector} job needs the job "
                f"secret ({exc}); write a secret (hex) to a file readable only by you and set "
                "RINGFLOW_SECRET_FILE to it on every rank"
            ) from exc
    else:
        secret = _open_key(addr, port)
    if info.rank == 0 and (addr, port) not in _servers:
        try:
            _servers[addr, port] = rendezvous.StoreServer(secret, host=addr, port=port,
                                                         timeout=timeout)
        except ConfigError as exc:
            raise ConfigError(
                f"rank 0 cannot start the rendezvous store at {addr}:{port}: {exc}; rank 0 must "
                "run on that host and the port must be free"
            ) from exc
    return rendezvous.TCPStore(addr, port, secret, timeout)


def _slurm_address(env: Mapping[str, str]) -> tuple[str, int]:
    """Where task 0 of this srun step serves the store: every task derives the same."""
    host = env.get("MASTER_ADDR", "").strip()
    if not host:
        var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        nodelist = env.get(var, "").strip()
        if not nodelist:
            raise ConfigError("srun step without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set "
                              "MASTER_ADDR to the host of task 0")
        host = _expand_hostlist(var, nodelist)[0]
    if env.get("MASTER_PORT", "").strip():
        return host, _port("MASTER_PORT", env["MASTER_PORT"].strip())
    try:
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0"))
    except ValueError as exc:
        raise ConfigError(f"SLURM_JOB_ID / SLURM_STEP_ID are not integers ({exc}); set "
                          "MASTER_PORT to a free port on the host of task 0") from exc
    return host, 20000 + (31 * job + step) % 10000


def _expand_hostlist(var: str, nodelist: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu1``) expanded by ``scontrol`` where it
    is installed, else by python-hostlist. A list without brackets (``vm``, ``a,b``) is only
    names separated by commas: no helper needed."""
    if "[" not in nodelist:
        hosts = [h.strip() for h in nodelist.split(",") if h.strip()]
        if not hosts:
            raise ConfigError(f"{var}={nodelist!r} names no host")
        return hosts
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=False)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    try:
        import hostlist
    except ImportError as exc:
        raise ConfigError(
            f"{var}={nodelist!r}: expanding a Slurm host list needs scontrol or python-hostlist "
            "(pip install 'ringflow[slurm]'), or set MASTER_ADDR to the host of task 0"
        ) from exc
    try:
        hosts = list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"{var}={nodelist!r} is not a Slurm host list: {exc}") from exc
    if not hosts:
        raise ConfigError(f"{var}={nodelist!r} names no host")
    return hosts


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
    store = rendezvous.TCPStore(host, int(port), bytes.fromhex(secret_hex), timeout)
    _over_comm[store] = comm
    return store


def settle(store: Any, timeout: float) -> None:
    """Return once every rank is done with ``store``'s requests of ``init()``, where rank 0
    serves it over MPI (see the module doc); at once otherwise.

    Raises:
        RingflowTimeoutError: a rank did not arrive within ``timeout`` s (it failed in init()).
    """
    comm = _over_comm.get(store)
    if comm is None:
        return
    request = comm.Ibarrier()  # polled, not MPI_Barrier: a rank that failed must not hang us
    for _ in polls(timeout, pause=1e-4, cap=0.01):
        if request.Test():
            return
    raise RingflowTimeoutError(
        f"init(): not every rank of the MPI communicator finished joining within {timeout:g} s "
        "(a rank failed; its own error says why; RINGFLOW_TIMEOUT_S sets the limit)")
