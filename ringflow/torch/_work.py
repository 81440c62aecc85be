"""The ``torch.distributed.Work`` of the ringflow backend (:mod:`.process_group`).

One :class:`Work` per operation, over one or more ringflow handles. When every handle is done
(on the ringflow thread that completed the last: the engine's or a transport reader), ``finish``
runs there -- it copies results into the caller's output tensors -- and then the work is
complete: ``is_completed()`` turns True and the future gets its value, or the error, in that
order, so a ``then`` callback and a thread returning from ``wait()`` both see the outputs
written. ``wait()`` re-raises the operation's error (a ringflow error: the same class and text
on every rank) at every call.

torch's contracts kept here: ``wait(timeout)`` returns True (a ``timedelta`` of 0, torch's
``kNoTimeout``, means the group's timeout); ``get_future()`` is a ``torch.futures.Future`` whose
value is the list of output tensors (what DistributedDataParallel's reducer reads); ``result()``
is that list; ``exception()`` the error or None. A Work may be waited from C++ (DDP's reducer
waits on futures, ``PyProcessGroup`` trampolines call ``wait`` / ``get_future``), so nothing here
depends on being called from Python.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RingflowTimeoutError

__all__ = ["Work", "as_seconds"]


def as_seconds(timeout: Any, default: float) -> float:
    """Seconds of a torch timeout (a ``timedelta``, or seconds); 0 or None: ``default``."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif timeout is None:
        seconds = 0.0
    else:
        seconds = float(timeout)
    return seconds if seconds > 0 else default


class Work(dist.Work):
    """A pending operation of the ringflow backend (torch.distributed's ``Work``).

    ``handles`` are ringflow handles (anything with ``add_done_callback``); ``finish(values)``
    gets their results in order and returns the output tensors (it may raise: the work then
    fails with that error). ``timeout_s`` is what ``wait()`` allows by default.
    """

    def __init__(self, name: str, handles: Sequence[Any],
                 finish: Callable[[list[Any]], list[torch.Tensor]], timeout_s: float,
                 error: BaseException | None = None) -> None:
        super().__init__()
        self._name = name
        self._timeout_s = timeout_s
        self._finish_fn = finish
        self._event = threading.Event()
        self._error = error
        self._outputs: list[torch.Tensor] = []
        self._future: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Work], None]] = []
        self._left = len(handles)
        self._handles = [] if error is not None else list(handles)
        if not self._handles:
            self._complete()
        for h in self._handles:
            h.add_done_callback(self._one_done)

    def _one_done(self, _: Any) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is None:
            try:
                values = [h.wait() for h in self._handles]  # all done: returns or raises now
                self._outputs = self._finish_fn(values)
            except Exception as exc:  # the operation's error, delivered at wait()
                self._error = exc
        self._handles = []
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        if self._error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(self._error)
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call ``fn(work)`` once complete (at once if it is): a Work can stand where a ringflow
        handle does, so that one Work can cover several (coalescing)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # torch.distributed.Work ----------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def wait(self, timeout: Any = None) -> bool:
        """Block until done; raise the operation's error.

        Raises:
            RingflowTimeoutError: not done within ``timeout`` (default: the group's timeout);
                the operation itself goes on.
            HorovodInternalError (and the other ringflow errors): the operation failed, with
                the same class and text on every rank.
        """
        seconds = as_seconds(timeout, self._timeout_s)
        if not self._event.wait(seconds):
            raise RingflowTimeoutError(
                f"torch.distributed operation {self._name!r} (ringflow backend) did not finish "
                f"within {seconds:g} s; a rank may not have called it, or called collectives in "
                "another order (raise the timeout= of init_process_group / new_group, or "
                "RINGFLOW_DEADLOCK_SHUTDOWN_S reports the ranks' pending operations)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """CPU tensors: nothing to order on a stream."""

    def __repr__(self) -> str:
        state = ("pending" if not self._event.is_set()
                 else "failed" if self._error is not None else "done")
        return f"<ringflow Work {self._name!r} {state}>"
