"""Polling with backoff: the pauses between the polls of one wait, and its deadline.

Every wait in ringflow that cannot block (a device event, an MPI request, a file a peer writes,
a server not listening yet, flag words in shared memory) polls::

    for _ in polls(timeout, pause=2e-5, cap=5e-4, spin=5e-5):
        if done():
            return
    raise RingflowTimeoutError("... (RINGFLOW_TIMEOUT_S sets the limit)")

:func:`polls` yields at once (the first poll costs no pause), then after each pause, and ends
once ``timeout`` s have passed since it started; the caller raises its own error after the
loop, having done what it must first (abort a communicator, cancel a request, check its
peers). A loop that also watches other conditions (a failed peer, an abort flag) checks them in
its body, between two polls, as before.

The pauses: ``spin_with()`` between polls while the wait is young (the first ``spin`` s, or the
first ``spins`` pauses), then ``sleep(pause)``, doubling up to ``cap``. The last sleep is cut
short at the deadline, and one last poll follows it. A deadline check reads the clock once
after each poll; a poll that is done at once reads it once, at the start.

``spin_with`` is ``os.sched_yield`` unless the caller says otherwise: it releases the GIL and
the core and returns within ~1 us. :data:`SLEEP_0` (``time.sleep(0)``) is what some waits spin
with: it releases the GIL too, but on Linux it sleeps for the thread's timer slack (50 us by
default; 70 us a call measured on this development machine, against 0.6 us for ``sched_yield``),
so such a "spin" is in practice one short sleep. Those waits keep it until a measurement on
their hardware says otherwise (issue 29).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator

__all__ = ["SLEEP_0", "polls"]

#: ``time.sleep(0)`` as a spin: see the module docstring for what it costs on Linux.
SLEEP_0: Callable[[], object] = functools.partial(time.sleep, 0)


def polls(timeout: float, pause: float, cap: float, *, spin: float = 0.0, spins: int = 0,
          spin_with: Callable[[], object] = os.sched_yield,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], object] = time.sleep) -> Iterator[float]:
    """Yield at once, then after each pause, until ``timeout`` s (``math.inf``: never) have
    passed since the first yield; then end (the caller raises its error).

    Args:
        timeout: seconds from the start to the deadline; the first poll happens even at 0.
        pause: the first sleep after the spin, in seconds; each next one is twice as long ...
        cap: ... up to this.
        spin: for this many seconds from the start, pause with ``spin_with()`` instead.
        spins: or for this many pauses (whichever lasts longer).
        spin_with: the pause of the spin (``os.sched_yield``, or :data:`SLEEP_0`).
        clock, sleep: ``time.monotonic`` and ``time.sleep``, replaced in tests.

    Yields:
        The clock's latest reading: the start, then the end of the previous poll (before its
        pause, so at most one pause old). Loops that check something every few milliseconds
        use it instead of reading the clock again.
    """
    now = clock()
    deadline, spin_until = now + timeout, now + spin
    while True:
        yield now
        now = clock()
        left = deadline - now
        if left <= 0:
            return
        if spins > 0 or now < spin_until:
            spins -= 1
            spin_with()
        else:
            sleep(min(pause, left))
            pause = min(pause * 2, cap)
