"""The documentation site (issue 20): ``mkdocs build --strict`` succeeds without a warning, and
every fenced code block of the pages is run as its comment says (the convention:
tests/docs/doc_blocks.py and docs/contributing.md). A block without a run comment fails here, so
a new block cannot escape."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_blocks
from doc_blocks import DOCS, ROOT, Block

BLOCKS = doc_blocks.all_blocks()
# The README's first block is the project's two commands, checked by test_readme_commands.
README_COMMANDS = next(b for b in BLOCKS if b.page == "README.md")
RUN = [b for b in BLOCKS if b.annotation is not None
       and not b.annotation.lstrip().startswith("output")]


def env(shims: Path) -> dict[str, str]:
    """A clean worker environment: this checkout first on PYTHONPATH, and ``python`` /
    ``ringflow-run`` on PATH meaning this interpreter (mpirun and torchrun: its neighbours)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGFLOW_")}
    return {
        **base,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(shims), str(Path(sys.executable).parent), base["PATH"]]),
        "HOME": str(shims.parent / "home"),  # blocks may write ~/.ringflow
        "OMP_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        # Open MPI refuses root unless asked; CI runs as root.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Ray keeps a _node_ip_address of 127.0.0.1 only with this (else it takes eth0's).
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory that looks like the top of the checkout to a block (examples/ and
    benchmarks/ are there), with the shims of :func:`env` in ``.bin`` and the blocks' HOME in
    ``home``."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "home").mkdir()
    make_shims(tmp_path / ".bin", sys.executable)
    return tmp_path


def make_shims(shims: Path, python: str) -> None:
    """``python`` and ``ringflow-run`` in ``shims``, both running ``python`` itself.

    Scripts that exec it, never symlinks to it: in a virtual environment ``python`` is itself a
    link, and Python started through a link in another folder finds no ``pyvenv.cfg`` beside it
    and runs as the base interpreter, without the environment's packages (issue 31)."""
    shims.mkdir(exist_ok=True)
    for name, args in (("python", ""), ("ringflow-run", " -m ringflow.runner")):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec "{python}"{args} "$@"\n')
        shim.chmod(0o755)


def missing(needs: tuple[str, ...]) -> list[str]:
    return [n for n in needs if shutil.which(n) is None and find_spec(n) is None]


def test_every_block_says_how_it_runs() -> None:
    problems = []
    for block in BLOCKS:
        if block.snippets or block.generated or block is README_COMMANDS:
            continue
        if block.annotation is None:
            problems.append(f"{block.id}: a ```{block.lang} block without a <!-- run: ... --> "
                            "comment on the line before it (see docs/contributing.md)")
            continue
        try:
            run = doc_blocks.parse_run(block.annotation)
        except ValueError as exc:
            problems.append(f"{block.id}: {exc}")
            continue
        if run.mode in ("python", "ringflow-run") and block.lang != "python":
            problems.append(f"{block.id}: run: {run.mode} needs a ```python block")
        if run.mode == "bash" and block.lang not in ("bash", "sh"):
            problems.append(f"{block.id}: run: bash needs a ```bash block")
        if run.mode == "output" and not (ROOT / str(run.source)).is_file():
            problems.append(f"{block.id}: run: output from={run.source}: no such file")
    assert not problems, "\n".join(problems)
    assert len(RUN) >= 10, "the pages lost their executed blocks"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.snippets or b.generated],
                         ids=lambda b: b.id)
def test_copies_are_current(block: Block) -> None:
    """A page's copy of a file or of a command's output equals its source (so the page reads
    the same on the code host as on the site); ``python tests/docs/doc_blocks.py --sync``."""
    assert block.code == doc_blocks.source_of(block), (
        f"{block.id} differs from {block.snippets or block.generated}: run "
        "python tests/docs/doc_blocks.py --sync")


