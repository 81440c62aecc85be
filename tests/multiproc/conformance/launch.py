"""How the conformance and rooted-collective tests launch their workers.

:func:`frameworks_at` is the one job of each world size that test_rooted_collectives.py,
test_conformance_torch.py and test_conformance_tf.py read (one pytest-xdist group:
tests/conftest.py): in each rank, ``rooted/worker.py`` with every installed framework, then at 2
and 3 ranks ``worker.py`` with every mode they allow, one after the other in the same process
(one_process.py). A process that imports torch and TensorFlow costs seconds of CPU to start: 10
such processes where a job per file and framework started 20.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

from one_process import command

from ringflow.testing import run_commands

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "worker.py"
ROOTED = WORKER.parents[1] / "rooted" / "worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) for name in names)


#: rooted/worker.py's frameworks and worker.py's modes, those the installed frameworks allow.
FRAMEWORKS = [f for f in ("numpy", "torch", "tensorflow") if installed(f)]
MODES = [mode for mode, needs in (("torch", ["torch"]), ("tf-eager", ["tensorflow"]),
                                  ("tf-function", ["tensorflow"]),
                                  ("cross", ["torch", "tensorflow"])) if installed(*needs)]


def rooted_frameworks(np_: int) -> list[str]:
    """rooted/worker.py's frameworks at ``np_`` ranks: every installed one, but TensorFlow only up
    to 3 ranks (its adapter hands the engine the same requests at any size; four more
    TensorFlow processes cost about 25 CPU-s), while numpy's and torch's go to 4."""
    return [f for f in FRAMEWORKS if np_ <= 3 or f != "tensorflow"]


@functools.cache
def frameworks_at(np_: int) -> str:
    """The output of the job of ``np_`` ranks (run once), whatever its exit code: each
    framework's and mode's ``PASS`` lines say how it went."""
    scripts = [[str(ROOTED), ",".join(rooted_frameworks(np_))]]
    if np_ in (2, 3) and MODES:
        scripts.append([str(WORKER), ",".join(MODES)])
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), *command(*scripts)]],
        cwd=ROOT, env=ENV, timeout=400, check=False)
    return result.output


def run_script(script: str, np_: int, timeout: float = 120,
               env: dict[str, str] | None = None) -> str:
    """Output of ``script`` (in this folder) on ``np_`` ranks under ringflow-run; it must exit 0."""
    (result,) = run_commands(
        [[sys.executable, "-m", "ringflow.runner", "-np", str(np_), sys.executable,
          str(WORKER.parent / script)]], cwd=ROOT, env={**ENV, **(env or {})}, timeout=timeout)
    return result.output
