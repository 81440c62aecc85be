"""The package as a new user gets it (issue 20): the wheel and the sdist build, ``twine check``
passes, and each installs into a fresh virtual environment -- no system site-packages, nothing
from this checkout -- where ``ringflow-run -np 2`` runs an example and ``ringflow.run`` (which
needs cloudpickle, a declared dependency) runs a function on two ranks. The lowest Python that
``requires-python`` claims is tested as well when an interpreter of it is on this machine."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "numpy_allreduce.py"
# Nothing of this checkout or this interpreter's packages may leak into the fresh environments.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
LAUNCHER_CHECK = (
    "import ringflow\n"
    "assert 'site-packages' in ringflow.__file__, ringflow.__file__\n"
    "print('ranks', ringflow.run(ringflow.rank, np=2))\n"
)


def lowest_python() -> str:
    found = re.search(r'^requires-python = ">=([0-9.]+)"', (ROOT / "pyproject.toml").read_text(),
                      re.MULTILINE)
    assert found, "pyproject.toml has no requires-python of the form '>=X.Y'"
    return found.group(1)


def interpreter(version: str) -> str | None:
    """A working ``python<version>``: on PATH (a pyenv shim there may refuse) or in pyenv."""
    pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")))
    for candidate in [shutil.which(f"python{version}"), *reversed(pyenv)]:
        if candidate and subprocess.run([candidate, "-c", ""],
                                        capture_output=True).returncode == 0:
            return candidate
    return None


def run(argv: list[str], cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # A copy of the files git tracks (or would), so that the build writes nothing into the
    # checkout.
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True)
    files = listed.stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], src)
    run([sys.executable, "-m", "twine", "check", "--strict", *map(str, out.iterdir())], src)
    return out


def smoke(python: str, artifact: Path, tmp: Path) -> None:
    venv = tmp / "venv"
    run([python, "-m", "venv", str(venv)], tmp)
    bindir = venv / "bin"
    run([str(bindir / "python"), "-m", "pip", "install", "-q", str(artifact)], tmp)
    out = run([str(bindir / "ringflow-run"), "-np", "2", str(bindir / "python"), str(EXAMPLE)],
              tmp, timeout=120)
    for r in range(2):
        assert f"rank {r}/2: allreduce sum = 3 (expected 3)" in out, out
    out = run([str(bindir / "python"), "-c", LAUNCHER_CHECK], tmp, timeout=120)
    assert "ranks [0, 1]" in out, out


def test_the_wheel_installs_and_runs_a_job_in_a_fresh_venv(dist, tmp_path):
    smoke(sys.executable, next(dist.glob("*.whl")), tmp_path)


def test_the_sdist_installs_and_runs_on_the_lowest_python_claimed(dist, tmp_path):
    version = lowest_python()
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no python{version} on this machine to test requires-python >={version}")
    smoke(python, next(dist.glob("*.tar.gz")), tmp_path)
