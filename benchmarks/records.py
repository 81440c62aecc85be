"""The benchmarks' machine-readable records: one JSON object per line in records.jsonl.

Every benchmark that feeds a published figure appends a record when it finishes::

    {"benchmark": "allreduce_peers", "command": "python benchmarks/allreduce_peers.py --np 2",
     "commit": "1a2b3c4", "date": "2026-11-27T04:03:00Z", "machine": "vm, 2 CPUs (...)",
     "figures": {...}}

``figures`` is the benchmark's own summary (its keys are documented where it calls
:func:`append`). ``benchmarks/report.py`` renders the README's performance table and the
benchmarks page from the latest record of each benchmark, and a test fails when either page
differs from what it renders: a figure in those pages has one source. ``BENCH_RECORDS=PATH``
sends the records elsewhere (the tests that run a benchmark do, to a scratch file).
benchmarks/RESULTS.md keeps
the history in prose, dated. Records whose ``command`` says ``transcribed`` were written from
RESULTS.md's figures of runs made before records existed (the section is named).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["PATH", "append", "latest", "load"]

PATH = Path(__file__).resolve().with_name("records.jsonl")


def _commit() -> str:
    root = PATH.parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", f":!{PATH.relative_to(root)}"],  # the records themselves
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+changes" if dirty.strip() else head or "unknown"


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}, {os.cpu_count()} CPUs" + (f" ({model})" if model else "")


def append(benchmark: str, figures: dict[str, Any], argv: list[str] | None = None,
           path: Path | None = None) -> dict[str, Any]:
    """Append the record of a finished run of ``benchmark`` (``argv``: its arguments, by default
    this process's)."""
    args = sys.argv[1:] if argv is None else argv
    record = {
        "benchmark": benchmark,
        "command": shlex.join(["python", f"benchmarks/{benchmark}.py", *args]),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "figures": figures,
    }
    with open(path or os.environ.get("BENCH_RECORDS") or PATH, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return record


def load(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or PATH
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(benchmark: str, path: Path | None = None, **match: Any) -> dict[str, Any] | None:
    """The newest record of ``benchmark`` whose figures have every ``match`` item."""
    found = [r for r in load(path) if r["benchmark"] == benchmark
             and all(r["figures"].get(k) == v for k, v in match.items())]
    return max(found, key=lambda r: r["date"]) if found else None
