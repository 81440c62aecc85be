"""Imported at startup of ``ringflow-run --auto`` workers: auto mode once torch is imported.

See ``ringflow/runner/_autostart/__init__.py``. A meta path finder watches for ``import torch``;
when torch's module has run, ``ringflow.torch.auto`` is imported (which enables auto mode).
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys


class _AfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            importlib.import_module("ringflow.torch.auto")

        spec.loader.exec_module = exec_module
        return spec


def _chain():
    """Import the sitecustomize module that this one hides on sys.path, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:  # none to chain to; an import inside it is not ours
        if exc.name != "sitecustomize":
            raise
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    finally:
        sys.path[:] = saved


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorch())
_chain()
