"""Griffe extension: the docstrings' Sphinx roles, read as Markdown.

ringflow's docstrings use Sphinx cross-reference roles (``:func:`run```, ``:class:`~.x.Handle```,
``:mod:`ringflow.p2p```), which Markdown would show as literal ``:func:`` text on the API pages.
This keeps the name as inline code: the full name, or its last part where Sphinx's ``~`` asks
for it (``~.launch.run_job`` shows ``run_job``). Loaded by mkdocs.yml's mkdocstrings options.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`(~?)\.?([^`]+)`")


def _name(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_name, obj.docstring.value)
