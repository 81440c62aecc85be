"""A stand-in for torchvision, for benchmarks only: no torchvision wheel matches CPU torch 2.13.

Only ``torchvision.models.resnet18`` exists (:mod:`.models`). ``benchmarks/torch_ddp_vs_ringflow.py
--horovod-script`` puts this directory first on the workers' ``PYTHONPATH``, so that Horovod's
``pytorch_synthetic_benchmark.py`` (``from torchvision import models``) runs unchanged but for
its import of horovod.
"""

from . import models

__all__ = ["models"]
