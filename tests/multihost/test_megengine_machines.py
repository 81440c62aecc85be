"""MegEngine's multi-machine launch: the same script on two "machines" (network namespaces joined by
a veth pair, each with its own address), each with its own ``rank_start``.

``@ringflow.launcher(world_size=W, n_gpus=n, rank_start=s, master_ip=A, port=P)`` on each: the
machine with ``rank_start=0`` serves the store on ``A:P``; the other joins it with the shared
secret (``RINGFLOW_SECRET_FILE``). Every check is against a closed form or a one-process replay
(``tests/multiproc/megengine_workers/machine.py``). A fixed port is safe here: each namespace
is private to the test. Skipped where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ringflow
from ringflow.testing import run_commands

pytestmark = pytest.mark.timeout(300)

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
MACHINE = str(Path(__file__).resolve().parent.parent / "multiproc" / "megengine_workers"
              / "machine.py")
PORT = "29517"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if _ip("-V", check=False).returncode != 0:
        return "iproute2 is missing"
    return None


@contextlib.contextmanager
def two_machines() -> Iterator[tuple[list[str], list[str], str, str]]:
    """Two namespaces ``a`` (10.231.7.1) and ``b`` (10.231.7.2) joined by a veth pair: a command
    prefix for each and their addresses. Everything is removed on exit."""
    tag = f"rfmge{os.getpid() % 100000}"
    names = [f"{tag}a", f"{tag}b"]
    addrs = ["10.231.7.1", "10.231.7.2"]
    made: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", names[0], "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
            "netns", names[1])
        for ns, dev, addr in zip(names, ("veth0", "veth1"), addrs, strict=True):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield ["ip", "netns", "exec", names[0]], ["ip", "netns", "exec", names[1]], *addrs
    finally:
        for ns in made:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def machines() -> Iterator[tuple[list[str], list[str], str, str]]:
    why = _unavailable()
    if why:
        pytest.skip(why)
    with two_machines() as m:
        yield m


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return str(path)


def launch(parts: list[tuple[list[str], list[str], dict[str, str]]], tmp_path: Path,
           timeout: float = 240) -> list[dict]:
    """Start ``prefix + [python, machine.py, *args]`` for each part at once; return each OUT."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    outs = [tmp_path / f"machine{i}.json" for i in range(len(parts))]
    done = run_commands(
        [[*prefix, sys.executable, MACHINE, *args[:6], str(out), *args[6:]]
         for (prefix, args, _), out in zip(parts, outs, strict=True)],
        env=[{**os.environ, "PYTHONPATH": path, **env} for _, _, env in parts], timeout=timeout)
    results = []
    for result, out in zip(done, outs, strict=True):
        data = json.loads(out.read_text())
        data["log"] = result.output
        results.append(data)
    return results


def _cluster(machines, sizes: list[int], scenario: str, env: dict[str, str],
             extra: list[str] | None = None) -> list[tuple[list[str], list[str], dict[str, str]]]:
    prefix_a, prefix_b, addr_a, _ = machines
    world = str(sum(sizes))
    starts = [0, sizes[0]]
    return [(prefix, [scenario, world, str(n), str(s), addr_a, PORT, *(extra or [])], env)
            for prefix, n, s in zip((prefix_a, prefix_b), sizes, starts, strict=True)]


