"""Where an srun step's rank 0 serves the store (``bootstrap._slurm_address``), from Slurm's
variables alone: a node list without brackets needs neither scontrol nor python-hostlist."""

from __future__ import annotations

import sys

import pytest

from ringflow import bootstrap
from ringflow.errors import ConfigError

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}
PORT = 20000 + (31 * 7 + 2) % 10000


@pytest.fixture
def no_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither scontrol on the PATH nor python-hostlist importable."""
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "hostlist", None)  # import hostlist raises ImportError


@pytest.mark.parametrize(("nodelist", "host"), [
    ("vm", "vm"), ("a,b", "a"), (" cn07 , cn08", "cn07"), ("a.example.org,b", "a.example.org"),
])
@pytest.mark.parametrize("var", ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"])
def test_a_plain_node_list_needs_no_helper(no_helpers: None, var: str, nodelist: str,
                                           host: str) -> None:
    assert bootstrap._slurm_address({**STEP, var: nodelist}) == (host, PORT)


def test_the_step_list_wins_over_the_job_list(no_helpers: None) -> None:
    env = {**STEP, "SLURM_JOB_NODELIST": "a,b,c", "SLURM_STEP_NODELIST": "b,c"}
    assert bootstrap._slurm_address(env) == ("b", PORT)


def test_a_list_of_commas_only_names_no_host(no_helpers: None) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST=',' names no host"):
        bootstrap._slurm_address({**STEP, "SLURM_JOB_NODELIST": " , "})


def test_bracketed_ranges_still_need_a_parser(no_helpers: None) -> None:
    with pytest.raises(ConfigError, match="needs scontrol or python-hostlist"):
        bootstrap._slurm_address({**STEP, "SLURM_JOB_NODELIST": "node[01-03]"})
