"""The test tiers of tests/conftest.py: which tests pytest-xdist may spread one by one and which
go to one worker as a unit (``--dist loadgroup``, the README's second command)."""

from __future__ import annotations

import pytest

pytest.importorskip("xdist")

import conftest  # tests/conftest.py

IDS = [
    "tests/unit/test_layering.py::test_the_engine_is_its_loop",
    "tests/inproc/test_algorithms.py::test_ring[3-float32]",
    "tests/multiproc/test_elastic.py::test_chaos_schedule[0]",
    "tests/multiproc/test_elastic.py::test_chaos_schedule[1]",
    "tests/multiproc/test_ray.py::test_run_allreduces_on_every_rank_in_rank_order[1]",
    "tests/engines/test_ray_train.py::test_example_trains_in_ray_train",
    "tests/docs/test_docs.py::test_block[README.md:65]",
]


def scheduler(pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch, dist: str) -> object:
    monkeypatch.setattr(pytestconfig.option, "dist", dist)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])
    return conftest.pytest_xdist_make_scheduler(pytestconfig, None)


def test_loadgroup_keeps_a_file_of_process_tests_on_one_worker(pytestconfig, monkeypatch) -> None:
    groups = scheduler(pytestconfig, monkeypatch, "loadgroup")
    got = [groups._split_scope(i) for i in IDS]  # type: ignore[attr-defined]
    assert got == [IDS[0], IDS[1], "multiproc/test_elastic.py", "multiproc/test_elastic.py",
                   "ray", "ray", "docs/test_docs.py"]


def test_other_distributions_are_xdists_own(pytestconfig, monkeypatch) -> None:
    assert scheduler(pytestconfig, monkeypatch, "load") is None