def test_pages_read_as_plain_markdown() -> None:
    """Nothing for the code host to show raw: no snippet include, no bare API directive, no
    build-time insert (issue 29: 16 pages rendered empty or raw there)."""
    raw = []
    for page in doc_blocks.pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith(("--8<--", "<!-- insert:")):
                raw.append(f"{page.name}:{n}")
        text = page.read_text()
        bare = [m.start() for m in re.finditer(r"^::: ", text, re.M)
                if not text[:m.start()].rstrip().endswith("<!-- api")]
        raw += [f"{page.name}: ::: at offset {b}" for b in bare]
    assert not raw, raw


def test_included_files_are_run_by_the_suite() -> None:
    """What a page includes is literally a file that a test outside tests/docs runs."""
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py")
                      if "docs" not in p.relative_to(ROOT / "tests").parts)
    included = {path for b in BLOCKS for path in b.snippets}
    assert included, "no page includes an example any more"
    for path in sorted(included):
        assert (ROOT / path).is_file(), f"{path} is included by a page but does not exist"
        if path.startswith("examples/"):
            assert Path(path).name in tests, f"{path} is shown in the docs but no test runs it"


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' installs the doc tools")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not re.search(r"^WARNING", output, re.M), output
    # The API reference is generated from the docstrings, and the CLI reference from --help.
    for page, anchor in [("reference/core", 'id="ringflow.allreduce"'),
                         ("reference/torch", 'id="ringflow.torch.DistributedOptimizer"'),
                         ("reference/tensorflow",
                          'id="ringflow.tensorflow.DistributedGradientTape"'),
                         ("reference/keras", 'id="ringflow.tensorflow.keras.DistributedOptimizer"'),
                         ("reference/launcher", 'id="ringflow.launcher"'),
                         ("reference/cli", "--nproc-per-node")]:
        html = (site / page / "index.html").read_text()
        assert anchor in html, f"{page}: {anchor} is missing"
    assert (site / "busbw.png").is_file()


def test_readme_commands() -> None:
    """The README opens with the two commands: install and run an example (whose ringflow-run
    line parses), and install and run the suite, which is what CI runs, verbatim."""
    assert README_COMMANDS.line == 3, "the README's first lines are its title and the commands"
    first, second = README_COMMANDS.code.splitlines()
    assert "ringflow-run -np 2 python examples/pytorch_mnist.py" in first
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert first in ci and second in ci, ".ci/run no longer runs the README's two lines"
    assert ci.index(first) < ci.index(second)
    assert any(line.startswith(". ") and "activate" in line for line in ci[:ci.index(first)]), \
        ".ci/run runs the README's commands outside a fresh virtual environment (issue 31)"
    from ringflow.runner import cli

    for argv in doc_blocks.commands(README_COMMANDS.code):
        if argv[0] == "ringflow-run":
            assert not isinstance(cli._parse(argv[1:]), int), argv


