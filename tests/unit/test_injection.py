"""The fault-injection specification (``RINGFLOW_FAULT``, :mod:`ringflow.injection`) and the names
the supervisor sweeps from /dev/shm."""

from __future__ import annotations

import os

import pytest

from ringflow import injection as fault
from ringflow.algorithms import shm
from ringflow.config import Config
from ringflow.errors import ConfigError
from ringflow.runner import supervisor


def test_parse_and_defaults():
    faults = fault.parse("rank=1,point=plan,action=delay:0.5,after=3; rank=0,point=init")
    assert [(f.rank, f.point, f.action, f.after) for f in faults] == [
        (1, "plan", "delay:0.5", 3), (0, "init", "kill", 0)]


@pytest.mark.parametrize(("spec", "fragment"), [
    ("rank=1", "needs rank= and point="),
    ("rank=1,point=nowhere", "is not one of"),
    ("rank=1,point=plan,action=explode", "action is kill"),
    ("rank=x,point=plan", "integers"),
    ("rank=1,point=plan,when=3", "is not one of rank="),
])
def test_bad_specifications_name_the_problem(spec, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("=", "=")):
        fault.parse(spec)


def test_unset_costs_a_flag_and_a_fault_acts_once_after_n():
    fault.disarm()
    assert fault.ARMED is False
    fault.arm("rank=0,point=plan,action=raise,after=2;rank=1,point=plan,action=kill", rank=0)
    try:
        assert fault.ARMED
        fault.hit("plan")
        fault.hit("plan")
        fault.hit("submit")  # another point: not counted
        with pytest.raises(RuntimeError, match="fault injected at plan"):
            fault.hit("plan")
        fault.hit("plan")  # once only
    finally:
        fault.disarm()


def test_size_threshold():
    fault.arm("rank=0,point=data_start,action=raise,size=1000", rank=0)
    try:
        fault.hit("data_start", 10)
        with pytest.raises(RuntimeError):
            fault.hit("data_start", 4096)
    finally:
        fault.disarm()


def test_config_reads_the_variable():
    assert Config.from_env({"RINGFLOW_FAULT": "rank=0,point=plan"}).fault == "rank=0,point=plan"


@pytest.mark.skipif(not shm.available(), reason="/dev/shm is not writable here")
def test_supervisor_removes_exactly_the_jobs_names():
    job, other = os.urandom(6).hex(), os.urandom(6).hex()
    mine = [f"/dev/shm/{shm.JOB_PREFIX}{job}_ab12_d3_{r}" for r in range(2)]
    theirs = f"/dev/shm/{shm.JOB_PREFIX}{other}_ab12_d3_0"
    for path in [*mine, theirs]:
        open(path, "wb").close()
    try:
        assert sorted(shm.job_names(job)) == sorted(mine)
        assert sorted(supervisor.remove_shm_names(job)) == sorted(mine)
        assert shm.job_names(job) == [] and os.path.exists(theirs)
        assert supervisor.remove_shm_names("../x") == []
    finally:
        for path in [*mine, theirs]:
            if os.path.exists(path):
                os.unlink(path)
