"""Which gradients are submitted together: the batching policy both adapters share.

A training step's gradients become ready one at a time (torch's post-accumulate-grad hooks, in
backward order) or all at once (a TensorFlow tape). :class:`GradientBatcher` is told of each one
as it becomes ready (:meth:`~GradientBatcher.ready`), or of all of them
(:meth:`~GradientBatcher.all_ready`), and answers with the batches to submit now:

- **Explicit groups** (Horovod's ``groups``: lists of parameters, or an int = that many
  consecutive runs of the rank-independent order, :func:`split_groups`): a group is one batch,
  submitted as one grouped operation once all of its members are ready.
- **Everything else** goes in buckets, in the order the gradients become ready (the reverse of the
  forward pass for torch's hooks, as DDP's buckets): a gradient joins the open bucket, and the
  bucket becomes a batch as soon as it holds its cap of bytes -- the first bucket of a pass
  :data:`FIRST_BUCKET_BYTES` (1 MiB, DDP's first bucket), every later one
  :attr:`BucketPolicy.bucket_bytes` (``RINGFLOW_BUCKET_BYTES``, or the autotuner's choice) -- or
  when the pass ends (:meth:`GradientBatcher.flush`). A small first bucket starts the exchange
  early, while most of backward is still ahead, so that it overlaps the rest of the pass; a gradient
  of unknown size (sparse) is a batch of its own at once. ``bucket_bytes=0`` holds everything until
  the pass ends: the non-overlapped path. Batching never changes a result where the reduction adds
  in an order that fusion does not decide (shared memory, 2 ranks, fusion off: DESIGN.md section 4),
  tested bit for bit in tests/multiproc/test_overlap.py. Gradients that are all ready at once (a
  tape) have no backward pass left to overlap: they are one batch.

Horovod reduces the parameters that no explicit group names one by one; here they follow the bucket
rule (the results are the same: batching decides only which tensors are negotiated together).
Batches of the bucket are marked ``grouped=False``: their members may be submitted one by one,
because which gradients share a bucket depends on the order they became ready in, which ranks do
not have to agree on; an explicit group is the same on every rank, so it can be one operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

__all__ = ["AT_END", "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Batch", "BucketPolicy",
           "GradientBatcher", "split_groups"]

#: The first bucket of a pass: DDP's (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``). On the
#: 0.4 M-parameter CNN of benchmarks/torch_ddp_vs_ringflow.py it holds the two linear layers
#: (1.0 MiB of its 1.4 MiB), which are ready first and go while the convolutions' backward runs.
FIRST_BUCKET_BYTES = 1 << 20
#: Every later bucket (``RINGFLOW_BUCKET_BYTES``'s default). Buckets turn many small tensors into
#: few collectives (the CNN's 10 tensors: 2 batches a step), and large enough ones start at once.
BUCKET_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """How the ungrouped gradients of a pass are cut into batches: the first bucket closes at
    ``min(first_bytes, bucket_bytes)``, later ones at ``bucket_bytes``; ``bucket_bytes=0``: one
    bucket submitted when the pass ends (no overlap with backward)."""

    bucket_bytes: int = BUCKET_BYTES
    first_bytes: int = FIRST_BUCKET_BYTES

    def cap(self, first: bool) -> int:
        """Bytes at which the open bucket becomes a batch (0: never during the pass)."""
        return min(self.first_bytes, self.bucket_bytes) if first else self.bucket_bytes


#: Everything at the end of the pass: the non-overlapped path.
AT_END = BucketPolicy(0)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def split_groups(items: Sequence[T], parts: int) -> list[list[T]]:
    """``items`` in ``parts`` consecutive runs whose lengths differ by at most one, the first runs
    taking the remainder (Horovod's ``split_list`` for an int ``groups``); no empty runs."""
    parts = max(1, min(parts, len(items)))
    q, rem = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < rem else 0)
        out.append(list(items[start:end]))
        start = end
    return [run for run in out if run]


class Batch(NamedTuple, Generic[K]):
    """Gradients to submit now; ``grouped``: an explicit group, to submit as one operation."""

    keys: tuple[K, ...]
    grouped: bool


class GradientBatcher(Generic[K]):
    """The batching state of one optimizer (or one tape call).

    ``order`` lists every key in an order all ranks share; ``groups`` is Horovod's argument (None,
    a positive int, or lists of keys: keys not in ``order`` are ignored, a key named twice belongs
    to its first group).
    """

    def __init__(self, order: Sequence[K], groups: int | Iterable[Iterable[K]] | None = None,
                 policy: BucketPolicy = BucketPolicy()) -> None:
        #: Read at each gradient: an adapter may change it between passes (the autotuner).
        self.policy = policy
        self.groups: list[tuple[K, ...]] = []
        if isinstance(groups, int):
            self.groups = [tuple(run) for run in split_groups(order, groups)]
        elif groups is not None:
            known, taken = set(order), set()
            for group in groups:
                members = tuple(k for k in group if k in known and k not in taken)
                taken.update(members)
                if members:
                    self.groups.append(members)
        self._group_of = {k: g for g in self.groups for k in g}
        self._ready: dict[tuple[K, ...], int] = dict.fromkeys(self.groups, 0)
        self._bucket: list[K] = []
        self._bucket_nbytes = 0
        self._first = True  # the open bucket is the pass's first

    def ready(self, key: K, nbytes: int | None) -> list[Batch[K]]:
        """``key``'s gradient (``nbytes`` long; None: unknown or sparse) is ready."""
        group = self._group_of.get(key)
        if group is not None:
            self._ready[group] += 1
            if self._ready[group] < len(group):
                return []
            self._ready[group] = 0
            return [Batch(group, True)]
        cap = self.policy.cap(self._first)
        if nbytes is None and cap:
            return [Batch((key,), False)]
        self._bucket.append(key)
        self._bucket_nbytes += nbytes or 0
        if not cap or self._bucket_nbytes < cap:
            return []
        self._first = False
        return self._take()

    def all_ready(self, keys: Iterable[K]) -> list[Batch[K]]:
        """Every gradient of ``keys`` is ready at once (a tape): the explicit groups, then all the
        others as one batch. The size rule exists to overlap a large gradient's exchange with the
        rest of backward; with nothing left to overlap, one operation costs least (measured: a
        TF tape of a 4.2 M-parameter MLP at 2 ranks, 6-16% slower per step in four batches)."""
        rest = tuple(k for k in keys if k not in self._group_of)
        return [Batch(g, True) for g in self.groups] + ([Batch(rest, False)] if rest else [])

    @property
    def holding(self) -> bool:
        """Whether the bucket holds gradients (a :meth:`flush` is due when the pass ends)."""
        return bool(self._bucket)

    def flush(self) -> list[Batch[K]]:
        """The pass has ended: the bucket, if it holds anything, as one batch; the next pass
        starts with a first bucket again."""
        self._first = True
        return self._take()

    def _take(self) -> list[Batch[K]]:
        if not self._bucket:
            return []
        keys, self._bucket, self._bucket_nbytes = tuple(self._bucket), [], 0
        return [Batch(keys, False)]

    def reset(self) -> None:
        """A new step: forget partly ready groups and the bucket (their gradients were sent by the
        caller some other way)."""
        self._ready = dict.fromkeys(self.groups, 0)
        self._bucket, self._bucket_nbytes, self._first = [], 0, True
