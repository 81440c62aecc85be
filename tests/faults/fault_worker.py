"""Scenarios of the fault tests, one per ``ringflow-run`` job:
``fault_worker.py SCENARIO OUTDIR [ARGS...]``.

Every rank that finishes writes ``OUTDIR/<rank>.json``: what it saw (results checked in closed
form, or the class and text of the error it got and how long after the fault it came). A rank
killed by an injected fault (``RINGFLOW_FAULT``, :mod:`ringflow.injection`) writes nothing; the test
compares the survivors' files.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringflow as rf
from ringflow.errors import RingflowError


def error_of(exc: BaseException, start: float) -> dict[str, Any]:
    return {"type": type(exc).__name__, "text": str(exc), "elapsed": time.monotonic() - start,
            "at": time.time()}


def expected(n: int, length: int, dtype: Any = np.float32) -> np.ndarray:
    """Rank r contributes r + 1 + (i mod 3): the sum is n(n+1)/2 + n (i mod 3)."""
    return (n * (n + 1) // 2 + n * (np.arange(length) % 3)).astype(dtype)


def contribution(r: int, length: int, dtype: Any = np.float32) -> np.ndarray:
    return (r + 1 + np.arange(length) % 3).astype(dtype)


def allreduce(r: int, n: int, nbytes: str) -> dict[str, Any]:
    """One allreduce of ``nbytes`` bytes of float32 (at least one element): exact, or an error."""
    length = max(int(nbytes) // 4, 1)
    start = time.monotonic()
    try:
        got = rf.allreduce(contribution(r, length), name="big", op=rf.Sum)
    except RingflowError as exc:
        return {"error": error_of(exc, start)}
    return {"exact": bool(np.array_equal(got, expected(n, length)))}


def inflight(r: int, n: int, nbytes: str, count: str = "100") -> dict[str, Any]:
    """A warm-up allreduce, then ``count`` allreduces of ``nbytes`` in flight at once (a fused
    batch when they are small); the fault strikes among them. Every handle must resolve: with
    the exact result or with the job's error."""
    length = max(int(nbytes) // 4, 1)
    rf.allreduce(np.ones(4, np.float32), name="warm")
    rf.barrier()
    start = time.monotonic()
    out: dict[str, Any] = {"resolved": 0, "exact": 0, "errors": [], "at_call": 0}
    handles = []
    for i in range(int(count)):
        try:
            handles.append(rf.allreduce_async(contribution(r, length), name=f"t{i}", op=rf.Sum))
        except RingflowError as exc:  # the job failed already: every later call raises
            out["at_call"] += 1
            out["resolved"] += 1
            if not out["errors"]:
                out["errors"].append(error_of(exc, start))
    want = expected(n, length)
    for h in handles:
        try:
            got = h.wait(60)
            out["exact"] += bool(np.array_equal(got, want))
        except RingflowError as exc:
            err = error_of(exc, start)
            if not out["errors"] or out["errors"][-1]["text"] != err["text"]:
                out["errors"].append(err)
        out["resolved"] += 1
    try:
        rf.allreduce(np.ones(1, np.float32), name="after")
        out["after"] = None
    except RingflowError as exc:
        out["after"] = error_of(exc, start)
    return out


def pauses(r: int, n: int, count: str, pause: str) -> dict[str, Any]:
    """``count`` steps, each a compute pause of ``pause`` seconds on one rank (the others wait
    in the allreduce): no rank may be taken for frozen."""
    done = 0
    start = time.monotonic()
    try:
        for i in range(int(count)):
            if r == i % n:
                time.sleep(float(pause))  # computing: the engine's threads keep answering
            got = rf.allreduce(contribution(r, 8), name="step", op=rf.Sum)
            assert np.array_equal(got, expected(n, 8))
            done += 1
    except RingflowError as exc:
        return {"done": done, "error": error_of(exc, start)}
    return {"done": done}


def growing(r: int, n: int, steps: str = "4") -> dict[str, Any]:
    """Allreduces of 1, 2, 4, ... MiB: the shared-memory segments grow at each."""
    start = time.monotonic()
    try:
        for i in range(int(steps)):
            length = (1 << 18) << i
            got = rf.allreduce(contribution(r, length), name=f"grow{i}", op=rf.Sum)
            assert np.array_equal(got, expected(n, length))
    except RingflowError as exc:
        return {"error": error_of(exc, start)}
    return {"exact": True}


SCENARIOS = {"allreduce": allreduce, "growing": growing, "inflight": inflight, "pauses": pauses}


def main() -> None:
    scenario, outdir, *args = sys.argv[1:]
    # A hung test: kill -USR1 writes every thread's stack to OUTDIR/stacks-<pid>.
    stacks = open(Path(outdir) / f"stacks-{os.getpid()}", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks)
    rf.init()
    r, n = rf.rank(), rf.size()
    result = {"rank": r, "pid": os.getpid(), **SCENARIOS[scenario](r, n, *args)}
    path = Path(outdir) / f"{r}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)
    rf.shutdown()
    # A fault that strikes only the last operation ("after") fails the rank too: exiting 0
    # would leave the launcher waiting for a frozen rank forever (the test's 90 s hang).
    failed = result.get("error") or result.get("errors") or result.get("after")
    sys.exit(3 if failed else 0)  # the launcher then ends the job (a frozen rank too)


if __name__ == "__main__":
    main()
