"""Test tiers (markers registered in pyproject.toml), given by where a test lives:

* ``processes``: starts processes (ringflow-run, ringflow.run, mpirun, torchrun, Ray, Spark, a
  child Python): every test under multiproc/, multihost/, engines/, faults/, mpi/, docs/,
  packaging/, and the few elsewhere marked so themselves;
* ``multihost``: network-namespace hosts with sshd (root), multihost/;
* ``gpu``: a real GPU, gpu/ (skipped without one).

``pytest -m "not processes"`` is the quick tier to run before every commit (unit/ and inproc/:
pure functions, and ranks as threads).

In parallel (pytest-xdist, ``-n 3 --dist loadgroup``: the README's second command), tests that
start no process are spread one by one; a file of process tests goes to one worker as a unit
(:func:`group_of`, through :func:`pytest_xdist_make_scheduler`), so that its module fixtures (a
Ray cluster, a Spark run, a namespace cluster, a built wheel, a reference training) are made
once, as in a serial run. Ray's files share one group: concurrent Ray clusters would each
reserve a share of memory for their object store and contend for the same 2 cores; the files
that read the framework jobs (multiproc/framework_jobs.py) share one group, so each job runs
once. Names that processes share (/dev/shm, network namespaces, ports) are unique per process
already: job ids, pids, port 0.

TensorFlow at collection: every pytest-xdist worker collects every file, and TensorFlow (with
Keras, and the scikit-learn that Keras imports) costs about 5 CPU-seconds to import, Ray Train,
pyspark's TorchDistributor and scikit-learn one or two each. So no test file imports them when
it is collected: the files that use TensorFlow in this process import it in a module fixture
and share one group (with the in-process tests that cast through a framework's kernel), so one
worker imports it; Ray Train and pyspark are imported by their files' module fixtures; the
process tests only look for a package (``importlib.util.find_spec``) and leave the import to
their processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Python's bytecode cache, on for the suite and every process it starts. The suite starts about
# 1,300 Python processes that import the same modules of this checkout; under
# PYTHONDONTWRITEBYTECODE (set in many container images, this project's development VM's among
# them) each of them compiled those modules again, 10-30% of the CPU of a test that starts
# ringflow processes (benchmarks/RESULTS.md section 34). The caches go where Python puts them
# by default, in __pycache__ folders that .gitignore leaves out. Set here, before pytest-xdist
# starts its workers, so that they and every child inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

HERE = Path(__file__).resolve().parent
PROCESSES = {"multiproc", "multihost", "engines", "faults", "mpi", "docs", "packaging"}
#: Files whose tests share one pytest-xdist worker whatever their tier (see the module doc).
GROUPS = {"ray": ("multiproc/test_ray.py", "multiproc/test_ray_multinode.py",
                  "engines/test_ray_train.py"),
          "frameworks": ("multiproc/test_torch.py", "multiproc/test_torch_backend.py",
                         "multiproc/test_overlap.py", "multiproc/test_torch_devices.py",
                         "multiproc/test_rooted_collectives.py",
                         "multiproc/test_conformance_torch.py", "multiproc/test_conformance_tf.py",
                         "multiproc/test_tf_adapter.py"),
          "tensorflow": ("unit/test_tf_helpers.py", "unit/test_tf_status.py",
                         "unit/test_elastic_keras_callbacks.py", "unit/test_casts.py",
                         "inproc/test_tf_compressed.py")}


def group_of(path: Path) -> str | None:
    """The pytest-xdist group of the tests in ``path``: its group in :data:`GROUPS`, else its file
    for a file of process tests; None for tests that may go one by one."""
    try:
        name = path.resolve().relative_to(HERE).as_posix()
    except ValueError:
        return None
    group = next((group for group, paths in GROUPS.items() if name in paths), None)
    return group or (name if name.split("/")[0] in PROCESSES else None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup``: tests go to workers in the units of :func:`group_of`, read from each
    test's id. (xdist's own loadgroup reads ``xdist_group`` marks by rewriting test ids, which
    pytest 9.2's structured ids ignore, so its groups were silently lost: pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(config.rootpath / nodeid.split("::")[0]) or nodeid

    return Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        except ValueError:
            continue
        if tier in PROCESSES:
            item.add_marker(pytest.mark.processes)
        if tier == "multihost":
            item.add_marker(pytest.mark.multihost)
        if tier == "gpu":
            item.add_marker(pytest.mark.gpu)
            if "devices" in item.fspath.basename:
                item.add_marker(pytest.mark.processes)
