"""Test tiers (markers registered in pyproject.toml), given by where a test lives:

* ``processes``: starts processes (ringflow-run, ringflow.run, mpirun, torchrun, Ray, Spark, a
  child Python): every test under multiproc/, multihost/, engines/, faults/, mpi/, docs/,
  packaging/, and the few elsewhere marked so themselves;
* ``multihost``: network-namespace hosts with sshd (root), multihost/;
* ``gpu``: a real GPU, gpu/ (skipped without one).

``pytest -m "not processes"`` is the quick tier to run before every commit (unit/ and inproc/:
pure functions, and ranks as threads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROCESSES = {"multiproc", "multihost", "engines", "faults", "mpi", "docs", "packaging"}


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
