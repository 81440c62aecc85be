"""@ringflow.launcher's MegEngine arguments: what no job can have fails at the call, before any
process or socket exists, naming the argument and the fix."""

from __future__ import annotations

import pytest

import ringflow
from ringflow.errors import ConfigError
from ringflow.runner.machines import Machine, resolve_secret


def body() -> None:  # never runs: every call below fails first
    raise AssertionError("a process was started")


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"world_size": 3, "n_gpus": 2, "rank_start": 2, "port": 5},
     "would run ranks 2 to 3, but the job's ranks are 0 to 2"),
    ({"world_size": 2, "n_gpus": 1, "rank_start": -1, "port": 5}, "rank_start=-1"),
    ({"world_size": 2, "n_gpus": 1, "rank_start": 1}, "pass port= a free port on the master"),
    ({"world_size": 2, "n_gpus": 1, "rank_start": 0}, "pass port= a free port on the master"),
    ({"n_gpus": 0}, "at least one process"),
    ({"n_gpus": 2, "np": 3}, "they are synonyms"),
    ({"world_size": 4, "n_gpus": 2, "port": 5, "hosts": "a:2,b:2"}, "not both"),
    ({"n_gpus": 2, "port": 70000}, "expected a port number"),
    ({"n_gpus": 2.5}, "expected an integer"),
])
def test_impossible_arguments_fail_at_the_call(kwargs, fragment) -> None:
    with pytest.raises(ConfigError, match="launcher") as info:
        ringflow.launcher(**kwargs)(body)()
    assert fragment in str(info.value)


def test_several_machines_need_a_shared_secret(monkeypatch) -> None:
    monkeypatch.delenv("RINGFLOW_SECRET_FILE", raising=False)
    machine = Machine(world_size=2, n=1, rank_start=0, master_ip="localhost", port=5).check()
    with pytest.raises(ConfigError, match="RINGFLOW_SECRET_FILE to its path on each"):
        resolve_secret(None, machine)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        resolve_secret(b"short", machine)
    assert resolve_secret("ab" * 16, machine) == b"\xab" * 16
    alone = Machine(world_size=2, n=2, rank_start=0, master_ip="localhost", port=0).check()
    assert len(resolve_secret(None, alone)) >= 16  # one machine: a fresh secret


def test_the_secret_file_is_shared(monkeypatch, tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("cd" * 32 + "\n")
    path.chmod(0o600)
    monkeypatch.setenv("RINGFLOW_SECRET_FILE", str(path))
    machine = Machine(world_size=3, n=1, rank_start=2, master_ip="10.0.0.1", port=5).check()
    assert resolve_secret(None, machine) == b"\xcd" * 32
