"""The layers of ringflow/, bottom to top, and the rule that imports go downwards (issue 29).

Every module of the package has a layer in :data:`LAYERS` (the first test fails for a new module
until it is placed). A module may import from its own layer and the layers below; an import that
goes up is allowed only where :data:`UPWARD` lists it with its reason (at most four). There is
no import circle, counting imports inside functions too; a package's ``__init__`` importing its
own modules is structure, not a dependency, and is not counted. Where a new collective,
transport, device or launcher goes: docs/DESIGN.md section 2 and STYLE.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ringflow

PACKAGE = Path(ringflow.__file__).resolve().parent

#: Bottom to top. A module belongs to the layer whose entry is its longest dotted prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base: errors, numbers, settings, message formats, the tables of collectives, polling",
     ("ringflow.errors", "ringflow.ops", "ringflow.config", "ringflow.injection",
      "ringflow.handles", "ringflow.messages", "ringflow.wire", "ringflow.batching",
      "ringflow.topology", "ringflow.threads", "ringflow.compression", "ringflow.collectives",
      "ringflow.requests", "ringflow.lifeline", "ringflow.overlap",
      # The pauses and deadline of every polled wait: stores, transports, devices and
      # algorithms all wait with it, so it sits below them all and imports nothing of ringflow.
      "ringflow.polling")),
    ("rendezvous: stores, the job's secret, finding the store, failure records",
     ("ringflow.rendezvous", "ringflow.client", "ringflow.bootstrap", "ringflow.failure")),
    ("transports: moving bytes; heartbeats and the timeline ride on them",
     ("ringflow.transport", "ringflow.liveness", "ringflow.timeline")),
    ("devices: where a tensor lives, and how it is moved", ("ringflow.devices",)),
    ("algorithms: collectives over a Link (or NCCL), and the same-host lane",
     ("ringflow.algorithms", "ringflow.lane")),
    ("negotiation, point to point and the autotuner (the engine's logic, without threads)",
     ("ringflow.negotiation", "ringflow.p2p", "ringflow.autotune")),
    ("backends: which transport and allreduce implementations a job runs on",
     ("ringflow.backends",)),
    ("the executor: one plan item on the data plane", ("ringflow.executor",)),
    ("the engine: control, threads, failures", ("ringflow.engine",)),
    ("the runtime: init() and shutdown(), the running engine; an elastic worker's generations",
     ("ringflow.runtime", "ringflow.world")),
    ("the call side: a call -> a request, process sets, logs, single-process scopes",
     ("ringflow.submission", "ringflow.process_sets", "ringflow.logs",
      "ringflow.single_process")),
    ("launchers: ringflow-run, ringflow.run, ssh, supervisors", ("ringflow.runner",)),
    ("the public API and what is built on it only",
     ("ringflow", "ringflow.api", "ringflow._adapter", "ringflow.compressed", "ringflow.metrics",
      "ringflow.build",
      "ringflow.testing", "ringflow.ray", "ringflow.elastic")),
    ("framework adapters", ("ringflow.torch", "ringflow.tensorflow")),
]

#: Imports that go up, each with its reason. Keep it at four at most.
UPWARD: dict[tuple[str, str], str] = {
    ("ringflow.runner.pyrun", "ringflow"):
        "the worker side of ringflow.run / @launcher calls the public init() and shutdown() "
        "around the user's function: it is a user of the API, inside the launcher's module",
    ("ringflow.runner.cli", "ringflow"):
        "ringflow-run --version prints the package's __version__, which lives at its top",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of ``path`` (in functions too), relative imports
    resolved to absolute names; ``import m`` gives (m, [])."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]  # a module's package; an __init__'s own package is its folder too
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((module, [alias.name for alias in node.names]))
    return found


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, and every ``module.name`` it imports from one."""
    return {f"{m}.{n}" if n else m for m, names in _imported(path) for n in (names or [""])}


def dependencies(name: str) -> set[str]:
    """The ringflow modules ``name`` depends on: ``from m import x`` counts as the submodule
    ``m.x`` where x is one, else as ``m``. A package's own submodules are not counted."""
    deps = set()
    for module, names in _imported(MODULES[name]):
        if not module.startswith("ringflow"):
            continue
        for n in names or [""]:
            sub = f"{module}.{n}"
            deps.add(sub if n and sub in MODULES else _resolve(module))
    return {d for d in deps if d is not None and d != name and not d.startswith(name + ".")}


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or (prefix != "ringflow" and name.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


def test_imports_go_downwards() -> None:
    up = {(m, d) for m in MODULES for d in dependencies(m)
          if layer_of(d) is not None and layer_of(m) is not None and layer_of(d) > layer_of(m)}
    unexplained = sorted(up - set(UPWARD))
    assert not unexplained, "imports that go up a layer (list them in UPWARD with a reason, or " \
        f"move the code): {[f'{a} -> {b}' for a, b in unexplained]}"
    stale = sorted(set(UPWARD) - up)
    assert not stale, f"UPWARD lists imports that no longer exist: {stale}"
    assert len(UPWARD) <= 4


def test_no_import_circle() -> None:
    graph = {m: dependencies(m) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


TRANSPORTS = sorted((PACKAGE / "transport").glob("*.py"))
ALGORITHMS = sorted((PACKAGE / "algorithms").glob("*.py"))


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: p.name)
def test_algorithms_see_transports_only_through_the_protocols(path: Path) -> None:
    transport = {m for m in imports_of(path) if m.startswith("ringflow.transport")}
    assert transport <= {"ringflow.transport.base"} | {
        m for m in transport if m.startswith("ringflow.transport.base.")}, transport


def test_the_check_sees_relative_and_lazy_imports() -> None:
    found = imports_of(PACKAGE / "algorithms" / "ring.py")
    assert "ringflow.transport.base.Link" in found and "ringflow.algorithms.buffers" in found
    assert "ringflow.engine" in dependencies("ringflow.runtime")  # imported inside init()


def test_no_file_over_600_lines_without_its_reason() -> None:
    """Modules stay small (STYLE: about 600 lines at most); one that is longer says why at its
    top, in its docstring's opening ("Over 600 lines on purpose: ...")."""
    unexplained = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > 600:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Over 600 lines on purpose" not in doc[:1500]:
                unexplained.append(f"{name} ({text.count(chr(10))} lines)")
    assert not unexplained, f"files over 600 lines without a reason at their top: {unexplained}"


def test_the_engine_is_its_loop() -> None:
    """The Engine class holds the lock, the inbox and the loop; its parts live in modules of
    their own (ringflow/engine/), and it names no kind of operation."""
    path = PACKAGE / "engine" / "__init__.py"
    tree = ast.parse(path.read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert engine.end_lineno - engine.lineno + 1 <= 350
    from ringflow.collectives import COLLECTIVES

    strings = {n.value for n in ast.walk(engine) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)}
    assert not strings & set(COLLECTIVES), strings & set(COLLECTIVES)
