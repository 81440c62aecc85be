"""Shared setup for the TensorFlow worker scripts (run under ringflow-run by tests/multiproc).

Keeps TensorFlow to one thread per pool (the CI machine has two cores shared by all ranks) and
collects named checks, so one launch covers many behaviours and a failure names every broken one.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # reproducible float32 sums

import numpy as np
import tensorflow as tf

# A hang prints every thread's stack (and exits) before the test's own deadline kills us silently.
DEADLINE_S = float(os.environ.get("TF_WORKER_DEADLINE_S", "150"))  # for each script
faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
# One thread per pool, unless an earlier script of this process set them (one_process.py): once
# TensorFlow ran, setting them raises, so a different count would fail here, loudly.
for _get, _set in ((tf.config.threading.get_inter_op_parallelism_threads,
                    tf.config.threading.set_inter_op_parallelism_threads),
                   (tf.config.threading.get_intra_op_parallelism_threads,
                    tf.config.threading.set_intra_op_parallelism_threads)):
    if _get() != 1:
        _set(1)
tf.get_logger().setLevel("ERROR")

FAILURES: list[str] = []
PASSED: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    (PASSED if ok else FAILURES).append(name if ok else f"{name}: {detail}")


def close(what: str, got: object, want: object, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    got_a, want_a = np.asarray(got, np.float64), np.asarray(want, np.float64)
    ok = got_a.shape == want_a.shape and np.allclose(got_a, want_a, atol=atol, rtol=rtol)
    check(what, ok, f"got {got_a.tolist()!s:.300}, want {want_a.tolist()!s:.300}")


def run(section: str, fn: object) -> None:
    """Run one section; an exception fails it (with its traceback) but not the others."""
    try:
        fn()  # type: ignore[operator]
    except Exception:
        FAILURES.append(f"{section}: raised\n{traceback.format_exc()}")


def finish(rank: int) -> None:
    """Report the script's checks (``rank r: SCRIPT: N checks passed`` on stdout, or each failure
    on stderr; exit 1), leaving nothing behind for a next script in the same process
    (tests/multiproc/one_process.py)."""
    script = os.path.basename(sys.argv[0]).removesuffix("_worker.py")
    failures, passed = FAILURES[:], len(PASSED)
    FAILURES.clear()
    PASSED.clear()
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)  # a next script's deadline
    if failures:
        sys.stderr.write(f"rank {rank}: {script}: {len(failures)} failed checks\n"
                         + "\n".join(failures) + "\n")
        sys.stderr.flush()
        sys.exit(1)
    sys.stdout.write(f"rank {rank}: {script}: {passed} checks passed\n")
    sys.stdout.flush()
