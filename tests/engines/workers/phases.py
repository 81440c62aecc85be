"""Runs the phases of an engine test's driver one after the other in one engine session (a Ray
cluster, a Spark session take tens of seconds to start here), each framed for
``engine_harness.phase``: ``== PHASE name``, its output, ``== END name ok`` (or ``failed`` after
its traceback). The exit code is 1 when any phase failed.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence


def run_phases(phases: Mapping[str, Callable[[], None]], names: Sequence[str]) -> int:
    failed = False
    for name in names:
        print(f"== PHASE {name}", flush=True)
        start = time.monotonic()
        try:
            phases[name]()
        except Exception:
            traceback.print_exc(file=sys.stdout)
            print(f"phase {name} took {time.monotonic() - start:.1f} s", flush=True)
            print(f"== END {name} failed", flush=True)
            failed = True
        else:
            print(f"phase {name} took {time.monotonic() - start:.1f} s", flush=True)
            print(f"== END {name} ok", flush=True)
    return int(failed)
