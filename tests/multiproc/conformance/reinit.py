"""A stall shutdown on every rank, then ``shutdown()`` + ``init()``: a working job again.

Run under ringflow-run or mpirun with RINGFLOW_STALL_SHUTDOWN_S set low. Rank 0 waits for
``stall.a`` and the others for ``stall.b``: the stall limit fails the job on every rank. Every
later call raises the same error naming the cause, until shutdown(); after init() the same ranks
form a fresh job and an allreduce is exact. Prints ``PASS`` per rank.
"""

from __future__ import annotations

import numpy as np

import ringflow as rf
from ringflow.errors import HorovodInternalError, StallError

rf.init()
r, n = rf.rank(), rf.size()
got = rf.allreduce(np.full(5, r + 1.0), name="before", op=rf.Sum)
assert np.array_equal(got, np.full(5, n * (n + 1) / 2)), got
try:
    rf.allreduce(np.ones(3), name="stall.a" if r == 0 else "stall.b")
    raise AssertionError("the stalled allreduce returned")
except StallError as exc:
    first = str(exc)
for attempt in range(2):  # every later call raises the same error, at the call
    try:
        rf.allreduce(np.ones(3), name=f"later.{attempt}")
        raise AssertionError("a call after the fatal error succeeded")
    except HorovodInternalError as exc:
        assert type(exc) is StallError and str(exc) == first, (type(exc), str(exc), first)
rf.shutdown()
rf.init()
assert (rf.rank(), rf.size()) == (r, n)
got = rf.allreduce(np.full(100_003, r + 1.0), name="after", op=rf.Sum)
assert np.array_equal(got, np.full(100_003, n * (n + 1) / 2)), got[:3]
rf.shutdown()
print(f"PASS rank {r}: {first.splitlines()[0][:120]}", flush=True)
