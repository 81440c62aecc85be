"""Which file ``RINGFLOW_LIFELINE`` names (``ringflow.lifeline``): only the pipe it was made for;
the variable outlives the descriptor in a subprocess started with ``close_fds``, where the
number may name another file. (Leaving when the supervisor dies: tests/multiproc/
test_no_orphans.py.)"""

from __future__ import annotations

import os
import tempfile

from ringflow import lifeline


def test_the_pipe_it_was_made_for() -> None:
    r, w = os.pipe()
    try:
        ino = os.fstat(r).st_ino
        assert lifeline._pipe({lifeline.VARIABLE: f"{r}:{ino}"}) == r
        assert lifeline._pipe({lifeline.VARIABLE: f"{r}:{ino + 1}"}) is None  # another pipe
    finally:
        os.close(r)
        os.close(w)
    assert lifeline._pipe({lifeline.VARIABLE: f"{r}:{ino}"}) is None  # closed here


def test_nothing_else() -> None:
    with tempfile.TemporaryFile() as f:  # a regular file, even with its own inode
        fd = f.fileno()
        assert lifeline._pipe({lifeline.VARIABLE: f"{fd}:{os.fstat(fd).st_ino}"}) is None
    for value in ("", "7", "x:1", "7:", ":7"):
        assert lifeline._pipe({lifeline.VARIABLE: value}) is None
    assert lifeline._pipe({}) is None
    assert lifeline.watch({}) is False
