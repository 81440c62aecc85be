"""Shared by the engine tests: the worker, a clean environment, and running a group of processes
with one deadline."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import ringflow
from ringflow.testing import CommandResult, run_commands

ROOT = Path(ringflow.__file__).resolve().parent.parent
JOB = str(Path(__file__).resolve().parent / "workers" / "job.py")
#: Launcher variables a test must not inherit from whatever started pytest.
_FOREIGN = ("RINGFLOW_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
_FOREIGN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_FOREIGN) and k not in _FOREIGN_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["RINGFLOW_TIMEOUT_S"] = "30"
    env.update(extra)
    return env


def run_all(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], timeout: float = 150,
            cwd: str | None = None) -> list[CommandResult]:
    """:func:`ringflow.testing.run_commands` for (argv, env) pairs, run in the checkout, exit
    codes left to the caller (:func:`passes` checks them): one deadline for all, every group
    killed at it, and then the test fails with everything they printed."""
    return run_commands([argv for argv, _ in commands], env=[env for _, env in commands],
                        cwd=cwd or str(ROOT), timeout=timeout, check=False)


def passes(results: Sequence[CommandResult]) -> list[str]:
    """The PASS lines of every process, sorted; fails with the output when one failed."""
    out = "\n".join(r.stdout for r in results)
    assert all(r.returncode == 0 for r in results), out[-6000:]
    return pass_lines(out)


def pass_lines(out: str) -> list[str]:
    """The PASS lines in ``out``, sorted."""
    # Launchers that merge their children's output (torchrun) may join two lines into one.
    return sorted(m.strip() for m in re.findall(r"PASS rank [^\n]*?(?=PASS rank|\n|$)", out))


def phase(result: CommandResult, name: str) -> str:
    """What phase ``name`` of a driver that runs several in one engine session printed (between
    ``== PHASE name`` and ``== END name ok``, see workers/phases.py); fails with the driver's
    output when that phase failed or never ended."""
    match = re.search(rf"^== PHASE {re.escape(name)}\n(.*?)^== END {re.escape(name)} (\w+)$",
                      result.stdout, re.S | re.M)
    assert match is not None and match.group(2) == "ok", (
        f"phase {name} of {result.args} (exit code {result.returncode}) did not end ok:\n"
        + result.stdout[-8000:])
    return match.group(1)


@contextlib.contextmanager
def loopback_namespace() -> Iterator[list[str]]:
    """A command prefix that runs a command in a fresh network namespace holding only a loopback
    interface (``ip netns exec NS``), for engines that listen on every interface (torchrun's
    agent store does): nothing they open is reachable from outside. An empty prefix where
    namespaces cannot be made (not root, no iproute2)."""
    name = f"rflo{os.getpid() % 100000}"
    ok = shutil.which("ip") is not None and os.geteuid() == 0 and subprocess.run(
        ["ip", "netns", "add", name], capture_output=True, timeout=20).returncode == 0
    try:
        if ok:
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True,
                           capture_output=True, timeout=20)
        yield ["ip", "netns", "exec", name] if ok else []
    finally:
        if ok:
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                      text=True, timeout=20).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
