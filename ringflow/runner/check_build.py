"""``ringflow-run --check-build``: what this installation can do, as horovodrun lists it.

Everything is found without importing the heavy packages (``importlib.util.find_spec``): checking
the build must take a fraction of a second, not the seconds an ``import torch`` takes. A transport
is available when it is registered in :mod:`ringflow.transport` *and* its optional dependency is
installed (``mpi``: mpi4py); a GPU is one that ``nvidia-smi -L`` lists. Two exceptions:
:func:`ringflow.transport.mpi.available` asks a child Python for the MPI library's version
(about 0.2 s; importing mpi4py.MPI here would initialize MPI), and NCCL (not a transport: the
allreduce of CUDA buffers, :class:`ringflow.backends.Nccl`) is listed when cupy is installed,
its NCCL loads and nvidia-smi lists a GPU, with the NCCL version.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from typing import Any

__all__ = ["check_build"]

_FRAMEWORKS = (("PyTorch", "torch"), ("TensorFlow", "tensorflow"))
#: (transport, the module it needs besides ringflow, install hint)
_TRANSPORTS = (
    ("TCP", None, ""),
    ("SHM", None, ""),
    ("MPI", "mpi4py", "pip install 'ringflow[mpi]'"),
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU")]


def _nccl_line(mark: Any, gpus: list[str]) -> str:
    """NCCL: cupy installed, its NCCL loads, and a GPU is listed (CUDA is not initialized)."""
    if not _installed("cupy"):
        return (f"    {mark(False)} NCCL  (cupy missing: pip install 'ringflow[gpu]'; CUDA "
                "tensors are staged through host memory)")
    from ..algorithms import nccl

    version = nccl.available()
    if version is None:
        return f"    {mark(False)} NCCL  (cupy is installed but its NCCL does not load)"
    if not gpus:
        return f"    {mark(False)} NCCL  ({version} loads, but nvidia-smi lists no GPU)"
    return (f"    {mark(True)} NCCL  ({version}, allreduce of CUDA buffers; other collectives "
            "staged)")


def check_build(version: str) -> str:
    """The checklist text (ends with a newline)."""
    from .. import transport
    from ..transport import mpi

    registered = set(transport.available())
    mpi_version = mpi.available() if _installed("mpi4py") else None

    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    lines = [f"ringflow v{version}:", "", "Available Frameworks:"]
    lines += [f"    {mark(_installed(mod))} {name}" for name, mod in _FRAMEWORKS]
    lines += ["", "Available Controllers:", f"    {mark(True)} TCP (rendezvous store)"]
    lines += [f"    {mark(mpi_version is not None)} MPI (mpirun bootstrap through mpi4py)"]
    lines += ["", "Available Tensor Operations:"]
    for name, needs, hint in _TRANSPORTS:
        ok = name.lower() in registered and (needs is None or _installed(needs))
        note = ""
        if name == "MPI" and ok:
            ok = mpi_version is not None
            note = f"  ({mpi_version})" if ok else "  (mpi4py.MPI does not import)"
        if not ok and name.lower() not in registered:
            note = "  (not in this build)"
        elif not ok:
            note = f"  ({needs} missing: {hint})"
        lines.append(f"    {mark(ok)} {name}{note}")
    gpus = _gpus()
    lines.append(_nccl_line(mark, gpus))
    lines += ["", "Available Launchers:"]
    lines += [f"    {mark(shutil.which('ssh') is not None)} ssh (ringflow-run -H)"]
    lines += [f"    {mark(shutil.which('mpirun') is not None)} mpirun"]
    lines += [f"    {mark(shutil.which('srun') is not None)} srun"]
    lines += ["", "GPUs:"]
    lines += [f"    {g}" for g in gpus] or ["    none found (nvidia-smi -L)"]
    return "\n".join(lines) + "\n"
