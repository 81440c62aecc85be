"""The layers import downwards only: transports import no algorithm (nor the executor or the
engine), and algorithms reach transports only through the Protocols of ``transport.base``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ringflow

PACKAGE = Path(ringflow.__file__).resolve().parent


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


TRANSPORTS = sorted((PACKAGE / "transport").glob("*.py"))
ALGORITHMS = sorted((PACKAGE / "algorithms").glob("*.py"))


@pytest.mark.parametrize("path", TRANSPORTS, ids=lambda p: p.name)
def test_transports_import_no_algorithm(path: Path) -> None:
    above = ("ringflow.algorithms", "ringflow.backends", "ringflow.executor", "ringflow.engine",
             "ringflow.negotiation")
    bad = sorted(m for m in imports_of(path) if m.startswith(above))
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: p.name)
def test_algorithms_see_transports_only_through_the_protocols(path: Path) -> None:
    transport = {m for m in imports_of(path) if m.startswith("ringflow.transport")}
    assert transport <= {"ringflow.transport.base"} | {
        m for m in transport if m.startswith("ringflow.transport.base.")}, transport
    above = ("ringflow.backends", "ringflow.executor", "ringflow.engine")
    assert not {m for m in imports_of(path) if m.startswith(above)}


def test_the_check_sees_relative_imports() -> None:
    found = imports_of(PACKAGE / "algorithms" / "ring.py")
    assert "ringflow.transport.base.Link" in found and "ringflow.algorithms.buffers" in found
