"""One rank of the link-fault matrix (test_link_faults.py): allreduces checked in closed form.

    ringflow-run ... python fault_worker.py --out DIR [--elements E] [--iters K]

Iteration ``i`` (0-based) allreduces ``E`` float32 elements of ``(rank + 1) * (i % 7 + 1)``: the
sum is ``n (n+1)/2 * (i % 7 + 1)`` in every element, exact in float32. A wrong element fails the
rank at once. After each iteration the rank writes ``DIR/progress<r>`` (the iterations done), so
that the test can strike while allreduces are in flight. The job goes on until the test creates
``DIR/stop`` (seen by any rank: the ranks agree on it with a MAX allreduce each iteration, so all
stop after the same one), or for ``K`` iterations. At the end, or when a collective
raises, it writes ``DIR/rank<r>.json``: ``{rank, host, ok, iters, error, at}`` (``error`` is
``"Type: text"`` of what the collective raised, ``at`` the ``time.monotonic()`` of that moment:
the namespace hosts share this machine's clock) and then re-raises, so the launcher sees the
rank fail as a user's script would.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import ringflow as rf


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=100_000)
    ap.add_argument("--elements", type=int, default=1 << 18)
    args = ap.parse_args()

    rf.init()
    rank, n = rf.rank(), rf.size()
    result = {"rank": rank, "host": os.environ.get("RINGFLOW_HOSTNAME", ""), "ok": False,
              "iters": 0, "error": "", "at": 0.0}
    done = 0
    try:
        for i in range(args.iters):
            x = np.full(args.elements, (rank + 1) * (i % 7 + 1), np.float32)
            total = rf.allreduce(x, name="x", op=rf.Sum)
            expected = n * (n + 1) // 2 * (i % 7 + 1)
            if not np.all(total == expected):
                bad = np.flatnonzero(total != expected)
                raise AssertionError(f"iteration {i}: {bad.size} wrong elements, first at "
                                     f"{bad[0]}: {total[bad[0]]} != {expected}")
            done = i + 1
            _write(os.path.join(args.out, f"progress{rank}"), str(done))
            stop = np.array([os.path.exists(os.path.join(args.out, "stop"))], np.int32)
            if rf.allreduce(stop, name="stop", op=rf.Max)[0]:
                break
        result["ok"] = True
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        result["iters"], result["at"] = done, time.monotonic()
        _write(os.path.join(args.out, f"rank{rank}.json"), json.dumps(result))
    rf.shutdown()


if __name__ == "__main__":
    main()
