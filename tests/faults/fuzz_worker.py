"""One rank of the malformed-frame fuzz test: ``fuzz_worker.py OUTDIR ROUNDS ITERATIONS``.

The test paces the job with files in OUTDIR, so that it can fuzz every listening port of the job
in each window where that port exists:

1. the rank writes ``pid.<rank>`` and waits for ``go.<round>.<rank>`` before each ``init()``
   (meanwhile only the launcher's store listens; the test holds one rank back, so that the
   others' data listeners stay open, waiting for it, while the test fuzzes them);
2. after ``init()`` it runs ``ITERATIONS`` steps of exact collectives (allreduces of 1 B to
   1 MiB, a ragged allgather, a broadcast from a rotating root), each checked in closed form,
   then ``shutdown()``;
3. after the last round it writes ``<rank>.json`` (how long each ``init()`` and loop took,
   mismatches, RSS after the first step and at the end) and waits for ``exit`` before it
   exits, so that the store is still there to fuzz while the test tops up its count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringflow as rf

LENGTHS = (1, 1023, 65537, 262145)  # float32: eager (coordinator) and data-plane sizes
WAIT_S = 240.0


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.005)


def step(i: int, r: int, n: int) -> list[str]:
    """One step of exact collectives; what was wrong (nothing, normally)."""
    bad = []
    for length in LENGTHS:
        got = rf.allreduce((r + 1 + np.arange(length) % 3).astype(np.float32),
                           name=f"ar{length}", op=rf.Sum)
        want = (n * (n + 1) // 2 + n * (np.arange(length) % 3)).astype(np.float32)
        if got.tobytes() != want.tobytes():
            bad.append(f"step {i}: allreduce of {length}")
    got = rf.allgather(np.full(r + 1, r, np.int64), name="ag")
    if got.tolist() != [q for q in range(n) for _ in range(q + 1)]:
        bad.append(f"step {i}: allgather {got.tolist()}")
    root = i % n
    got = rf.broadcast(np.arange(1000, dtype=np.int32) * (r + 1), root, name="bc")
    if got.tobytes() != (np.arange(1000, dtype=np.int32) * (root + 1)).tobytes():
        bad.append(f"step {i}: broadcast from {root}")
    return bad


def main() -> None:
    outdir, rounds, iterations = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    r = int(os.environ["RINGFLOW_RANK"])
    # Whole or absent: the test reads it as soon as it exists.
    (outdir / f"pid.{r}.tmp").write_text(str(os.getpid()))
    (outdir / f"pid.{r}.tmp").replace(outdir / f"pid.{r}")
    out: dict[str, Any] = {"rank": r, "pid": os.getpid(), "init_s": [], "loop_s": [],
                           "mismatches": [], "steps": 0}
    for k in range(1, rounds + 1):
        wait_for(outdir / f"go.{k}.{r}")
        start = time.monotonic()
        rf.init()
        out["init_s"].append(time.monotonic() - start)
        n = rf.size()
        start = time.monotonic()
        for i in range(iterations):
            out["mismatches"] += step(i, r, n)
            out["steps"] += 1
            if k == 1 and i == 0:
                out["rss_warm_kb"] = rss_kb()
        out["loop_s"].append(time.monotonic() - start)
        if k == rounds:
            out["rss_end_kb"] = rss_kb()  # as at the warm-up: the engine up, after a step
        rf.shutdown()
    path = outdir / f"{r}.json"
    path.with_suffix(".tmp").write_text(json.dumps(out))
    path.with_suffix(".tmp").replace(path)
    wait_for(outdir / "exit")
    sys.exit(1 if out["mismatches"] else 0)


if __name__ == "__main__":
    main()
