"""Chrome-trace (Perfetto, chrome://tracing) timeline of the engine's work on one rank.

Each tensor gets its own row (``tid``) under the process ``ringflow rank r``. For every op:

* ``NEGOTIATE``: from the moment the engine took the tensor until its plan arrived;
* the op itself (``ALLREDUCE``, ``ALLGATHER``, ...): from the start of execution to completion,
  with ``args.fused`` = how many tensors shared the collective.

Events are appended as they happen (one JSON object per line inside a JSON array, flushed each
time), so a trace of a job that crashed is still readable up to the crash. The engine calls it
only under its control lock; nothing here takes a lock.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO

__all__ = ["Timeline", "path_for_rank"]


class Timeline:
    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._file.write("[\n")
        self._rows: dict[str, int] = {}
        self._t0 = time.perf_counter()
        self._emit({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"ringflow rank {rank}"}})

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row,
                        "args": {"name": name}})
        return row

    def _emit(self, event: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
        self._file.flush()

    def begin(self, name: str, phase: str, **args: object) -> None:
        self._emit({"name": phase, "ph": "B", "pid": self.rank, "tid": self._row(name),
                    "ts": (time.perf_counter() - self._t0) * 1e6, "args": args})

    def end(self, name: str, phase: str) -> None:
        self._emit({"name": phase, "ph": "E", "pid": self.rank, "tid": self._row(name),
                    "ts": (time.perf_counter() - self._t0) * 1e6})

    def close(self) -> None:
        """Finish the JSON array so strict parsers accept the file too."""
        if self._file is None:
            return
        self._file.write(json.dumps({"name": "end", "ph": "M", "pid": self.rank}) + "\n]\n")
        self._file.close()
        self._file = None


def path_for_rank(path: str, rank: int) -> str:
    """Rank 0 writes ``path``; other ranks write ``path`` with ``.rank<r>`` before the suffix."""
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"
