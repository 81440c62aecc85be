"""The table of collectives: what each kind of operation is, in one place.

Every request names a *kind*; :data:`COLLECTIVES` says for each:

- ``compared``: the request fields every member must submit alike (a difference is a
  MismatchError naming the field and each rank's value, :func:`ringflow.negotiation.validate`);
- ``shape``: how shapes must agree: ``"full"``, ``"rows"`` (all but the first dimension:
  concatenations and splits along it), or ``"any"`` (not compared);
- ``cacheable``: a negotiated request may be replaced by its response-cache bit next time;
- ``joinable``: it proceeds while some members have joined (they take part with zeros); the
  others fail on every member then, as in Horovod 0.28 (allgather and broadcast included);
- ``fusable``: ready requests of this kind (same set, dtype, op, scales, device) become one item;
- ``data``: it moves data on the data plane (the executor must run it: checked at import of
  :mod:`ringflow.executor`); otherwise the plan item alone completes it;
- ``rooted``: ``root`` names a global rank that must be a member of the process set; the root's
  request is the reference the plan carries (for ``scatter`` only the root knows the shapes);
- ``check``: local checks on this rank's tensor before submission (a failure travels with the
  request, so every member fails the operation with the same text).

:func:`collective` looks a kind up; an unknown kind fails at submission.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import TensorError
from .ops import ReduceOp

__all__ = ["COLLECTIVES", "EAGER_BYTES", "Collective", "Kind", "collective", "local_error"]


class Kind(str, enum.Enum):
    """The kinds of operation, a request's ``kind``. Each equals, hashes and formats as its
    name as a string (what travels in requests, and what the table and messages always used),
    so that code names a kind by the enum and plain strings still find it."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    REDUCE = "reduce"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"
    REMOVE_PROCESS_SET = "remove_process_set"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

#: Largest allreduce (per tensor, and per fused plan item) that travels to the coordinator with
#: its cache bit and comes back reduced in the plan (ringflow.negotiation), and that the
#: same-host lane's slots hold (ringflow.lane, its segment in ringflow.algorithms.shm). See
#: benchmarks/engine_latency.py.
EAGER_BYTES = 64 * 1024

#: Fields compared across ranks for every kind (fields a kind does not use keep their defaults,
#: which are then equal anyway).
COMPARED = ("kind", "dtype", "reduce_op", "root", "prescale", "postscale", "compression",
            "device", "group", "group_size")

Check = Callable[[np.ndarray, str, Sequence[int], Mapping[str, Any]], str]


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    shape: str = "full"
    cacheable: bool = False
    joinable: bool = False
    fusable: bool = False
    data: bool = True
    rooted: bool = False
    checks: tuple[Check, ...] = ()
    compared: tuple[str, ...] = COMPARED


def _no_bool_scaling(arr: np.ndarray, name: str, members: Sequence[int],
                     f: Mapping[str, Any]) -> str:
    if arr.dtype == np.bool_ and (f["reduce_op"] == ReduceOp.AVERAGE or f["prescale"] != 1.0
                                  or f["postscale"] != 1.0):
        return (f"tensor {name!r} has dtype bool, which cannot be averaged or scaled; use Sum "
                "(logical or), Min, Max or Product (logical and), or cast to a numeric dtype")
    return ""


def _adasum_float(arr: np.ndarray, name: str, members: Sequence[int],
                  f: Mapping[str, Any]) -> str:
    if f["reduce_op"] == ReduceOp.ADASUM and arr.dtype.kind != "f":
        return (f"allreduce of {name!r} with op Adasum needs a floating-point tensor, got "
                f"{arr.dtype}; use Sum or Average for integer and bool tensors")
    return ""


def _no_adasum(kind: str) -> Check:
    def check(arr: np.ndarray, name: str, members: Sequence[int], f: Mapping[str, Any]) -> str:
        if f["reduce_op"] == ReduceOp.ADASUM:
            return (f"{kind} of {name!r}: {kind.capitalize()} currently only supports AVERAGE "
                    "and SUM (Horovod's text); Adasum is an allreduce op")
        return ""
    return check


def _has_rows(kind: str) -> Check:
    def check(arr: np.ndarray, name: str, members: Sequence[int], f: Mapping[str, Any]) -> str:
        if arr.ndim == 0:
            return f"{kind} of {name!r} splits the first dimension and needs at least 1 dimension"
        return ""
    return check


def _splits(arr: np.ndarray, name: str, members: Sequence[int], f: Mapping[str, Any]) -> str:
    splits, n = f["splits"], len(members)
    if len(splits) != n or min(splits, default=0) < 0 or sum(splits) != arr.shape[0]:
        return (f"alltoall of {name!r}: splits {list(splits)} must be {n} non-negative row "
                f"counts (one per rank of the process set) adding up to the first dimension, "
                f"{arr.shape[0]}")
    return ""


COLLECTIVES: dict[str, Collective] = {c.kind: c for c in (
    Collective("allreduce", cacheable=True, joinable=True, fusable=True,
               checks=(_no_bool_scaling, _adasum_float)),
    Collective("allgather", shape="rows", cacheable=True, fusable=True),
    Collective("broadcast", cacheable=True, rooted=True),
    Collective("alltoall", shape="rows", checks=(_has_rows("alltoall"), _splits)),
    Collective("reducescatter", cacheable=True,
               checks=(_no_bool_scaling, _no_adasum("reducescatter"), _has_rows("reducescatter"))),
    Collective("reduce", cacheable=True, rooted=True,
               checks=(_no_bool_scaling, _no_adasum("reduce"))),
    Collective("gather", shape="rows", cacheable=True, rooted=True),
    # Only the root knows the dtype and the pieces' shapes (in its request: the concatenation
    # and ``splits``); the others learn them from the plan.
    Collective("scatter", shape="any", cacheable=True, rooted=True,
               compared=("kind", "root", "device", "group", "group_size")),
    Collective("barrier", shape="any", joinable=True, data=False),
    Collective("join", shape="any", data=False),
    Collective("add_process_set", shape="any", data=False),
    Collective("remove_process_set", shape="any", data=False),
)}


def collective(kind: str) -> Collective:
    """The table entry of ``kind``.

    Raises:
        TensorError: no such kind (a collective that is not in the table cannot be submitted).
    """
    try:
        return COLLECTIVES[kind]
    except KeyError:
        raise TensorError(f"unknown collective {kind!r}; known: {sorted(COLLECTIVES)}") from None


def local_error(kind: str, arr: np.ndarray, name: str, members: Sequence[int],
                job_size: int, fields: Mapping[str, Any]) -> str:
    """Why ``kind`` cannot run on ``arr`` with these arguments on this rank ("" if it can).

    Checked before submission, so that the failure reaches every rank as a failed request;
    found by the collective on the engine thread instead, it would end the whole job.
    """
    entry = collective(kind)
    if entry.rooted and fields["root"] not in members:
        if list(members) == list(range(job_size)):
            return (f"{kind} of {name!r}: root rank {fields['root']} is outside "
                    f"0..{job_size - 1} (the ranks of the job)")
        return (f"{kind} of {name!r}: root rank {fields['root']} is not a member of the process "
                f"set {list(members)}; root_rank is a global rank (as in Horovod and "
                "torch.distributed)")
    for check in entry.checks:
        error = check(arr, name, members, fields)
        if error:
            return error
    return ""
