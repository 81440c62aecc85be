"""Launching ``fault_worker.py`` scenarios through ``ringflow-run`` for the fault tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ringflow
from ringflow.testing import run_commands

ROOT = str(Path(ringflow.__file__).resolve().parent.parent)
WORKER = str(Path(__file__).resolve().parent / "fault_worker.py")


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    results: dict[int, dict[str, Any]]
    wall: float


def launch(scenario: str, n: int, out: Path, *args: str, extra_env: dict[str, str] | None = None,
           flags: tuple[str, ...] = (), wrapper: tuple[str, ...] = (),
           timeout: float = 90, worker: str = WORKER) -> Job:
    """Run ``scenario`` on ``n`` ranks under ``wrapper`` (a command prefix) with
    :func:`ringflow.testing.run_commands` (past ``timeout`` the job is killed and the test
    fails); every rank's JSON.
    ``worker`` is the script (``fault_worker.py``'s scenarios by default; another script gets
    ``OUTDIR ARGS...``, without a scenario, when ``scenario`` is empty)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*wrapper, sys.executable, "-m", "ringflow.runner", "-np", str(n), *flags,
           sys.executable, worker, *filter(None, [scenario]), str(out), *args]
    start = time.monotonic()
    (proc,) = run_commands([cmd], env=env(**(extra_env or {})), timeout=timeout, check=False,
                           merge_stderr=False)
    wall = time.monotonic() - start
    results = {}
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        results[data["rank"]] = data
    return Job(proc.returncode, proc.stdout, proc.stderr, results, wall)


def small_shm_wrapper(size: str = "64m", listing: Path | None = None) -> tuple[str, ...]:
    """A command prefix that runs the command in a mount namespace of its own with a ``size``
    tmpfs over /dev/shm (Docker's default is 64 MiB); skips the test where that is refused.
    With ``listing``, what is left in that /dev/shm when the command ends is written there, one
    name a line (this job's alone: other jobs on the machine use the real /dev/shm)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run([unshare, "-m", "sh", "-c",
                            f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    run = 'exec "$@"' if listing is None else f'"$@"; rc=$?; ls /dev/shm > {listing}; exit $rc'
    return (unshare, "-m", "sh", "-c",
            f"mount -t tmpfs -o size={size} tmpfs /dev/shm && {run}", "sh")


def same_text(results: dict[int, dict[str, Any]], key: str = "error") -> dict[str, Any]:
    """The error under ``key``: one class and text on every rank of ``results``."""
    seen = {(res[key]["type"], res[key]["text"]) for res in results.values()}
    assert len(seen) == 1, f"ranks saw different errors: {seen}"
    return next(iter(results.values()))[key]


def fault_time(stderr: str) -> float:
    """When the injected fault struck (the hook logs it with the wall-clock time)."""
    for line in stderr.splitlines():
        if "ringflow fault injection at " in line:
            return float(line.split("ringflow fault injection at ")[1].split(":")[0])
    raise AssertionError(f"no fault was injected:\n{stderr[-3000:]}")


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not zombies)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out
