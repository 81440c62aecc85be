"""mkdocs hook: what a page shows on the site beyond what the code host shows of it.

Pages are written to read well as plain Markdown on the code host (copies of files and of
``--help`` are committed in them, tests/docs/doc_blocks.py keeps them current). Three things
only the site adds, from HTML comments the code host hides:

* ``<!-- include: PATH -->`` on a line of its own: the file PATH of the checkout, inlined (the
  measurements page includes benchmarks/RESULTS.md);
* ``<!-- api`` ... ``-->`` around mkdocstrings' ``::: module`` directives: unwrapped, so the API
  reference is generated from the docstrings (the page says where to read them on the code host);
* links to files of the checkout outside docs/ (``../../ringflow/__init__.py``): pointed at the
  repository, where mkdocs would find no page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_INCLUDE = re.compile(r"^<!--\s*include:\s*(\S+)\s*-->\s*$", re.M)
_API = re.compile(r"^<!-- api\n(.*?)^-->\s*$", re.M | re.S)
_OUTSIDE = re.compile(r"\]\((?:\.\./)+((?:ringflow|benchmarks|examples|tests|\.ci)/[^)#\s]*)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs calls it so
    markdown = _INCLUDE.sub(lambda m: (ROOT / m[1]).read_text(), markdown)
    markdown = _API.sub(lambda m: m[1], markdown)
    repo = str(config.get("repo_url") or "").rstrip("/")
    return _OUTSIDE.sub(lambda m: f"]({repo}/blob/main/{m[1]})", markdown)
