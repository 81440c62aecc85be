"""Handle: the future an async collective returns.

``poll()`` (or ``is_completed()``, torch.distributed's name) says whether it finished;
``wait(timeout)`` blocks and re-raises the operation's error (the same class and text on every
rank); ``result()`` is ``wait()`` returning the output.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import RingflowTimeoutError

__all__ = ["Handle"]

log = logging.getLogger(__name__)


class Handle:
    __slots__ = ("_callbacks", "_drive", "_error", "_event", "_finished", "_lock", "_spin",
                 "_value", "name")

    def __init__(self, name: str, spin: float = 0.0) -> None:
        self.name = name
        # Seconds wait() polls before it sleeps. The engine sets it for an operation submitted
        # while it was idle: then the answer usually comes within ~100 us, and a sleeping thread
        # takes ~35 us to wake on this machine (polling: 4 KiB allreduce p50 0.13-0.19 ms
        # instead of 0.25, 2 ranks, benchmarks/engine_latency.py). Polling calls sched_yield,
        # which releases the GIL and the core to anything else that needs them.
        self._spin = spin
        # Set by the engine for an operation posted on the same-host lane (ringflow.lane): the
        # waiter moves it on itself; True while it is still posted.
        self._drive: Callable[[], bool] | None = None
        self._finished = False
        # Made by a waiter that has to block (most operations finish before anyone waits, or
        # while the waiter polls: an Event costs ~3 us to make).
        self._event: threading.Event | None = None
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []

    def poll(self) -> bool:
        """True once the operation finished (successfully or not)."""
        if self._drive is not None and not self._finished:
            self._drive()
        return self._finished

    def is_completed(self) -> bool:
        """True once the operation finished (torch.distributed's ``Work.is_completed``)."""
        return self.poll()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done and return the result; raise the operation's error if it failed."""
        if self._drive is not None:
            end = time.perf_counter() + (timeout if timeout is not None else float("inf"))
            while not self._finished and self._drive() and time.perf_counter() < end:
                os.sched_yield()
        if self._spin and not self._finished:
            end = time.perf_counter() + min(self._spin, timeout if timeout is not None else 1.0)
            while not self._finished and time.perf_counter() < end:
                os.sched_yield()
        if not self._finished:
            with self._lock:
                if not self._finished and self._event is None:
                    self._event = threading.Event()
                event = None if self._finished else self._event
            if event is not None and not event.wait(timeout):
                raise RingflowTimeoutError(
                    f"operation {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    result = wait

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` when done (at once if already done), on the thread that completed
        the operation: one of ringflow's (engine or transport reader), never under its lock. An
        exception from ``fn`` is logged and otherwise ignored."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._value, self._error = value, error
            self._finished = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, []
        if event is not None:
            event.set()
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Handle], None]) -> None:
        """A callback's exception is the caller's bug, not the operation's: it is logged (as
        ``concurrent.futures`` does) and neither the operation nor the job fails."""
        try:
            fn(self)
        except Exception:
            log.exception("ringflow: the done-callback %r of %r raised", fn, self)

    def __repr__(self) -> str:
        state = "pending" if not self.poll() else ("failed" if self._error else "done")
        return f"<Handle {self.name!r} {state}>"
