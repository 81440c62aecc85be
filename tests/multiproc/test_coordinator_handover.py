"""Process sets do not depend on rank 0's lifetime (issue 16): when the coordinator shuts down
cleanly while other ranks go on, the lowest rank still there coordinates; collectives of a set
without the departed ranks keep giving exact results, and those needing them fail naming them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(180)

ROOT = Path(ringflow.__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "handover" / "leave_early.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize(("np_", "leavers"), [(2, 1), (3, 1), (4, 2)])
def test_a_process_set_without_rank_0_outlives_it(np_: int, leavers: int) -> None:
    (proc,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable, str(SCRIPT),
          str(leavers)]], cwd=ROOT, env=ENV, timeout=150)
    out = proc.output
    assert out.count("PASS rank") == np_, out[-4000:]
    assert out.count("50 set allreduces after") == np_ - leavers, out[-4000:]
