"""Several scripts one after the other in this process, each run as its own ``__main__`` with its
own ``sys.argv`` and its folder first on ``sys.path``, as ``python SCRIPT ARG...`` would run it:

    ringflow-run -np N python one_process.py SCRIPT [ARG...] [-- SCRIPT [ARG...]]...

A process that imports TensorFlow and torch costs seconds of CPU to start, so the tests that
check them run each world size's scripts in one job of such processes. A script's
``sys.exit`` ends that script only; the process exits with the first nonzero status once every
script ran, and each script's own verdict lines say which failed. A script that exits non-zero
or raises is named on stderr (``one_process: SCRIPT exited with status N`` / ``... raised``); one
that raises ends the process, as it would alone.
"""

from __future__ import annotations

import os
import runpy
import sys

#: How this helper's lines on stderr begin.
MARK = "one_process: "


def failure_named(returncode: int, output: str) -> bool:
    """A job of this helper's processes exited 0, or a script said it failed: a non-zero exit with
    no script named happened outside every script (at shutdown), and fails whoever reads it."""
    return returncode == 0 or MARK in output


def command(*scripts: list[str]) -> list[str]:
    """The command that runs ``scripts`` (each ``[path, arg, ...]``) in one process."""
    args = [arg for script in scripts for arg in ("--", *script)][1:]
    return [sys.executable, os.path.abspath(__file__), *args]


def scripts(args: list[str]) -> list[list[str]]:
    """``a x -- b y`` as ``[["a", "x"], ["b", "y"]]``."""
    found: list[list[str]] = [[]]
    for arg in args:
        if arg == "--":
            found.append([])
        else:
            found[-1].append(arg)
    return [argv for argv in found if argv]


def main() -> None:
    status = 0
    for argv in scripts(sys.argv[1:]):
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            if code:
                print(f"{MARK}{argv[0]} exited with status {code}", file=sys.stderr, flush=True)
            status = status or code
        except BaseException:
            print(f"{MARK}{argv[0]} raised; the scripts after it do not run", file=sys.stderr,
                  flush=True)
            raise
    sys.exit(status)


if __name__ == "__main__":
    main()
