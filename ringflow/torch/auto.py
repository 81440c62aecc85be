"""Run an unchanged single-process torch script data-parallel, as Jittor does under mpirun.

::

    ringflow-run --auto -np 4 python train.py          # nothing to change in train.py
    mpirun -np 4 python -m ringflow.torch.auto train.py  # any launcher: srun, torchrun -m, ...
    import ringflow.torch.auto                          # or: first line of the script

Importing this module enables auto mode for the process (:func:`enable`; :func:`disable` undoes
it). In a job of several ranks, from then on:

- **optimizers** (every ``torch.optim.Optimizer``): their parameters are broadcast from rank 0
  when they are made, and their gradients averaged over the ranks at every ``step()`` (with a
  closure, after every call of the closure, whose loss is averaged too);
- **DataLoaders**: ``batch_size`` is the *global* batch; each batch that one process would draw
  is split among the ranks (shuffled with rank 0's order, each epoch as one process would
  reshuffle), so every sample is used once per epoch, on one rank;
- **BatchNorm1d/2d/3d** (and ``torch.nn.SyncBatchNorm`` without a process group) normalise over
  every rank's batch in training.

So the ranks together compute what one process computes on the global batch: the same final
parameters, up to the order of floating-point additions, when every batch divides evenly among
the ranks. Alone (one process, or no launcher) nothing changes.

Limits:

- Gradients are averaged in ``step()``. A loop that never calls ``optimizer.step()`` (its own
  update rule), or an optimizer that is not a ``torch.optim.Optimizer``, is not averaged; nor
  are gradients read before ``step()`` (clipping by norm sees this rank's gradients; use
  ``hvd.DistributedOptimizer`` and ``synchronize()`` for that). Every rank must step each
  optimizer after the same DataLoader batches (checked at every step: a MismatchError on every
  rank otherwise), so a ``GradScaler`` that skips a step on some ranks only fails.
- Parameters are broadcast when the optimizer is made: parameters added later
  (``add_param_group``) are not.
- A DataLoader with an explicit ``DistributedSampler`` is left alone; one of an
  ``IterableDataset`` or with ``batch_size=None`` is not sharded (a warning says so once).
  Other samplers and batch samplers are sharded (rank 0's batches split); they must be finite.
  Data a script slices from tensors itself is not sharded: every rank then computes the same
  gradients (the result is still one process's, without the speed-up), and the step check
  below sees nothing.
- A batch that does not divide evenly among the ranks gives shares that differ by one (the
  average of their mean gradients then differs slightly from one process's); a last batch with
  fewer samples than ranks gives some ranks one batch fewer (set ``drop_last=True`` on training
  loaders). Warnings say so.
- The random numbers a script draws after the start (dropout, augmentation) differ between
  ranks and from one process's; shuffling does not depend on them (rank 0's order is used).
- Global metrics need :mod:`ringflow.metrics` (each rank sees its share of an evaluation
  loader), or :func:`ringflow.single_process_scope` (runs a function on rank 0 alone, where
  loaders are not sharded, and returns its result everywhere).

The patches, and what each does when, are documented in ``ringflow.torch._auto``.
"""

from __future__ import annotations

import sys

from ._auto import active, disable, enable, enabled

__all__ = ["active", "disable", "enable", "enabled"]

enable()

if __name__ == "__main__":
    from ._auto.main import main

    sys.exit(main())
