"""one_process.py, the helper that runs several test scripts one after the other in one process:
each as ``__main__`` with its own argv and folder, a ``sys.exit`` ending that script only, the
first nonzero status the process's, and a script that fails named."""

from __future__ import annotations

import subprocess
from pathlib import Path

from one_process import command, failure_named


def test_every_script_runs_as_main_and_the_first_failure_is_the_status(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "first.py").write_text(
        "import sys\nprint('first', __name__, sys.argv[1:])\nsys.exit(3)\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "helper.py").write_text("WHERE = 'b'\n")
    (tmp_path / "b" / "second.py").write_text(
        "import sys\nfrom helper import WHERE\nprint('second', __name__, sys.argv[1:], WHERE)\n"
        "sys.exit(4)\n")
    proc = subprocess.run(
        command([str(tmp_path / "a" / "first.py"), "x"], [str(tmp_path / "b" / "second.py")],
                [str(tmp_path / "a" / "first.py")]), capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["first __main__ ['x']", "second __main__ [] b",
                                        "first __main__ []"], proc.stderr
    assert proc.returncode == 3
    assert failure_named(proc.returncode, proc.stderr) and not failure_named(3, proc.stdout)
    assert proc.stderr.splitlines() == [f"one_process: {tmp_path}/a/first.py exited with status 3",
                                        f"one_process: {tmp_path}/b/second.py exited with status 4",
                                        f"one_process: {tmp_path}/a/first.py exited with status 3"]


def test_a_script_that_raises_ends_the_process_and_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("raise ValueError('broken')\n")
    (tmp_path / "next.py").write_text("print('next ran')\n")
    proc = subprocess.run(command([str(tmp_path / "bad.py")], [str(tmp_path / "next.py")]),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "next ran" not in proc.stdout
    assert proc.stderr.startswith(f"one_process: {tmp_path}/bad.py raised; the scripts after it "
                                  "do not run\n"), proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: broken"), proc.stderr
