"""mkdocs hook: pages that show program output get it from the program at build time.

``<!-- insert: ringflow-run --help -->`` on a line of its own becomes the text
``ringflow-run --help`` prints, run from this checkout, 100 columns wide. The page can then never
disagree with the parser (tests/docs/test_docs.py builds the site strictly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "ringflow-run --help": [sys.executable, "-m", "ringflow.runner", "--help"],
}


def _output(argv: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    return proc.stdout.rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs calls it so
    for name, argv in COMMANDS.items():
        marker = f"<!-- insert: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, f"```text\n{_output(argv)}\n```")
    return markdown
