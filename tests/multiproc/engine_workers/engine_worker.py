"""Engine scenarios that take processes, one per ``ringflow-run`` job:
``engine_worker.py SCENARIO OUTDIR`` (shutdown, a peer that exits, a peer that freezes).

Every rank writes ``OUTDIR/<rank>.json`` with what it observed (error classes and texts, how long
they took); the test compares the ranks' files. A rank whose check fails exits non-zero with a
message naming the rank and what differed. The rest of the engine is tested with ranks as
threads: ``tests/inproc/test_engine.py``.
"""

from __future__ import annotations

import functools
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


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def failure(fn: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
    """Run ``fn``; return the class and text of the RingflowError it raises (it must raise)."""
    try:
        value = fn(*args, **kwargs)
    except RingflowError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    raise CheckFailed(f"{getattr(fn, '__name__', fn)} returned {value!r} instead of failing")


def wait_failure(handle: rf.Handle, timeout: float = 30.0) -> dict[str, Any]:
    start = time.monotonic()
    out = failure(handle.wait, timeout)
    out["elapsed"] = time.monotonic() - start
    return out


def async_failure(fn: Any, *args: Any, timeout: float = 30.0, **kwargs: Any) -> dict[str, Any]:
    """The failure of an ``*_async`` call: raised at the call when this rank already knows the
    job has failed (every later call raises the job's error), else by its handle."""
    start = time.monotonic()
    try:
        handle = fn(*args, **kwargs)
    except RingflowError as exc:
        return {"type": type(exc).__name__, "text": str(exc), "elapsed": 0.0, "at_call": True}
    out = failure(handle.wait, timeout)
    out["elapsed"] = time.monotonic() - start
    return out


# failures ----------------------------------------------------------------------------------------
def shutdown_pending(r: int, n: int) -> dict[str, Any]:
    rf.allreduce(np.ones(2), name="sd.ok")
    h = rf.allreduce_async(np.ones(2), name=f"sd.only.{r}")  # never ready: no other rank has it
    rf.shutdown()
    return {"pending": wait_failure(h, 10), "later": failure(rf.allreduce, np.ones(2))}


def peer_exit(r: int, n: int, outdir: Path, cached: bool = False) -> dict[str, Any]:
    """The last rank exits; the others then submit a new name, or with ``cached`` the name they
    used before (small and cached: posted on the same-host lane first, ringflow.lane)."""
    for _ in range(3 if cached else 1):
        rf.allreduce(np.ones(2), name="pe.ok")
    if r == n - 1:
        (outdir / f"{r}.json").write_text(json.dumps({"rank": r, "exited": True}))
        os._exit(0)
    after = "pe.ok" if cached else "pe.after"
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name=after)}


def peer_exit_midop(r: int, n: int, outdir: Path) -> dict[str, Any]:
    """The last rank exits while the others are inside large allreduces."""
    import threading

    x = np.ones(2_000_000)
    rf.allreduce(x, name="pm.big")
    if r == n - 1:
        (outdir / f"{r}.json").write_text(json.dumps({"rank": r, "exited": True}))
        threading.Timer(0.2, os._exit, args=(0,)).start()
    start = time.monotonic()
    for _ in range(10_000):
        try:
            rf.allreduce(x, name="pm.big")
        except RingflowError as exc:
            return {"pending": {"type": type(exc).__name__, "text": str(exc),
                                "elapsed": time.monotonic() - start}}
    raise CheckFailed("10,000 allreduces succeeded although a rank exited")


def shutdown_early(r: int, n: int) -> dict[str, Any]:
    """Rank 1 shuts down cleanly; what the others submit afterwards fails, naming it."""
    rf.allreduce(np.ones(2), name="se.ok")
    if r == 1:
        rf.shutdown()
        return {}
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name="se.after")}


def peer_frozen(r: int, n: int, outdir: Path, cached: bool = False) -> dict[str, Any]:
    """The last rank freezes; the others submit a new name, or a cached one (see peer_exit)."""
    for _ in range(3 if cached else 1):
        rf.allreduce(np.ones(2), name="pf.ok")
    if r == n - 1:
        (outdir / "frozen.pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"resumed": True}
    after = "pf.ok" if cached else "pf.after"
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name=after, timeout=60)}


# the same-host lane (ringflow.lane) -------------------------------------------------------------
def lane(r: int, n: int) -> dict[str, Any]:
    """Synchronous 4 KiB allreduces of one cached name, each checked on every rank."""
    want = np.full(1024, n * (n + 1) / 2, np.float32)
    for i in range(300):
        got = rf.allreduce(np.full(1024, r + 1.0, np.float32), name="lane.x", op=rf.Sum)
        check(np.array_equal(got, want), f"op {i}: {got[:3]}")
    return {"stats": rf.stats()}


SCENARIOS = {"shutdown_pending": shutdown_pending, "shutdown_early": shutdown_early,
             "lane": lane}
NEEDS_DIR = {"peer_exit": peer_exit, "peer_exit_midop": peer_exit_midop,
             "peer_frozen": peer_frozen,
             "lane_peer_exit": functools.partial(peer_exit, cached=True),
             "lane_peer_frozen": functools.partial(peer_frozen, cached=True)}


def run_scenario(scenarios: dict[str, Any], needs_dir: dict[str, Any]) -> tuple[str, int, Path]:
    """Run ``argv[1]``'s scenario after init() and write this rank's result to ``argv[2]``;
    a failed check exits 3 with its text. Returns (scenario, rank, outdir)."""
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    rf.init()
    r, n = rf.rank(), rf.size()
    try:
        if scenario in needs_dir:
            result = needs_dir[scenario](r, n, outdir)
        else:
            result = scenarios[scenario](r, n)
    except CheckFailed as exc:
        sys.stderr.write(f"rank {r}: {scenario}: {exc}\n")
        sys.stderr.flush()
        os._exit(3)
    result["rank"] = r
    (outdir / f"{r}.json.tmp").write_text(json.dumps(result))
    os.replace(outdir / f"{r}.json.tmp", outdir / f"{r}.json")
    return scenario, r, outdir


def main() -> None:
    scenario, r, outdir = run_scenario(SCENARIOS, NEEDS_DIR)
    if scenario in ("peer_frozen", "lane_peer_frozen") and r == 0:
        # The frozen rank would never exit; end it now that the survivors have reported.
        os.kill(int((outdir / "frozen.pid").read_text()), signal.SIGKILL)
    rf.shutdown()


if __name__ == "__main__":
    main()
