"""What the elastic tests check of a run of elastic_workers/steps.py (its logs in the test's
folder): the schedule of committed steps, the replay of the model from it (each sample once per
epoch), the workers' last records. Used by tests/multiproc/test_elastic.py and, for hosts in
network namespaces, tests/multihost/test_elastic_hosts.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

P, SEED = 1_000_003, 11  # elastic_workers/steps.py's


def schedule(tmp_path: Path) -> list[tuple[int, int, int]]:
    """(epoch, processed, size) of each committed step: where workers logged a step in several
    generations (it was rolled back and redone), the latest one counts."""
    steps: dict[int, dict] = {}
    for path in tmp_path.glob("steps-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            old = steps.get(rec["step"])
            if old is None or rec["gen"] > old["gen"]:
                steps[rec["step"]] = rec
            elif rec["gen"] == old["gen"]:
                assert (rec["size"], rec["processed"]) == (old["size"], old["processed"])
    assert sorted(steps) == list(range(len(steps))), "a step is missing from every log"
    return [(steps[s]["epoch"], steps[s]["processed"], steps[s]["size"]) for s in sorted(steps)]


def samples_per_epoch(tmp_path: Path) -> dict[int, list[int]]:
    """The samples of the committed steps (each step's latest generation), per epoch."""
    latest: dict[int, int] = {}
    records = [json.loads(line) for path in tmp_path.glob("steps-*.jsonl")
               for line in path.read_text().splitlines()]
    for rec in records:
        latest[rec["step"]] = max(latest.get(rec["step"], -1), rec["gen"])
    seen: dict[int, list[int]] = {}
    for rec in records:
        if rec["gen"] == latest[rec["step"]] and rec["sample"] >= 0:
            seen.setdefault(rec["epoch"], []).append(rec["sample"])
    return seen


def replay(plan: list[tuple[int, int, int]], length: int = 12, epochs: int = 2) -> int:
    """The model the schedule gives, each sample once per epoch (asserted)."""
    w = 7
    seen: dict[int, list[int]] = {e: [] for e in range(epochs)}
    for epoch, processed, size in plan:
        order = list(range(length))
        random.Random(SEED + epoch).shuffle(order)
        taken = order[processed:processed + size]
        seen[epoch] += taken
        w = (w * 3 + sum(i + 1 for i in taken)) % P
    for epoch in range(epochs):
        assert sorted(seen[epoch]) == list(range(length)), (epoch, seen[epoch])
    return w


def finals(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("final-*.json"))]


def nothing_leaked(ends: list[dict], sockets: bool = True) -> None:
    """After its last shutdown() a worker holds the same threads and descriptors whatever the
    number of generations it lived through, and no shared-memory name. ``sockets=False``
    compares every descriptor but sockets: a Ray actor's sockets are mostly Ray's own (its RPC
    connections open as the driver and the other workers call it), and once in a whole-suite
    run one actor held one more than the others; the ringflow-run tests compare them all."""
    for end in ends:
        assert end["shm"] == [], end
        assert not [t for t in end["threads"] if "engine" in t or "heartbeat" in t], end
    held = {(tuple(e["threads"]), e["fds"] if sockets else
             tuple(sorted((k, v) for k, v in e["fd_kinds"].items() if k != "socket")))
            for e in ends}
    assert len(held) == 1, ends


def went_on_without(tmp_path: Path, proc: Any, victim: str) -> None:
    """A run of 3 workers whose worker on ``victim`` died at step 5: the job ended 0 with that
    host blacklisted, steps 0-4 at size 3, the rest at 2 (step 5 may complete at 3: the victim's
    contribution can reach the coordinator, which reduces a small tensor itself, before the
    SIGKILL), both survivors hold the replay's model, and nothing leaked."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"host {victim} is blacklisted" in proc.stderr
    plan = schedule(tmp_path)
    sizes = [size for _, _, size in plan]
    assert sizes[:5] == [3] * 5 and sizes[5] in (2, 3) and set(sizes[6:]) == {2}, sizes
    ends = finals(tmp_path)
    assert len(ends) == 2 and {e["size"] for e in ends} == {2}
    assert {e["w"] for e in ends} == {replay(plan)}
    nothing_leaked(ends)


def finished(proc: subprocess.Popen[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The launcher's end (started with ``start_new_session``); past ``timeout`` its group is
    killed (the supervisors stop the workers when the launcher is gone) and the test fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"the elastic job did not end within {timeout:g} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def no_workers_left(tmp_path: Path) -> None:
    """No process of this test's job is alive (its environment names the test's folder)."""
    left = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and str(tmp_path).encode() in Path(f"/proc/{pid}/environ"
                                                                 ).read_bytes():
                left.append(pid)
        except OSError:  # gone meanwhile, or not ours
            pass
    assert not left, left
