"""docs/concepts/configuration.md's table of variables says what the code does (issue 29): every
tuning knob of :class:`ringflow.config.Config` has a row, each row's default is the field's
default, and each flag it names is one ringflow-run parses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ringflow.config import Config
from ringflow.runner import cli

PAGE = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "configuration.md"
#: Not for users: fault injection for the tests (ringflow.injection), documented in DESIGN.md.
UNDOCUMENTED = {"fault"}


def rows() -> dict[str, tuple[str, str]]:
    """variable -> (flag cell, default cell) of the page's first table."""
    found = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`RINGFLOW_"):
            found[cells[0].strip("`")] = (cells[1], cells[2])
    return found


def _documented(cell: str) -> object:
    """The value a default cell names: ``128 MiB``, ``1``, ``none``, `` `warning` ``..."""
    quoted = cell.split("(")[0].strip()
    first = quoted.strip("`")
    if quoted in ("none", "the interface that reaches the store"):  # unset (not `none`)
        return ""
    match = re.fullmatch(r"(\d+) MiB", first)
    if match:
        return int(match.group(1)) << 20
    try:
        return float(first)
    except ValueError:
        return first


FIELDS = [f for f in dataclasses.fields(Config) if f.name not in UNDOCUMENTED]


def test_every_knob_has_a_row() -> None:
    documented = rows()
    missing = [f"RINGFLOW_{f.name.upper()}" for f in FIELDS
               if f"RINGFLOW_{f.name.upper()}" not in documented]
    assert not missing, f"configuration.md lacks rows for {missing}"


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_the_documented_default_is_the_codes(field: dataclasses.Field) -> None:
    _, default = rows()[f"RINGFLOW_{field.name.upper()}"]
    code = field.default
    want = float(code) if isinstance(code, (int, float)) and not isinstance(code, bool) else code
    got = _documented(default)
    assert got == want or (isinstance(got, float) and isinstance(want, float)
                           and abs(got - want) < 1e-9), (field.name, default, code)


def test_the_documented_flags_are_ringflow_runs() -> None:
    spelled = {a for action in cli._parser()._actions for a in action.option_strings}
    for variable, (flag, _) in rows().items():
        for name in re.findall(r"`(--[a-z-]+)", flag):
            assert name in spelled, f"{variable}: ringflow-run has no {name}"


def test_ringflow_run_binds_by_default_as_the_page_says() -> None:
    _, default = rows()["RINGFLOW_BIND_TO"]
    assert "`ringflow-run`: `auto`" in default
    env, _ = cli._worker_env(cli._parse(["-np", "2", "true"]), {})
    assert env["RINGFLOW_BIND_TO"] == "auto"
    env, _ = cli._worker_env(cli._parse(["-np", "2", "true"]), {"RINGFLOW_BIND_TO": "none"})
    assert env["RINGFLOW_BIND_TO"] == "none"  # the user's wins
