"""Process sets: collectives among a subset of the ranks (Horovod's ``hvd.ProcessSet``)."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import TensorError
from .negotiation import Request
from .runtime import rank, running, size

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]


class ProcessSet:
    """A subset of ranks with its own collectives (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = 0 if ranks is None else None

    def _members(self) -> list[int]:
        return list(range(size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set, or -1 if it is not a member."""
        members = self._members()
        return members.index(rank()) if rank() in members else -1

    def included(self) -> bool:
        return rank() in self._members()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


def set_id(process_set: ProcessSet) -> int:
    """The id of an added process set.

    Raises:
        TensorError: it has not been added (or was removed).
    """
    if process_set.process_set_id is None:
        raise TensorError(f"{process_set} has not been added; call add_process_set() first")
    return process_set.process_set_id


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call this with the same ranks, in the same order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or ps.process_set_id is not None:
        raise TensorError(f"{ps} is already registered")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad or len(set(ps.ranks)) != len(ps.ranks) or not ps.ranks:
        raise TensorError(f"process set ranks {ps.ranks} must be distinct ranks of 0..{size() - 1}")
    ranks = tuple(ps.ranks)
    name = f"add_process_set.{','.join(map(str, ranks))}"
    ps.process_set_id = int(running().enqueue(Request(name, "add_process_set", shape=ranks)).wait())
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collectively); its pending operations fail."""
    if process_set.process_set_id in (None, 0):
        return False
    ps = set_id(process_set)
    running().enqueue(Request(f"remove_process_set.{ps}", "remove_process_set", root=ps)).wait()
    process_set.process_set_id = None
    return True