def test_readme_links_resolve() -> None:
    """The README is the entry point: every relative link it has names a file of the checkout."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert any(link.startswith("docs/") for link in links), "the README links no docs page"
    for link in links:
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block(block: Block, workdir: Path) -> None:
    run = doc_blocks.parse_run(block.annotation or "")
    if absent := missing(run.needs):
        pytest.skip(f"{block.id} needs {', '.join(absent)}")
    suffix = {"python": ".py", "bash": ".sh", "sh": ".sh"}.get(block.lang, f".{block.lang}")
    script = workdir / f"block{suffix}"
    script.write_text(block.code)
    if run.mode == "parse":
        parse(block, script)
        if run.tested_by is not None:
            runner = (ROOT / run.tested_by).read_text()
            for example in set(re.findall(r"examples/[\w/.-]+", block.code)):
                assert example in runner, f"{block.id}: {run.tested_by} does not run {example}"
        return
    argv = {
        "python": ["python", script.name],
        "ringflow-run": ["ringflow-run", *run.launcher_args, "python", script.name],
        "bash": ["bash", "-euo", "pipefail", script.name],
    }[run.mode]
    try:
        proc = subprocess.run(argv, cwd=workdir, env=env(workdir / ".bin"), capture_output=True,
                              text=True, timeout=run.timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish in {run.timeout} s:\n{exc.stdout}\n{exc.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.id} ({' '.join(argv)}) failed:\n{output[-4000:]}"
    if run.expect is not None:
        assert run.expect in output, f"{block.id}: {run.expect!r} not in its output:\n{output}"


def parse(block: Block, script: Path) -> None:
    """Check a block that needs machines the tests do not have, as far as it can be here."""
    if block.lang in ("yaml", "yml"):
        yaml = pytest.importorskip("yaml")
        assert list(yaml.safe_load_all(block.code)), f"{block.id}: empty YAML"
        return
    assert block.lang in ("bash", "sh"), f"{block.id}: run: parse takes bash or yaml blocks"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{block.id}: {proc.stderr}"
    from ringflow.runner import cli

    for argv in doc_blocks.commands(block.code):
        if argv[0] == "ringflow-run":
            parsed = cli._parse(argv[1:])
            assert not isinstance(parsed, int), f"{block.id}: ringflow-run rejects {argv}"


def test_site_pages_are_all_in_the_nav() -> None:
    """mkdocs warns (an error, strictly) about pages left out of the nav; say which here too,
    where the build is skipped for want of mkdocs."""
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))["nav"]

    def files(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [f for e in entry for f in files(e)]
        if isinstance(entry, dict):
            return [f for v in entry.values() for f in files(v)]
        return []

    listed = set(files(nav))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}"


@pytest.mark.timeout(300)
def test_a_block_runs_inside_a_virtual_environment(tmp_path: Path) -> None:
    """Issue 31: a user's virtual environment whose base interpreter lacks the packages.

    The environment sees this interpreter's packages only through a ``.pth`` file of its own
    (so the base interpreter cannot import them through it), plus a module that exists nowhere
    else. The README's Horovod example then runs through the shims, as test_block runs it: the
    shims must start the environment's interpreter, and ringflow-run's workers must be that
    interpreter too (the example prints its loss from rank 0)."""
    block = next(b for b in RUN if b.page == "README.md" and "ringflow.torch" in b.code)
    run = doc_blocks.parse_run(block.annotation or "")
    if absent := missing(run.needs):
        pytest.skip(f"{block.id} needs {', '.join(absent)}")
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    assert python.is_symlink(), "venv made no link: the case of issue 31 is not reproduced"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True, check=True)
    site_dir = Path(purelib.stdout.strip())
    import site

    here = [*site.getsitepackages(), site.getusersitepackages()]
    (site_dir / "this_interpreters_packages.pth").write_text("\n".join(here) + "\n")
    (site_dir / "only_in_the_venv.py").write_text("")
    make_shims(tmp_path / ".bin", str(python))
    (tmp_path / "home").mkdir()
    script = tmp_path / "block.py"
    script.write_text(f"import only_in_the_venv\n{block.code}")
    environment = env(tmp_path / ".bin")
    check = subprocess.run(["python", "-c", "import sys; print(sys.prefix)"], cwd=tmp_path,
                           env=environment, capture_output=True, text=True, timeout=60)
    assert Path(check.stdout.strip()) == venv, check.stdout + check.stderr
    proc = subprocess.run(["ringflow-run", *run.launcher_args, "python", script.name],
                          cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=run.timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert run.expect is not None and run.expect in output, output


def test_figures_come_from_the_records() -> None:
    """The README's performance table and the benchmarks page's are what benchmarks/report.py
    renders from benchmarks/records.jsonl (issue 29: one source for every figure there)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    stale = report.update(check=True)
    assert not stale, (f"{[str(p) for p in stale]} differ from the records: run "
                       "python benchmarks/report.py")
