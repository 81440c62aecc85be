"""The fenced code blocks of the documentation pages, and how each one is run.

The convention (docs/contributing.md says it for writers): the line just before every fenced
block of a page under ``docs/`` is an HTML comment, invisible on the site, that says how the
tests run the block::

    <!-- run: ringflow-run -np 2 -->    a Python program, run as ringflow-run -np 2 python block.py
    <!-- run: python -->                a Python program, run as python block.py
    <!-- run: bash -->                  a bash script, run with bash -euo pipefail
    <!-- run: parse -->                 commands for machines the tests do not have (several
                                        hosts, a Slurm or Kubernetes cluster, an install from the
                                        network): bash -n, and every ringflow-run command through
                                        ringflow-run's own argument parser; YAML is loaded
    <!-- run: output from=PATH -->      not code: what the program PATH printed, quoted (a
                                        benchmark's figures); PATH must exist

followed by options: ``needs=NAME,...`` (a Python module or a program on PATH; the block is
skipped where one is missing, as the GPU and MPI tests are), ``timeout=SECONDS`` (default 120),
``expect=TEXT`` (the output must contain it), and for ``parse`` ``tested-by=PATH``: a test file
that runs these very commands in full (every ``examples/`` file the block names must appear in
it), for commands too slow to run twice. Two more comments make a block a copy, kept verbatim so
that the page reads the same on the code host as on the site (no include to resolve)::

    <!-- file: PATH -->                 the block is the file PATH of the checkout, as it is; the
                                        file must be one that a test outside tests/docs runs
    <!-- generated: COMMAND -->         the block is what COMMAND prints (:data:`GENERATED`)

A test fails when a copy differs from its source; ``python tests/docs/doc_blocks.py --sync``
rewrites every copy. A block with none of these comments fails the tests.

The README follows the same rule, but for its first block: the project's two commands (install
and run an example; install and run the suite), which the tests check against ``.ci/run``.

``docs/DESIGN.md`` is exempt: it is the architecture record the developers keep (its blocks are
the layout of the source tree and design sketches), included in the site as it is; so is
``benchmarks/RESULTS.md``, the record of measurements that docs/benchmarks/results.md includes
(its commands take minutes to hours, on namespace hosts as root).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXEMPT = {"DESIGN.md"}
MODES = ("python", "bash", "parse", "ringflow-run", "output")
OPTIONS = ("needs", "timeout", "expect", "tested-by", "from")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_ANNOTATION = re.compile(r"^\s*<!--\s*run:\s*(?P<body>.*?)\s*-->\s*$")
_FILE = re.compile(r"^\s*<!--\s*file:\s*(?P<path>\S+)\s*-->\s*$")
_GENERATED = re.compile(r"^\s*<!--\s*generated:\s*(?P<command>.+?)\s*-->\s*$")

#: What a ``generated:`` block may show: the command as the page names it -> its argv (run from
#: the checkout with COLUMNS=100).
GENERATED = {"ringflow-run --help": ["-m", "ringflow.runner", "--help"]}


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    annotation: str | None  # the text after "run:", None without a comment
    snippets: tuple[str, ...]  # the file the block copies (a "file:" comment), else ()
    generated: str | None = None  # the command whose output the block copies
    end: int = 0  # the line of the closing fence, 1-based

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Run:
    mode: str  # one of MODES
    launcher_args: tuple[str, ...]  # for ringflow-run: its flags, before `python block.py`
    needs: tuple[str, ...]
    timeout: float
    expect: str | None
    tested_by: str | None  # parse only: the test (a path) that runs the block's examples
    source: str | None  # output only: the program (a path) that printed the block


README = ROOT / "README.md"


def pages() -> list[Path]:
    """The pages under docs/ but the exempt ones, and the README."""
    docs = sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in EXEMPT)
    return [*docs, README]


def blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text().splitlines()
    rel = "README.md" if page == README else page.relative_to(DOCS).as_posix()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(
            rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]
        ):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        previous = lines[start - 1] if start > 0 else ""
        note = _ANNOTATION.match(previous)
        copied = _FILE.match(previous)
        generated = _GENERATED.match(previous)
        yield Block(rel, start + 1, m["info"].strip().split(" ")[0].lstrip("{."), "\n".join(body)
                    + "\n", note["body"] if note else None,
                    (copied["path"],) if copied else (),
                    generated["command"] if generated else None, i)


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def parse_run(annotation: str) -> Run:
    """The :class:`Run` an annotation asks for.

    Raises:
        ValueError: an unknown mode or option, saying which and what is allowed.
    """
    words = shlex.split(annotation)
    if not words or words[0] not in MODES:
        raise ValueError(f"run mode {words[:1]} is not one of {MODES}")
    mode, rest = words[0], words[1:]
    launcher: list[str] = []
    options: dict[str, str] = {}
    for word in rest:
        key, eq, value = word.partition("=")
        if eq and key in OPTIONS:
            options[key] = value
        elif mode == "ringflow-run" and not options:
            launcher.append(word)
        else:
            raise ValueError(f"unknown option {word!r}; options are {OPTIONS} as key=value")
    needs = tuple(filter(None, options.get("needs", "").split(",")))
    if "tested-by" in options and mode != "parse":
        raise ValueError("tested-by= belongs to run: parse (the block is run elsewhere)")
    if (mode == "output") != ("from" in options):
        raise ValueError("run: output and from=PATH go together (the program that printed it)")
    return Run(mode, tuple(launcher), needs, float(options.get("timeout", 120)),
               options.get("expect"), options.get("tested-by"), options.get("from"))


def commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a bash script of command lines (continuations joined, comments
    dropped, split at ``&&``, ``||``, ``;`` and ``|``), without the ``NAME=value`` words that
    set a command's environment before it."""
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", "||", ";", "|"):
                if command:
                    yield command
                command = []
            elif command or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
                command.append(word)


def source_of(block: Block) -> str | None:
    """What a copy block must hold: its file's text, or its command's output (None for other
    blocks)."""
    if block.snippets:
        return (ROOT / block.snippets[0]).read_text()
    if block.generated is not None:
        import os
        import subprocess
        import sys

        argv = GENERATED[block.generated]
        env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        return out.rstrip("\n") + "\n"
    return None


def sync() -> list[str]:
    """Rewrite every copy block from its source; the ids of those that changed."""
    changed = []
    for page in pages():
        lines = page.read_text().splitlines(keepends=True)
        for block in reversed(list(blocks(page))):
            source = source_of(block)
            if source is None or source == block.code:
                continue
            lines[block.line:block.end - 1] = source.splitlines(keepends=True)
            changed.append(block.id)
        page.write_text("".join(lines))
    return changed


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--sync"]:
        sys.exit("usage: python tests/docs/doc_blocks.py --sync")
    print("\n".join(sync()) or "every copy is up to date")
