"""ringflow inside Ray Train (issue 15): ``ray.train.torch.TorchTrainer`` (Ray 2.60, Train v2)
runs a loop that calls ``hvd.init()`` with no setup; ringflow joins the process group Ray Train
initialised (detector ``torch``) and trains with ``hvd.DistributedOptimizer``, not DDP.

One driver (workers/ray_train_driver.py) starts one Ray cluster for the module and runs both
phases in it, inside a network namespace that has only a loopback interface: the TCPStore of
Ray Train's process group listens on every interface.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# Ray is imported here only to skip where Ray Train is missing (by the fixture: at collection it
# would cost every pytest-xdist worker seconds, tests/conftest.py), but it reads these at import,
# and tests/multiproc/test_ray.py starts its cluster in this pytest process: set them first.
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
pytest.importorskip("torch")

from engine_harness import clean_env, loopback_namespace, pass_lines, phase, python, run_all

pytestmark = pytest.mark.timeout(300)

DRIVER = str(Path(__file__).resolve().parent / "workers" / "ray_train_driver.py")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("ray.train.torch",
                        reason="Ray Train is not installed (ringflow[ray-train])")
    with loopback_namespace() as prefix:
        if not prefix:
            pytest.skip("Ray Train's process group listens on every interface: these tests run "
                        "it in a loopback-only network namespace (needs root and iproute2)")
        out = tmp_path_factory.mktemp("ray-train")
        (result,) = run_all([(prefix + python(DRIVER, str(out), "checks", "example"),
                              clean_env())], timeout=270)
    return result


def test_hvd_init_joins_ray_trains_process_group(driver) -> None:
    assert pass_lines(phase(driver, "checks")) == [
        "PASS rank 0/2 local 0/2 cross 0/1 via torch",
        "PASS rank 1/2 local 1/2 cross 0/1 via torch",
    ]


def test_example_trains_in_ray_train(driver) -> None:
    text = phase(driver, "example")
    accuracy = float(text.split("EXAMPLE accuracy ")[1].split()[0])
    assert accuracy > 0.8, text
