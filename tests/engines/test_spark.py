"""ringflow under Spark (issue 15): ``pyspark.ml.torch.distributor.TorchDistributor`` in a real
local Spark session (local mode: torchrun on the driver's host) runs a function that calls
``ringflow.init()`` unchanged, and a training file (workers/job.py) by path; ringflow joins
through torchrun's store (detector ``torchrun``). Also the mode a Spark cluster uses
(``local_mode=False``: barrier tasks, each a torchrun node of one process).

One driver (workers/spark_driver.py) starts one Spark session for the module and runs the
phases in it, inside a network namespace that has only a loopback interface: torchrun's stores
and TorchDistributor's log streaming server listen on every interface. Spark itself is bound to
127.0.0.1, without its web UI.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from engine_harness import clean_env, loopback_namespace, pass_lines, phase, python, run_all

pytestmark = pytest.mark.timeout(300)

DRIVER = str(Path(__file__).resolve().parent / "workers" / "spark_driver.py")
EXPECTED = ["PASS rank 0/2 local 0/2 cross 0/1 via torchrun",
            "PASS rank 1/2 local 1/2 cross 0/1 via torchrun"]


@pytest.fixture(scope="module")
def driver() -> subprocess.CompletedProcess[str]:
    # here, not at collection, where it would cost every pytest-xdist worker (tests/conftest.py)
    pytest.importorskip("pyspark.ml.torch.distributor",
                        reason="pyspark is not installed (ringflow[spark])")
    if shutil.which("java") is None:
        pytest.skip("Spark needs a Java runtime (java on PATH)")
    with loopback_namespace() as prefix:
        if not prefix:
            pytest.skip("TorchDistributor's torchrun listens on every interface: these tests "
                        "run it in a loopback-only network namespace (needs root and iproute2)")
        (result,) = run_all([(prefix + python(DRIVER, "function", "file", "barrier", "example"),
                              clean_env())], timeout=270)
    return result


def test_function_calls_ringflow_init_unchanged(driver) -> None:
    assert pass_lines(phase(driver, "function")) == EXPECTED


def test_training_file_by_path(driver) -> None:
    assert pass_lines(phase(driver, "file")) == EXPECTED


def test_barrier_tasks_as_on_a_cluster(driver) -> None:
    # torchrun numbers the tasks as nodes (GROUP_RANK): two hosts of one rank each, for ringflow.
    assert pass_lines(phase(driver, "barrier")) == [
        "PASS rank 0/2 local 0/1 cross 0/2 via torchrun",
        "PASS rank 1/2 local 0/1 cross 1/2 via torchrun",
    ]


def test_example_trains_under_torch_distributor(driver) -> None:
    text = phase(driver, "example")
    accuracy = float(text.split("EXAMPLE accuracy ")[1].split()[0])
    assert accuracy > 0.8, text
