"""The test tiers of tests/conftest.py: which tests pytest-xdist may spread one by one and which
go to one worker as a unit (``--dist loadgroup``, the README's second command); and that
collecting the files that use TensorFlow, Ray Train, pyspark or scikit-learn imports none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    "tests/unit/test_tf_status.py::test_other_errors_are_left_alone",
    "tests/unit/test_casts.py::test_cast_into_gives_numpys_bits_nans_included[0.125-torch]",
]


def scheduler(pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch, dist: str) -> object:
    monkeypatch.setattr(pytestconfig.option, "dist", dist)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])
    return conftest.pytest_xdist_make_scheduler(pytestconfig, None)


def test_loadgroup_keeps_a_file_of_process_tests_on_one_worker(pytestconfig, monkeypatch) -> None:
    groups = scheduler(pytestconfig, monkeypatch, "loadgroup")
    got = [groups._split_scope(i) for i in IDS]  # type: ignore[attr-defined]
    assert got == [IDS[0], IDS[1], "multiproc/test_elastic.py", "multiproc/test_elastic.py",
                   "ray", "ray", "docs/test_docs.py", "tensorflow", "tensorflow"]


def test_other_distributions_are_xdists_own(pytestconfig, monkeypatch) -> None:
    assert scheduler(pytestconfig, monkeypatch, "load") is None


COLLECT = """
import sys, pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
heavy = ("tensorflow", "keras", "ray.train", "pyspark", "sklearn")
print("IMPORTED", [name for name in heavy if name in sys.modules])
sys.exit(code)
"""


@pytest.mark.processes
def test_collection_imports_no_tensorflow_ray_train_pyspark_or_scikit_learn() -> None:
    """Every pytest-xdist worker collects every file: a file that imported TensorFlow when
    collected would cost each of them about 5 CPU-seconds (tests/conftest.py)."""
    tests = Path(__file__).resolve().parents[1]
    files = {path for paths in conftest.GROUPS.values() for path in paths} | {
        "multiproc/test_tf_examples.py", "multiproc/test_elastic.py",
        "engines/test_thread_defaults.py", "engines/test_spark.py", "engines/test_ray_train.py",
        "multiproc/test_jittor_examples.py", "multiproc/test_compressed_processes.py",
        "multiproc/test_megengine_style.py"}
    proc = subprocess.run([sys.executable, "-c", COLLECT, *sorted(files)], capture_output=True,
                          text=True, timeout=120, cwd=tests)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout, proc.stdout[-3000:]
