"""ringflow.ray without a Ray cluster: the import contract, argument checks, ranking by node."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

import ringflow
from ringflow.errors import ConfigError
from ringflow.ray import RayExecutor, RaySettings
from ringflow.ray.executor import rank_by_node
from ringflow.testing import CommandResult, run_commands

pytestmark = pytest.mark.timeout(60)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                  os.environ.get("PYTHONPATH")]))}


def _python(code: str) -> CommandResult:
    """``python -c code``; it must exit 0."""
    (result,) = run_commands([[sys.executable, "-c", textwrap.dedent(code)]], env=ENV,
                             timeout=50, merge_stderr=False)
    return result


@pytest.mark.processes
def test_importing_ringflow_and_ringflow_ray_does_not_import_ray() -> None:
    proc = _python("""
        import sys
        import ringflow, ringflow.ray
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
    """)
    assert proc.stdout.strip() == "[]"


@pytest.mark.processes
def test_without_ray_the_executor_names_the_install_command() -> None:
    proc = _python("""
        import sys
        sys.modules["ray"] = None  # what an environment without Ray looks like to an import
        from ringflow.errors import ConfigError
        from ringflow.ray import RayExecutor
        settings = RayExecutor.create_settings(timeout_s=5)  # needs no Ray
        try:
            RayExecutor(settings, num_workers=2)
        except ConfigError as exc:
            print(exc)
    """)
    assert "ringflow.ray needs Ray" in proc.stdout
    assert "pip install 'ringflow[ray]'" in proc.stdout


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({}, "exactly one of num_workers and num_hosts"),
    ({"num_workers": 2, "num_hosts": 1}, "exactly one of num_workers and num_hosts"),
    ({"num_workers": 0}, "num_workers=0) must be an integer >= 1"),
    ({"num_hosts": 2, "num_workers_per_host": 0}, "num_workers_per_host=0"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "needs use_gpu=True"),
    ({"num_workers": 2, "cpus_per_worker": 0}, "must reserve some CPU or GPU"),
])
def test_bad_arguments_are_refused_before_ray_is_needed(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_settings() -> None:
    settings = RayExecutor.create_settings(timeout_s=7, placement_group_timeout_s=9,
                                           nics={"eth1"})
    assert settings == RaySettings(7.0, 9.0, ("eth1",))
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RayExecutor.create_settings(timeout_s=0)
    with pytest.raises(ConfigError, match=r"RayExecutor\.create_settings"):
        RayExecutor(object(), num_workers=1)  # type: ignore[arg-type]


def test_ranks_are_assigned_node_by_node_in_creation_order() -> None:
    # Actors created alternately on nodes b and a (as a PACK group can place them).
    order, specs = rank_by_node(["b", "a", "b", "a", "b"], ["hb", "ha", "hb", "ha", "hb"])
    assert order == [0, 2, 4, 1, 3]
    got = [(s.rank, s.size, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.host)
           for s in specs]
    assert got == [
        (0, 5, 0, 3, 0, 2, "hb"), (1, 5, 1, 3, 0, 2, "hb"), (2, 5, 2, 3, 0, 2, "hb"),
        (3, 5, 0, 2, 1, 2, "ha"), (4, 5, 1, 2, 1, 2, "ha"),
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_one_node_gives_local_equal_global(n: int) -> None:
    order, specs = rank_by_node(["x"] * n, ["h"] * n)
    assert order == list(range(n))
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in specs] == [
        (r, n, 0, 1) for r in range(n)]