@pytest.mark.parametrize("sizes", [[1, 1], [2, 1]])
def test_two_machines_form_one_job(machines, secret_file, tmp_path, sizes) -> None:
    out = launch(_cluster(machines, sizes, "job", {"RINGFLOW_SECRET_FILE": secret_file}),
                 tmp_path)
    world = sum(sizes)
    ranks = []
    for m, (data, n) in enumerate(zip(out, sizes, strict=True)):
        assert "results" in data, data
        assert len(data["results"]) == n  # each machine returns its own ranks' results
        for local, res in enumerate(data["results"]):
            ranks.append(res["rank"])
            assert res["rank"] == sum(sizes[:m]) + local
            assert res["size"] == world
            assert res["local"] == [local, n]
            assert res["cross"] == [m, 2]
            assert res["sum"] == [world * (world + 1) / 2] * 5
            assert res["seen"] == [True] * world  # every rank's picklable value, everywhere
            assert res["late"] == ["set", "after", 1.0, "s"]
            assert 0.4 < res["timed_out"][0] < 5 and "not set within 0.5 s" in res["timed_out"][1]
    assert ranks == list(range(world))
    # The get that waited for the late set (rank world-1 sets it after 1 s) blocked for it.
    assert all(res["waited"] > 0.5 for data in out for res in data["results"]
               if res["rank"] != world - 1)


@pytest.mark.parametrize("sizes", [[1, 1], [2, 1]])
def test_pipeline_across_machines_equals_one_process(machines, secret_file, tmp_path,
                                                     sizes) -> None:
    out = launch(_cluster(machines, sizes, "pipeline", {"RINGFLOW_SECRET_FILE": secret_file}),
                 tmp_path)
    results = [res for data in out for res in data["results"]]
    assert [res["rank"] for res in results] == list(range(sum(sizes)))
    for res in results:
        for step in res["diffs"]:
            assert step["grads"] == [0.0, 0.0] and step["params"] == [0.0, 0.0], res
    last = results[-1]
    assert [d["loss"] for d in last["diffs"]] == [0.0] * 3
    assert all(a == b for a, b in last["losses"])


def test_a_machine_without_the_secret_is_refused(machines, secret_file, tmp_path) -> None:
    parts = _cluster(machines, [1, 1], "job", {"RINGFLOW_SECRET_FILE": secret_file},
                     extra=["start_timeout=8"])
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    parts[1] = (parts[1][0], parts[1][1], {"RINGFLOW_SECRET_FILE": str(wrong)})
    master, other = launch(parts, tmp_path)
    assert other["error"] == "ConfigError", other
    assert "refused this machine's secret" in other["text"]
    assert master["error"] == "LaunchError" and "nobody runs ranks 1" in master["text"], master


def test_several_machines_need_a_secret(machines, tmp_path) -> None:
    env = {"RINGFLOW_SECRET_FILE": ""}
    for data in launch(_cluster(machines, [1, 1], "job", env), tmp_path):
        assert data["error"] == "ConfigError" and "RINGFLOW_SECRET_FILE" in data["text"], data


def test_machines_that_disagree_fail_naming_the_disagreement(machines, secret_file,
                                                             tmp_path) -> None:
    env = {"RINGFLOW_SECRET_FILE": secret_file}
    # world_size: the master says 2, the other machine 3.
    parts = _cluster(machines, [1, 1], "job", env, extra=["start_timeout=8"])
    parts[1][1][1] = "3"
    master, other = launch(parts, tmp_path)
    assert other["error"] == "ConfigError" and "master has 2" in other["text"], other
    assert master["error"] == "ConfigError" and "disagree on world_size" in master["text"], master
    # Overlapping ranks: both machines say rank_start=0 ... but only one may be the master, so
    # the second says rank_start=0 with n_gpus=2 of world_size 3 against the master's 0..1.
    parts = _cluster(machines, [2, 1], "job", env, extra=["start_timeout=8"])
    parts[1][1][3] = "1"  # ranks 1 on the second machine, also the master's
    master, other = launch(parts, tmp_path)
    texts = master["text"] + other["text"]
    assert "rank 1 is claimed by two machines" in texts, (master, other)


def test_a_rank_that_raises_ends_both_machines(machines, secret_file, tmp_path) -> None:
    master, other = launch(_cluster(machines, [2, 1], "raise",
                                    {"RINGFLOW_SECRET_FILE": secret_file}), tmp_path)
    assert other["error"] == "RankFailure" and "rank 2 fails on purpose" in other["text"], other
    assert master["error"] == "RankFailure" and "rank 2" in master["text"], master
