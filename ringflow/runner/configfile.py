"""``ringflow-run --config-file``: YAML in ringflow's flat form or horovodrun's nested one.

The flat form has the long flag names as keys (``fusion-threshold-mb: 32`` or
``fusion_threshold_mb: 32``). horovodrun's form (``horovod/runner/common/util/config_parser.py``)
has sections -- ``params``, ``autotune``, ``timeline``, ``stall_check``, ``library_options``,
``logging`` -- and the key ``controller``; :data:`_SECTIONS` maps each of their keys onto the
flag that means the same (``stall_check.enabled`` is the negation of ``--no-stall-check``,
``params.hierarchical_allreduce: false`` is ``--no-hierarchical-allreduce``, ``controller: gloo``
is ``--gloo``, ``controller: mpi`` is ``--mpi``). Both forms may be mixed in one file. Values are
converted and checked as the flags' are; a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from ..errors import ConfigError

__all__ = ["load_config_file", "read_config_file"]

#: horovodrun's nested config file: section -> {key: flag dest}.
_SECTIONS: dict[str, dict[str, str]] = {
    "params": {k: k for k in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity",
                              "hierarchical_allreduce", "hierarchical_allgather")},
    "autotune": {"enabled": "autotune", **{k: f"autotune_{k}" for k in (
        "log_file", "warmup_samples", "steps_per_sample", "bayes_opt_max_samples",
        "gaussian_process_noise")}},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "no_stall_check",  # negated
                    "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {k: k for k in ("mpi_threads_disable", "num_nccl_streams",
                                       "ccl_bgt_affinity", "gloo_timeout_seconds")},
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}


def _flatten(path: str, data: dict[Any, Any]) -> list[tuple[str, str, Any]]:
    """(key as written, flag dest, value) for the flat and the nested form alike.

    Raises:
        ConfigError: a section that is not a mapping, an unknown key in a section, or a
            controller other than gloo or mpi.
    """
    items: list[tuple[str, str, Any]] = []
    for key, value in data.items():
        name = str(key)
        section = _SECTIONS.get(name.replace("-", "_"))
        if name == "controller":
            choice = str(value).lower()
            if choice not in ("gloo", "mpi"):
                raise ConfigError(f"--config-file {path!r}: controller: {value!r} is not gloo "
                                  "or mpi")
            items.append((name, choice, True))
        elif section is not None and isinstance(value, dict):
            for sub, sub_value in value.items():
                dest = section.get(str(sub).replace("-", "_"))
                where = f"{name}.{sub}"
                if dest is None:
                    close = difflib.get_close_matches(str(sub), list(section), n=1)
                    hint = f"; did you mean '{name}.{close[0]}'?" if close else ""
                    raise ConfigError(f"--config-file {path!r}: unknown key {where!r}{hint}")
                if dest == "no_stall_check" and isinstance(sub_value, bool):
                    sub_value = not sub_value
                elif dest == "hierarchical_allreduce" and sub_value is False:
                    dest, sub_value = "no_hierarchical_allreduce", True
                if sub_value is not None:
                    items.append((where, dest, sub_value))
        else:
            items.append((name, name.replace("-", "_"), value))
    return items


def read_config_file(parser: argparse.ArgumentParser, path: str) -> tuple[dict[str, Any],
                                                                      dict[str, str]]:
    """The flag values of a YAML config file, converted and checked like the flags, and for
    each one the key it was written as.

    Raises:
        ConfigError: unreadable file, not a mapping, an unknown key, or a bad value.
    """
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("--config-file needs PyYAML; pip install pyyaml") from exc
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config-file {path!r} cannot be read as YAML: {exc}") from exc
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config-file {path!r} holds a {type(data).__name__}; expected a mapping of long "
            "flag names to values, e.g. 'fusion-threshold-mb: 32'"
        )
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.option_strings and a.dest not in ("help", "version", "config_file"):
            actions.setdefault(a.dest, a)  # the first: --no-stall-check, not --stall-check
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, dest, value in _flatten(path, data):
        action = actions.get(dest)
        if action is None:
            names = sorted(n.replace("_", "-") for n in actions)
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--config-file {path!r}: unknown key {key!r}{hint}")
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not true or false"
                )
        elif isinstance(action, argparse._AppendAction):
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        else:
            try:
                value = action.type(str(value)) if action.type else str(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not a valid value for {flag}"
                ) from None
            if action.choices is not None and value not in action.choices:
                raise ConfigError(
                    f"--config-file {path!r}: {key}: {value!r} is not one of "
                    f"{sorted(action.choices)}"
                )
        values[action.dest] = value
        keys[action.dest] = key
    return values, keys


def load_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The flag values of a YAML config file (see :func:`read_config_file`)."""
    return read_config_file(parser, path)[0]
