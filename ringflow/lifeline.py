"""A worker's end of its supervisor's lifeline: the rank leaves when its supervisor is gone.

ringflow-run starts every worker under a supervisor (:mod:`ringflow.runner.supervisor`), which
stops the worker and everything it started when the launcher dies. If the supervisor itself is
SIGKILLed, ``PR_SET_PDEATHSIG`` kills only its direct child: under ``sh -c 'python train.py'``
that is the shell, and the rank lived on, re-parented to init (two orphaned ranks blocked in a
collective keep each other alive: their heartbeats still come). Here the rank watches the
supervisor itself:

1. The supervisor holds the only write end of a pipe and never writes to it; the worker and
   every process it starts inherit the read end, named by ``RINGFLOW_LIFELINE=FD:INODE``.
2. :func:`watch` (run at ``import ringflow``, so a rank that has not called ``init()`` yet is
   covered) starts one daemon thread blocked in ``read()`` on it. End of file means the
   supervisor exited or was killed, however it died.
3. The thread then logs why and sends this process SIGTERM: ringflow-run's workers raise
   SystemExit on it once ``init()`` ran (``finally`` blocks, atexit and the goodbye to the
   peers run, and a wait in a collective ends there); before ``init()``, or with Python's
   default handler, it ends the process at once. A process still there after
   :data:`GRACE_S` (a handler that ignores SIGTERM, a main thread inside a long C call) is
   ended with ``os._exit(143)``.

The inode check: the variable is inherited by processes that do not have the pipe (a
subprocess started with ``close_fds``), where the number may name another file. *Why a pipe:*
a pid can be reused, a pidfd needs Linux 5.3 and a poll; a pipe's end of file comes at once
on every POSIX system, for the cost of one blocked thread.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Mapping

__all__ = ["GRACE_S", "VARIABLE", "watch"]

log = logging.getLogger(__name__)

#: The environment variable that names the pipe: ``FD:INODE``.
VARIABLE = "RINGFLOW_LIFELINE"
#: Seconds between the SIGTERM and ``os._exit``: the supervisor's own grace period.
GRACE_S = 5.0

_watching = False
_lock = threading.Lock()


def _pipe(env: Mapping[str, str]) -> int | None:
    """The file descriptor of the lifeline, if this process holds it."""
    value = env.get(VARIABLE, "")
    fd, _, inode = value.partition(":")
    if not (fd.isdigit() and inode.isdigit()):
        return None
    try:
        st = os.fstat(int(fd))
    except OSError:
        return None
    if not stat.S_ISFIFO(st.st_mode) or st.st_ino != int(inode):
        return None
    return int(fd)


def watch(env: Mapping[str, str] | None = None) -> bool:
    """Leave when the supervisor named in ``env`` (default ``os.environ``) is gone; whether this
    process watches one. Idempotent."""
    global _watching
    fd = _pipe(os.environ if env is None else env)
    if fd is None:
        return False
    with _lock:
        if _watching:
            return True
        _watching = True
    threading.Thread(target=_wait, args=(fd,), name="ringflow-lifeline", daemon=True).start()
    return True


def _wait(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    log.error("the supervisor that ringflow-run started this process under is gone (the "
              "launcher was killed): leaving the job (SIGTERM, then exit after %g s)", GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(128 + signal.SIGTERM)
