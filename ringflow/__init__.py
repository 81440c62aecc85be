"""ringflow: distributed data-parallel training for PyTorch and TensorFlow, in pure Python.

``ringflow.NAME`` is the framework-neutral API on numpy arrays (ringflow/api.py: the
collectives, ``init``, ``rank``, process sets, ...); ``ringflow.torch`` and
``ringflow.tensorflow`` wrap it with Horovod's names. ``import ringflow`` imports no framework,
no mpi4py and no cupy, and loads the API, with numpy and the engine, on the first use of one of
its names: ``ringflow-run`` and its remote bootstrap import this package for
their own modules and start faster without them. A submodule is loaded on first use too
(``ringflow.metrics.Accuracy`` after a plain ``import ringflow``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import lifeline as _lifeline
from . import logs as _logs

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers and the API reference
    from .api import *  # noqa: F403
    from .runner.pyrun import launcher as launcher
    from .runner.pyrun import run as run

__version__ = "0.1.0"

_logs.install()  # ringflow's records reach stderr, with the rank, where no handler takes them
_lifeline.watch()  # a worker of ringflow-run leaves when its supervisor is gone


def __getattr__(name: str) -> Any:
    """``ringflow.NAME`` on first use: ``run`` and ``launcher`` from the launcher, a submodule,
    or a name of ringflow/api.py (its ``__all__``, and what it imports, as before the API moved
    there). Each is then an attribute of this module."""
    if name in ("run", "launcher"):
        value = getattr(importlib.import_module(".runner.pyrun", __name__), name)
    elif name == "__all__":
        value = [*_api().__all__, "__version__", "launcher", "run"]
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # the import system keeps it here
    else:
        try:
            value = getattr(_api(), name)
        except AttributeError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})


def _api() -> Any:
    return importlib.import_module(".api", __name__)
