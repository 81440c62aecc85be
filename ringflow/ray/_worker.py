"""The body of one :class:`~ringflow.ray.RayExecutor` actor: one rank of the job.

A plain class, made a Ray actor by the executor (``ray.remote(Worker)``), so that this module
imports without Ray. Its methods run in the actor process, one at a time, in call order:

1. :meth:`Worker.describe` -- where the actor runs (Ray node id, host, IP, pid, GPU ids), from
   which the driver assigns the ranks host by host.
2. :meth:`Worker.setup` -- the ringflow environment of DESIGN.md section 5 (``RINGFLOW_RANK`` ...
   ``RINGFLOW_RENDEZVOUS_PORT``) written into ``os.environ``, and the job secret written into a
   pipe whose read end is named by ``RINGFLOW_SECRET_FD``, exactly as ``ringflow-run`` hands it to
   a local worker. The secret arrives as an argument of this call (a Ray task argument, sent from
   the driver's process to this one) and is never stored in an environment value.
3. :meth:`Worker.start_executable`, then any number of :meth:`Worker.invoke` /
   :meth:`Worker.call`; :meth:`Worker.stop_ringflow` before the executor kills the actor.

:meth:`Worker.invoke` never raises: it returns an *outcome* the driver reads, ``("ok", value)`` or
``("error", "Type: message", traceback, consequence, pickled exception or None)``, where
``consequence`` says that the error is a :class:`~ringflow.errors.PeerError` or
:class:`~ringflow.errors.ShutdownError`, which a rank gets because *another* rank failed. After an
exception escapes the user's function, ringflow is shut down in this actor (when it was
initialized), as it would be by the exit of a ``ringflow-run`` worker: the other ranks' pending
collectives then fail at once (ShutdownError) instead of waiting for the deadlock detector.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ElasticWorker", "Worker"]

#: Variables a stale environment (the driver's, inherited through the raylet) may hold and that
#: would mislead ringflow in the actor: another way to find the secret.
_STALE = ("RINGFLOW_SECRET_FILE", "RINGFLOW_SECRET_FD", "RINGFLOW_LAUNCHER_PID")


class Worker:
    """One rank. Created only by :class:`~ringflow.ray.RayExecutor`."""

    def __init__(self) -> None:
        self.executable: Any = None
        self._rank: int | None = None

    def __repr__(self) -> str:
        # Ray prefixes the actor's output lines with this: "(ringflow rank 1 pid=...)".
        return "ringflow worker" if self._rank is None else f"ringflow rank {self._rank}"

    def describe(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def setup(
        self, rank: int, env: Mapping[str, str], secret: bytes, nics: Sequence[str] = ()
    ) -> None:
        """Give this process rank ``rank``'s environment and the job secret."""
        for name in _STALE:
            os.environ.pop(name, None)
        if nics:
            from ..runner.netif import interface_ipv4

            os.environ["RINGFLOW_BIND_ADDR"] = _first_address(nics, interface_ipv4)
        os.environ.update(env)
        read_fd, write_fd = os.pipe()  # not inheritable: no child process sees the secret
        try:
            # 65 bytes fit in any pipe buffer, so this write never blocks.
            os.write(write_fd, (secret.hex() + "\n").encode("ascii"))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.environ["RINGFLOW_SECRET_FD"] = str(read_fd)
        self._rank = rank

    def start_executable(
        self, cls: type | None, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> None:
        if cls is not None:
            self.executable = cls(*(args or ()), **(kwargs or {}))

    def invoke(self, payload: tuple[Any, ...], with_executable: bool) -> tuple[Any, ...]:
        """``fn(executable)`` or ``fn(*args, **kwargs)`` for ``payload = (fn, args, kwargs)``,
        as an outcome (see the module doc)."""
        fn, args, kwargs = payload
        try:
            value = fn(self.executable) if with_executable else fn(*args, **kwargs)
        except BaseException as exc:  # every failure goes back to the driver, with its traceback
            return self._failed(exc)
        return ("ok", value)

    def call(self, payload: tuple[Any, ...]) -> Any:
        """``fn(*args, **kwargs)``; an exception propagates (``run_remote``)."""
        fn, args, kwargs = payload
        try:
            return fn(*args, **kwargs)
        except BaseException:
            _stop_ringflow()
            raise

    def stop_ringflow(self) -> None:
        _stop_ringflow()

    def _failed(self, exc: BaseException) -> tuple[Any, ...]:
        from ..errors import PeerError, ShutdownError

        text = f"{type(exc).__name__}: {exc}"
        trace = traceback.format_exc()
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # an exception that does not pickle still reaches the driver as text
            pickled = None
        _stop_ringflow()
        return ("error", text, trace, isinstance(exc, (PeerError, ShutdownError)), pickled)


class ElasticWorker(Worker):
    """One worker of an :class:`~ringflow.ray.ElasticRayExecutor` job: :meth:`Worker.setup`
    (with the worker id for ``rank``), then one :meth:`run_elastic`. Its rank changes from one
    generation to the next, so Ray's prefix of its output lines names the worker id."""

    def __repr__(self) -> str:
        return "ringflow worker" if self._rank is None else f"ringflow worker {self._rank}"

    def run_elastic(self, fn: Callable[[], Any]) -> tuple[Any, ...]:
        """``fn()``, as an outcome: ``("ok", value)``, ``("removed",)`` when the driver removed
        this worker (``init()`` raised ``SystemExit(0)``, which ends a ``ringflow-run`` worker's
        process), or :meth:`Worker.invoke`'s ``("error", ...)``. ringflow is shut down after
        it, as the exit of a ``ringflow-run`` worker would."""
        try:
            value = fn()
        except SystemExit as exc:
            if exc.code in (0, None):
                _stop_ringflow()
                return ("removed",)
            return self._failed(exc)
        except BaseException as exc:  # every failure goes back to the driver, with its traceback
            return self._failed(exc)
        _stop_ringflow()
        return ("ok", value)


def _stop_ringflow() -> None:
    import ringflow

    if ringflow.is_initialized():
        with contextlib.suppress(Exception):  # the peers may be gone already
            ringflow.shutdown()


def _first_address(nics: Sequence[str], lookup: Callable[[str], str]) -> str:
    errors = []
    for nic in nics:
        try:
            return lookup(nic)
        except Exception as exc:
            errors.append(str(exc))
    from ..errors import ConfigError

    raise ConfigError(
        f"none of the interfaces {list(nics)} has an IPv4 address on {socket.gethostname()} "
        f"({'; '.join(errors)}); pass create_settings(nics=...) the interface that connects the "
        "Ray nodes"
    )
