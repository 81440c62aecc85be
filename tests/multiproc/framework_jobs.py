"""One job per world size for the worker scripts of torch and TensorFlow that several test files
check: test_torch_backend (under ringflow-run), test_torch, test_torch_devices, test_overlap
(shared memory), test_rooted_collectives, test_conformance_torch, test_conformance_tf and
test_tf_adapter.

A process that imports torch costs 2-4 CPU-s before its first check, TensorFlow 5-6 (RESULTS.md
section 32), so each world size's scripts run one after the other in the processes of one job
(one_process.py): ``ringflow-run -np N`` at 2 to 4 ranks, ``python`` alone at 1 (a job of one
started by nobody, as users run one): 10 processes, where the files' own jobs started 49.
:data:`SCRIPTS` says which scripts run at which sizes, in order: torch's first (TensorFlow is
not imported yet), then the rooted collectives of every framework and the conformance modes,
then TensorFlow's. Each script prints a verdict line on every rank; a test reads its script's
(:func:`passed`). A script that fails its checks exits non-zero and the next one runs; one that
raises ends its process, and the scripts after it in that job fail their tests too, with the
first failure in their output (one_process.py names the script).

The files share one pytest-xdist group (tests/conftest.py), so each job runs once.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from one_process import command, failure_named

from ringflow.testing import CommandResult, run_commands

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RINGFLOW_TIMEOUT_S": "60",
       "TF_CPP_MIN_LOG_LEVEL": "3",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
ENV.pop("RINGFLOW_BUCKET_BYTES", None)  # overlap.py compares its own bucket sizes
#: How long one job may take: its slowest, 3 ranks on 2 cores, takes about two minutes.
TIMEOUT_S = 600
#: The pytest timeout of a test that reads a job (the first to read it waits for all of it).
TEST_TIMEOUT_S = TIMEOUT_S + 60


def installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) for name in names)


#: rooted/worker.py's frameworks and conformance/worker.py's modes that this machine allows.
FRAMEWORKS = [f for f in ("numpy", "torch", "tensorflow") if installed(f)]
MODES = [mode for mode, needs in (("torch", ["torch"]), ("tf-eager", ["tensorflow"]),
                                  ("tf-function", ["tensorflow"]),
                                  ("cross", ["torch", "tensorflow"])) if installed(*needs)]


def rooted_frameworks(np_: int) -> list[str]:
    """rooted/worker.py's frameworks at ``np_`` ranks: every installed one, but TensorFlow only up
    to 3 ranks (its adapter hands the engine the same requests at any size; four more
    TensorFlow processes cost about 25 CPU-s), while numpy's and torch's go to 4."""
    return [f for f in FRAMEWORKS if np_ <= 3 or f != "tensorflow"]


@dataclass(frozen=True)
class Script:
    path: str  # relative to this folder
    sizes: tuple[int, ...]
    needs: tuple[str, ...]
    args: tuple[str, ...] = ()


#: Every script, in the order a job runs them, with the world sizes it runs at.
SCRIPTS = [
    Script("torch_backend_workers/collectives.py", (2, 3), ("torch",)),
    Script("torch_backend_workers/collectives.py", (2,), ("torch",), ("--ringflow-first",)),
    Script("torch_workers/collectives.py", (1, 2, 3), ("torch",)),
    Script("torch_workers/autograd_and_training.py", (1, 2, 3), ("torch",)),
    Script("torch_workers/devices.py", (1, 2, 3, 4), ("torch",)),
    Script("torch_workers/join.py", (1, 2, 3), ("torch",)),
    Script("torch_workers/overlap.py", (2, 3), ("torch",)),
    Script("conformance/sequence.py", (2, 3), ("torch",)),
    Script("rooted/worker.py", (1, 2, 3, 4), ()),
    Script("conformance/worker.py", (2, 3), ()),
    Script("tf_workers/ops_worker.py", (1, 2), ("tensorflow", "keras")),
    Script("tf_workers/graph_worker.py", (2, 3), ("tensorflow", "keras")),
    Script("tf_workers/keras_worker.py", (2,), ("tensorflow", "keras")),
    Script("tf_workers/compression_worker.py", (2,), ("tensorflow", "keras")),
]


def scripts_at(np_: int, scratch: str) -> list[list[str]]:
    """The command line of each script the job of ``np_`` ranks runs (keras_worker.py writes
    into ``scratch``)."""
    args = {"rooted/worker.py": [",".join(rooted_frameworks(np_))],
            "conformance/worker.py": [",".join(MODES)],
            "tf_workers/keras_worker.py": [scratch]}
    return [[str(HERE / s.path), *s.args, *args.get(s.path, [])] for s in SCRIPTS
            if np_ in s.sizes and installed(*s.needs)
            and (s.path != "conformance/worker.py" or MODES)]


@functools.cache
def job(np_: int) -> CommandResult:
    """The job of ``np_`` ranks (run once per process), whatever its exit code."""
    scratch = tempfile.mkdtemp(prefix="ringflow-jobs-")
    try:
        cmd = command(*scripts_at(np_, scratch))
        if np_ > 1:
            cmd = [sys.executable, "-m", "ringflow.runner", "-np", str(np_), *cmd]
        (result,) = run_commands([cmd], cwd=ROOT, env=ENV, timeout=TIMEOUT_S, check=False)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def passed(np_: int, verdict: str) -> list[re.Match[str]]:
    """Every rank of the job of ``np_`` ranks printed a line matching ``verdict`` (a regular
    expression, ``^`` and ``$`` at line ends, in which ``{r}`` stands for the rank and ``{n}`` for
    ``np_``), and the job exited 0 unless a script said it failed (``one_process: ...``): a job
    that fails after every verdict, at shutdown, fails every test that reads it. The matches, in
    rank order."""
    result = job(np_)
    out = result.output
    found = [re.search(verdict.replace("{r}", str(r)).replace("{n}", str(np_)), out, re.M)
             for r in range(np_)]
    missing = [r for r, match in enumerate(found) if match is None]
    assert not missing, f"no verdict {verdict!r} from rank(s) {missing}:\n{out[-8000:]}"
    assert failure_named(result.returncode, out), (
        f"the job exited {result.returncode}:\n{out[-8000:]}")
    return found  # type: ignore[return-value]
