"""What this installation and this job can do, under Horovod's ``*_built()`` names.

Both adapters re-export these, so they answer the same everywhere and truthfully for ringflow:
ringflow moves bytes with its own TCP and shared-memory transports (never Gloo), with MPI when
mpi4py loads an MPI library, and runs the collectives of CUDA buffers with NCCL where cupy's or
torch's NCCL can run and a device is present (otherwise CUDA work is staged through host
memory; docs/guides/gpus.md says what has run on a GPU).
"""

from __future__ import annotations

__all__ = [
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "is_homogeneous",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built",
]


def mpi_built() -> bool:
    """True when ringflow can use MPI: mpi4py imports and loads an MPI library."""
    from .transport import mpi

    return mpi.available() is not None


def mpi_enabled() -> bool:
    """True when the running job moves data over MPI (the ``mpi`` transport is in use)."""
    from . import runtime

    if not runtime.is_initialized():
        return False
    from .transport import mpi

    return isinstance(runtime.running().transport, mpi.MpiTransport)


def mpi_threads_supported() -> bool:
    """True whenever the mpi transport is in use: it refuses to start without
    MPI_THREAD_MULTIPLE."""
    return mpi_enabled()


def gloo_built() -> bool:
    """False: ringflow has its own TCP transport and does not use Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: ringflow has its own TCP transport and does not use Gloo."""
    return False


def nccl_built() -> bool:
    """True when this process can run NCCL: cupy's binding loads and a CUDA device is present,
    or torch (when already imported) has NCCL and a device (:func:`ringflow.backends.
    nccl_providers`). A job uses it only where every rank can."""
    from .backends import nccl_providers

    return any(not why for why in nccl_providers().values())


def cuda_built() -> bool:
    """True when this process can hand CUDA tensors to ringflow: cupy or torch sees a CUDA
    device (torch is asked only when already imported). Without NCCL they are staged through
    host memory."""
    import sys

    from .algorithms import nccl

    if nccl.available() is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return True
        except Exception:  # no driver or no device: cupy cannot run here
            pass
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    from . import cross_size, local_size, size

    return local_size() * cross_size() == size()
