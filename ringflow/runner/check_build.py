"""``ringflow-run --check-build``: what this installation can do, as horovodrun lists it.

Everything is found without importing the heavy packages (``importlib.util.find_spec``): checking
the build must take a fraction of a second, not the seconds an ``import torch`` takes. A transport
is available when it is registered in :mod:`ringflow.transport` *and* its optional dependency is
installed (``mpi``: mpi4py); a GPU is one that ``nvidia-smi -L`` lists. Two exceptions:
:func:`ringflow.transport.mpi.available` asks a child Python for the MPI library's version
(about 0.2 s; importing mpi4py.MPI here would initialize MPI), and NCCL (not a transport: the
collectives of CUDA buffers, :class:`ringflow.backends.Nccl`): where nvidia-smi lists a GPU,
each provider (cupy's binding, torch's ProcessGroupNCCL) is marked usable only once a child
process has run a one-rank allreduce through it (:func:`ringflow.algorithms.device.self_test`),
and the first that ran is the one in use. A GPU machine takes a few seconds for it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
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


_SELF_TEST = ("import sys\nfrom ringflow.algorithms import device\n"
              "print(device.self_test(sys.argv[1]))")


def _self_test(provider: str) -> tuple[bool, str]:
    """A one-rank NCCL allreduce through ``provider``, in a child process (CUDA is never
    initialized in the launcher): (ran, its versions or why not)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SELF_TEST, provider], capture_output=True,
                              text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the self-test did not finish: {exc}"
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
    return False, lines[-1] if lines else f"the self-test exited with {proc.returncode}"


def _nccl_lines(mark: Any, gpus: list[str]) -> list[str]:
    """NCCL through each provider, usable only once a one-rank collective ran on GPU 0; the
    first that runs is the one a job uses (when every rank has it)."""
    if not gpus:
        return [f"    {mark(False)} NCCL  (nvidia-smi lists no GPU; CUDA tensors would be "
                "staged through host memory)"]
    lines, in_use = [], False
    for provider, module, hint in (("cupy", "cupy", "pip install 'ringflow[gpu]'"),
                                   ("torch", "torch", "pip install 'ringflow[torch]'")):
        if not _installed(module):
            lines.append(f"    {mark(False)} NCCL via {provider}  ({module} missing: {hint})")
            continue
        ok, text = _self_test(provider)
        note = ""
        if ok and not in_use:
            in_use, note = True, "; in use"
        verdict = "a one-rank allreduce ran" if ok else "did not run"
        lines.append(f"    {mark(ok)} NCCL via {provider}  ({text}: {verdict}{note})")
    return lines


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
        if name == "SHM":  # not a registered transport: TCP plus shared memory on each host
            from ..algorithms import shm

            ok = shm.available()
            lines.append(f"    {mark(ok)} SHM" + ("  (ranks on one host, the default there)"
                                                   if ok else "  (/dev/shm is not writable)"))
            continue
        if name == "MPI" and ok:
            ok = mpi_version is not None
            note = f"  ({mpi_version})" if ok else "  (mpi4py.MPI does not import)"
        if not ok and name.lower() not in registered:
            note = "  (not in this build)"
        elif not ok:
            note = f"  ({needs} missing: {hint})"
        lines.append(f"    {mark(ok)} {name}{note}")
    gpus = _gpus()
    lines += _nccl_lines(mark, gpus)
    lines += ["", "Available Launchers:"]
    lines += [f"    {mark(shutil.which('ssh') is not None)} ssh (ringflow-run -H)"]
    lines += [f"    {mark(shutil.which('mpirun') is not None)} mpirun"]
    lines += [f"    {mark(shutil.which('srun') is not None)} srun"]
    lines += ["", "GPUs:"]
    lines += [f"    {g}" for g in gpus] or ["    none found (nvidia-smi -L)"]
    return "\n".join(lines) + "\n"
