"""Test tiers (markers registered in pyproject.toml), given by where a test lives:

* ``processes``: starts processes (ringflow-run, ringflow.run, mpirun, torchrun, Ray, Spark, a
  child Python): every test under multiproc/, multihost/, engines/, faults/, mpi/, docs/,
  packaging/, and the few elsewhere marked so themselves;
* ``multihost``: network-namespace hosts with sshd (root), multihost/;
* ``gpu``: a real GPU, gpu/ (skipped without one).

``pytest -m "not processes"`` is the quick tier to run before every commit (unit/ and inproc/:
pure functions, and ranks as threads).

In parallel (pytest-xdist, ``-n auto --dist loadgroup``, on machines with more cores than this
project's 2-core VM, where the README's second command runs serially: its contributing section
says why), tests that start no process are spread one by one; a file of process tests stays on
one worker (an ``xdist_group`` named after it), so that its module fixtures (a Ray cluster, a
Spark run, a namespace cluster, a built wheel, a reference training) are made once, as in a
serial run. Ray's
files share one group: concurrent Ray clusters would each reserve a share of memory for their
object store and contend for the same 2 cores. Names that processes share (/dev/shm, network
namespaces, ports) are unique per process already: job ids, pids, port 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROCESSES = {"multiproc", "multihost", "engines", "faults", "mpi", "docs", "packaging"}
#: Files whose tests share one pytest-xdist worker whatever their tier (see the module doc).
GROUPS = {"ray": ("multiproc/test_ray.py", "multiproc/test_ray_multinode.py",
                  "engines/test_ray_train.py")}


def group_of(item: pytest.Item) -> str:
    """The pytest-xdist group of a process test: its file, or a group of :data:`GROUPS`."""
    path = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
    return next((name for name, paths in GROUPS.items() if path in paths), path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        try:
            tier = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        except ValueError:
            continue
        if tier in PROCESSES:
            item.add_marker(pytest.mark.processes)
            if xdist:
                item.add_marker(pytest.mark.xdist_group(group_of(item)))
        if tier == "multihost":
            item.add_marker(pytest.mark.multihost)
        if tier == "gpu":
            item.add_marker(pytest.mark.gpu)
            if "devices" in item.fspath.basename:
                item.add_marker(pytest.mark.processes)
