"""``import ringflow`` loads the API on first use (ringflow/__init__.py): the launcher and its
remote bootstrap run without numpy and the engine; every public name is the API module's."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

import ringflow
from ringflow import api
from ringflow.testing import run_commands

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_launcher_and_its_remote_bootstrap_import_no_numpy_and_no_engine() -> None:
    """(then a submodule and an API name load on first use)"""
    code = textwrap.dedent("""
        import sys
        import ringflow.runner.remote
        from ringflow.runner import cli
        status = cli.main(["-np", "2", "true"])
        heavy = ("numpy", "ringflow.api", "ringflow.engine")
        print(status, sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in heavy))
        import ringflow  # a submodule on first use, as the API's names
        print(ringflow.metrics.Accuracy.__module__, ringflow.allreduce.__module__)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                      os.environ.get("PYTHONPATH")]))}
    (result,) = run_commands([[sys.executable, "-c", code]], env=env, timeout=50,
                             merge_stderr=False)
    assert result.stdout.splitlines() == ["0 []", "ringflow.metrics ringflow.api"], result.output


def test_every_public_name_is_the_api_modules() -> None:
    assert set(ringflow.__all__) == {*api.__all__, "__version__", "launcher", "run"}
    for name in api.__all__:
        assert getattr(ringflow, name) is getattr(api, name), name
    assert set(ringflow.__all__) <= set(dir(ringflow))
    namespace: dict[str, object] = {}
    exec("from ringflow import *", namespace)
    assert namespace["allreduce"] is api.allreduce and namespace["run"] is ringflow.run


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'ringflow' has no attribute 'allreduse'"):
        ringflow.allreduse  # noqa: B018
