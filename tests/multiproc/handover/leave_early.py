"""Ranks 0 .. L-1 leave early (shutdown(), then exit); the others go on in a process set
without them: the coordinator role passes to the lowest rank still there (messages.Handover).

    ringflow-run -np N python leave_early.py L

Prints ``PASS rank r ...`` on every rank.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ringflow as rf
from ringflow.errors import ShutdownError

rf.init()
r, n = rf.rank(), rf.size()
leavers = int(sys.argv[1]) if len(sys.argv) > 1 else 1   # ranks 0..leavers-1 leave
ps = rf.add_process_set(list(range(leavers, n)))
x = rf.allreduce(np.ones(3), name="all", op=rf.Sum)
assert x[0] == n
if r < leavers:
    time.sleep(0.3 * r)   # leave one after the other
    rf.shutdown()
    print(f"PASS rank {r} left", flush=True)
    sys.exit(0)
time.sleep(0.3 * leavers + 0.5)  # the others keep working long after
for i in range(50):
    got = rf.allreduce(np.full(1000, r + 1.0), name=f"set.{i % 5}", op=rf.Sum, process_set=ps)
    want = sum(q + 1 for q in range(leavers, n))
    assert np.all(got == want), (i, got[:3])
try:
    rf.allreduce(np.ones(2), name="global.after")
    raise SystemExit("a global allreduce after rank 0 left succeeded")
except ShutdownError as exc:
    assert "rank 0 left the job" in str(exc), exc
got = rf.allreduce(np.ones(2), name="set.after", op=rf.Sum, process_set=ps)
assert got[0] == n - leavers
print(f"PASS rank {r}: 50 set allreduces after ranks {list(range(leavers))} left", flush=True)
rf.shutdown()
