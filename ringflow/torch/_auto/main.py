"""``python -m ringflow.torch.auto [-m MODULE | SCRIPT] [ARGS...]``: run an unchanged script in
auto mode, under any launcher (``mpirun``, ``srun``, ``torchrun -m ringflow.torch.auto``)."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

USAGE = """usage: python -m ringflow.torch.auto [-m MODULE | SCRIPT] [ARGS...]

Run SCRIPT (or MODULE) with ringflow.torch.auto enabled: every optimizer averages gradients over
the ranks, every DataLoader splits each global batch among them, BatchNorm layers synchronise.
Under any launcher: mpirun -np 2 python -m ringflow.torch.auto train.py; srun ...;
torchrun --nproc-per-node 2 -m ringflow.torch.auto train.py; ringflow-run --auto does it for you.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script or module named by ``argv`` (default ``sys.argv[1:]``) as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    if args[0] == "-m":
        if len(args) < 2:
            sys.stderr.write("python -m ringflow.torch.auto: -m needs a module name\n")
            return 2
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    if not os.path.exists(script):
        sys.stderr.write(f"python -m ringflow.torch.auto: can't open file {script!r}\n")
        return 2
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    return 0
