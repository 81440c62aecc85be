"""From a call to a request: naming, local checks, and submission to the engine.

Every collective of the numpy API goes through :func:`submit` (or :func:`submit_group`): the
kind is looked up in :data:`ringflow.collectives.COLLECTIVES` (an unknown kind fails here), the
array is checked on this rank (a failure travels with the request, so every member fails the
operation with the same text), and the engine gets a :class:`~ringflow.negotiation.Request`.
Unnamed tensors get deterministic names from (kind, process set, call order), counted per
engine: a job's counters start at 0 on every rank, and the ranks of
:func:`ringflow.testing.run_engines` (threads of one process) each count their own.

A device array (a cupy array, a torch CUDA tensor, the stand-in's array: see
:mod:`ringflow.devices`) stays on its device: the request carries its device kind, its dtype and
shape are read through its namespace, and the namespace's ``ready`` orders its pending writes
before the engine's work. Anything else is read with ``np.asarray``.
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from . import devices
from . import ops as _ops
from .collectives import collective, local_error
from .errors import AdasumError, RingflowError, TensorError
from .handles import Handle
from .negotiation import Request
from .ops import ReduceOp
from .p2p import P2PHandle, describe_tag
from .process_sets import ProcessSet, set_id
from .runtime import rank, running, size

__all__ = ["GroupHandle", "call_site", "check_peer", "check_tag", "joined", "name_of",
           "scales", "start_recv", "start_send", "submit", "submit_group", "submit_many"]

# engine -> "kind/process set" -> call counter
_counters: weakref.WeakKeyDictionary[Any, dict[str, itertools.count]] = (
    weakref.WeakKeyDictionary())


def joined() -> None:
    """``join()`` returned: this rank's unnamed tensors are counted from 0 again.

    Every rank leaves ``join()`` at the same point of the job, but a rank that joined early
    skipped the unnamed calls the others made meanwhile: counted on, its next barrier or
    unnamed allreduce would pair with another call on the others (a deadlock, or a mismatch).
    Every operation submitted before the join has been planned once it returns, so the names
    are free again (and a loop that joins at the end of each epoch keeps its names cached).
    """
    _counters.pop(running(), None)


def name_of(kind: str, name: str | None, ps: int) -> str:
    """``name``, or the next deterministic name of an unnamed ``kind`` in process set ``ps``."""
    if name:
        return str(name)
    counters = _counters.setdefault(running(), {})
    counter = counters.setdefault(f"{kind}/{ps}", itertools.count())
    return f"{kind}.noname.{next(counter)}"


#: Top-level packages whose frames are not the user's call site: ringflow's own (adapters
#: included) and the frameworks that call ringflow from their hooks.
_INTERNAL = frozenset({"ringflow", "torch", "tensorflow", "keras", "tf_keras"})
_internal_code: dict[Any, bool] = {}  # code object -> in an _INTERNAL package (a cache)


def call_site(depth: int = 1) -> str:
    """``file:line`` of the innermost frame outside ringflow and the frameworks, or "".

    For stall reports. 1.7 to 2.2 us through 2 ringflow frames, 4 to 7 us through 4 (a
    2-core VM under load, Python 3.11; most of it making a frame object per level for
    ``f_back``: benchmarks/call_site_cost.py), so :func:`submit` takes it only for a name the
    response cache does not know, whose request travels in full; a cached name's report uses
    the site of its negotiation, and its submission pays one dictionary lookup.
    """
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        inside = _internal_code.get(code)
        if inside is None:
            module = frame.f_globals.get("__name__") or ""
            inside = _internal_code[code] = module.partition(".")[0] in _INTERNAL
        if not inside:
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _site_for(eng: Any, name: str, ps: int) -> str:
    """The call site, unless ``name`` is cached (its site is known from its negotiation)."""
    return "" if (ps, name) in eng.cache.bit_of else call_site(3)


def as_array(array: Any, what: str) -> tuple[np.ndarray | None, str]:
    """The array as a C-contiguous numpy array, or None and the reason it cannot be used."""
    try:
        arr = np.asarray(array)  # ascontiguousarray would turn a 0-d array into shape (1,)
        if not arr.flags.c_contiguous:
            arr = np.array(arr, order="C")
        _ops.check_dtype(arr.dtype, what)
    except (RingflowError, TypeError, ValueError) as exc:
        return None, str(exc)
    return arr, ""


def device_array(ns: devices.ArrayNamespace, array: Any, what: str
                 ) -> tuple[Any, str, str]:
    """A device array as the engine takes it (contiguous, on its device): (array or None,
    device kind, the reason it cannot be used)."""
    device = ns.device(array)
    try:
        ns.dtype(array)
    except RingflowError as exc:
        return None, devices.kind_of(device), f"{what}: {exc}"
    error = devices.claim(ns, array, device, what)
    if error:
        return None, devices.kind_of(device), error
    arr = array if ns.is_contiguous(array) else ns.contiguous(array)
    ns.ready(arr)
    return arr, devices.kind_of(device), ""


#: The most requests an engine's memo (``Engine.request_memo``) keeps; cleared when full (names
#: that never repeat).
_MEMO_SIZE = 4096


def request(eng: Any, kind: str, array: Any, name: str, process_set: ProcessSet, out: Any,
            fields: dict[str, Any]) -> tuple[Request, Any, Any]:
    """The request for ``array`` (carrying the reason if it cannot take part), input, output.

    ``fields`` may carry an ``error`` the caller found already (it wins). The request of a
    C-contiguous input (numpy, or a device array) with no output or a valid one (for a device
    array: itself) is memoised in ``eng.request_memo`` by (kind, name, process set, device,
    dtype, shape, fields): a training loop submits the same names with the same metadata every
    step, and the checks and the Request cost ~9 us a call on CPU, more for a CUDA tensor."""
    key = None
    memo = eng.request_memo
    if type(array) is np.ndarray:
        if array.flags.c_contiguous and (out is None or (
                type(out) is np.ndarray and out.flags.c_contiguous and out.shape == array.shape)):
            # What _request computes for this case does not depend on the (valid) output.
            key = (kind, name, process_set.process_set_id, array.dtype, array.shape,
                   *fields.items())
            req = memo.get(key)
            if req is not None:
                return req, array, out
    elif out is None or out is array:
        ns = devices.namespace_of(array)
        if ns is not None and ns.is_contiguous(array):
            device = ns.device(array)
            if device != "cpu":
                key = (kind, name, process_set.process_set_id, device, array.dtype,
                       tuple(array.shape), *fields.items())
                req = memo.get(key)
                if req is not None:  # the device was claimed when it was made
                    ns.ready(array)
                    return req, array, out
    req, arr, out = _request(kind, array, name, process_set, out, **fields)
    if key is not None:
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[key] = req
    return req, arr, out


def _request(kind: str, array: Any, name: str, process_set: ProcessSet, out: Any = None,
             **fields: Any) -> tuple[Request, Any, Any]:
    given = fields.pop("error", "")
    what = f"tensor {name!r}"
    ns = devices.namespace_of(array)
    if ns is not None and ns.device(array) != "cpu":
        arr, device, error = device_array(ns, array, what)
        meta: Any = None if arr is None else devices.Meta(ns.dtype(arr), tuple(arr.shape))
        if out is not None and not error and (
            devices.namespace_of(out) is not ns or ns.device(out) != ns.device(arr)
            or not ns.is_contiguous(out) or tuple(out.shape) != meta.shape
        ):
            error = (f"the output for {name!r} must be a contiguous array of shape {meta.shape} "
                     f"on {ns.device(arr)}, like the input")
    else:
        device = "cpu"
        arr, error = as_array(array, what)
        meta = arr
        if out is not None and not error and (
            not isinstance(out, np.ndarray) or not out.flags.c_contiguous
            or out.shape != arr.shape
        ):
            error = f"the output for {name!r} must be a C-contiguous array of shape {arr.shape}"
    if not error:
        error = local_error(kind, meta, name, process_set._members(), size(), fields)
    error = given or error
    req = Request(
        name=name, kind=kind, dtype="" if meta is None else _ops.dtype_name(meta.dtype),
        shape=() if meta is None else tuple(meta.shape), process_set=process_set.process_set_id,
        device=device, error=error, **fields,
    )
    return req, arr, out


def _member_set(kind: str, what: str, name: str | None, process_set: ProcessSet,
                fields: dict) -> int:
    collective(kind)  # an unknown kind fails here, at the call
    ps = set_id(process_set)
    if kind == "allreduce" and fields.get("reduce_op") == ReduceOp.ADASUM:
        n = process_set.size()
        if n & (n - 1):
            # Every member knows the size, so every member raises here alike and nobody waits.
            raise AdasumError(f"Running Adasum with non-power of 2 ranks is not supported yet "
                              f"({what} {name or '(unnamed)'} on {n} ranks)")
    if process_set.ranks is not None and not process_set.included():  # every rank is global
        # Only this rank knows: the members never submit this name, so it is refused here
        # rather than sent to the coordinator, where it would wait for them forever.
        raise TensorError(f"{what} {name or '(unnamed)'}: rank {rank()} is not a member of "
                          f"{process_set}; call it only where process_set.included() is true")
    return ps


def submit(kind: str, array: Any, name: str | None, process_set: ProcessSet, out: Any = None,
           **fields: Any) -> Handle:
    """Hand one tensor to the engine; its handle.

    Raises:
        TensorError: unknown kind, a process set this rank is not in, a name in flight.
        AdasumError: Adasum on a set whose size is not a power of two.
        NotInitializedError / HorovodInternalError: no job, or the job has failed.
    """
    return submit_fields(kind, array, name, process_set, out, fields)


def submit_fields(kind: str, array: Any, name: str | None, process_set: ProcessSet, out: Any,
                  fields: dict[str, Any]) -> Handle:
    """:func:`submit` with the fields in a dict of the caller's, which it takes over: the path
    of every small allreduce (passing ``**fields`` down costs ~1.3 us a call)."""
    eng = running()
    ps = _member_set(kind, kind, name, process_set, fields)
    name = name_of(kind, name, ps)
    fields["site"] = _site_for(eng, name, ps)
    return eng.enqueue(*request(eng, kind, array, name, process_set, out, fields))


def submit_many(kind: str, arrays: Sequence[Any], names: Sequence[str | None],
                process_set: ProcessSet, outs: Sequence[Any] | None,
                fields: dict[str, Any]) -> list[Handle]:
    """Hand several tensors to the engine at once, each its own operation (not a group: ranks
    need not submit the same ones together); their handles. One call, so the engine sends them
    to the coordinator in one submission (an optimizer's bucket: one message and one plan where
    the tensors one by one took several, each waking threads on both sides).

    Raises: as :func:`submit` (a name in flight: none of them is taken).
    """
    eng = running()
    ps = _member_set(kind, kind, names[0] if names else None, process_set, fields)
    items = []
    for i, (array, name) in enumerate(zip(arrays, names, strict=True)):
        name = name_of(kind, name, ps)
        own = {**fields, "site": _site_for(eng, name, ps)}
        items.append(request(eng, kind, array, name, process_set,
                             None if outs is None else outs[i], own))
    return eng.enqueue_many(items)


def submit_group(kind: str, arrays: Sequence[Any], name: str | None, process_set: ProcessSet,
                 outs: Sequence[Any] | None = None, **fields: Any) -> GroupHandle:
    """Submit ``arrays`` as one group: negotiated together, and refused together at the call."""
    eng = running()
    ps = _member_set(kind, f"grouped_{kind}", name, process_set, fields)
    base = name_of(f"grouped_{kind}", name, ps)
    site = _site_for(eng, f"{base}.0", ps)
    fields = {**fields, "group": base, "group_size": len(arrays), "site": site}
    items = [request(eng, kind, a, f"{base}.{i}", process_set,
                     None if outs is None else outs[i], fields)
             for i, a in enumerate(arrays)]
    return GroupHandle(base, eng.enqueue_many(items))


def scales(op: ReduceOp | int | None, prescale: float, postscale: float) -> dict[str, Any]:
    op = ReduceOp.AVERAGE if op is None else ReduceOp(op)
    return {"reduce_op": int(op), "prescale": float(prescale), "postscale": float(postscale)}


class GroupHandle(Handle):
    """A handle over several handles; its result is the list of their results."""

    def __init__(self, name: str, handles: list[Handle]) -> None:
        super().__init__(name)
        self.handles = handles

    def poll(self) -> bool:
        return all(h.poll() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            return [h.wait() for h in self.handles]
        deadline = time.monotonic() + timeout  # one deadline for the group, not one per tensor
        return [h.wait(max(0.0, deadline - time.monotonic())) for h in self.handles]

    result = wait

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(group_handle)`` once every tensor of the group is done."""
        left = [len(self.handles)]
        lock = threading.Lock()

        def one(_: Handle) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        if not self.handles:
            fn(self)
        for h in self.handles:
            h.add_done_callback(one)


# point to point: arguments checked on this rank, then the running engine's PointToPoint -------
def start_send(array: Any, dst: Any, tag: Any, tracked: bool = False) -> P2PHandle:
    """``isend`` of the numpy API and the adapters. An ``array`` that cannot be sent (its dtype,
    an adapter's :class:`~ringflow._adapter.Invalid`) fails the handle and the matching receive
    with the same text; ``tag`` may also be a gradient tag ``(tag, seq)`` (adapters).

    Raises:
        TensorError: ``dst`` is not another rank, or ``tag`` is not an int.
        NotInitializedError / HorovodInternalError: no job, or the job has failed.
    """
    eng = running()
    dst = check_peer(dst, eng.rank, eng.size, "dst")
    tag = _gradient_tag(tag) if isinstance(tag, tuple) else check_tag(tag)
    arr, error = as_array(array, f"the array sent to rank {dst} ({describe_tag(tag)})")
    return cast(P2PHandle, eng.p2p.isend(arr, dst, tag, tracked, error))


def start_recv(src: Any, tag: Any, out: Any = None, shape: Any = None,
               dtype: Any = None) -> P2PHandle:
    """``irecv`` of the numpy API and the adapters (see :meth:`PointToPoint.irecv`).

    Raises:
        TensorError: ``src`` is not another rank, ``tag`` is not an int, or ``out`` / ``shape``
            / ``dtype`` cannot describe an array ringflow moves (or disagree with each other).
        NotInitializedError / HorovodInternalError: no job, or the job has failed.
    """
    eng = running()
    src = check_peer(src, eng.rank, eng.size, "src")
    tag = _gradient_tag(tag) if isinstance(tag, tuple) else check_tag(tag)
    what = f"recv from rank {src} ({describe_tag(tag)})"
    want_shape = None
    if shape is not None:
        try:
            dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
            want_shape = tuple(operator.index(d) for d in dims)
        except TypeError:
            raise TensorError(f"{what}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in want_shape):
            raise TensorError(f"{what}: shape {want_shape} has a negative dimension")
    want_dtype = None
    if dtype is not None:
        try:
            want_dtype = _ops.check_dtype(np.dtype(dtype), what)
        except TypeError:
            raise TensorError(f"{what}: dtype {dtype!r} is not a numpy dtype") from None
    if out is not None:
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise TensorError(f"{what}: out must be a writable, C-contiguous numpy array, got "
                              f"{type(out).__name__}")
        _ops.check_dtype(out.dtype, f"{what}: out")
        if want_shape is not None and math.prod(want_shape) != out.size:
            raise TensorError(f"{what}: out has {out.size} elements but shape={want_shape} "
                              f"has {math.prod(want_shape)}; pass one or the other")
        if want_dtype is not None and want_dtype != out.dtype:
            raise TensorError(f"{what}: out has dtype {out.dtype} but dtype={want_dtype}; pass "
                              "one or the other")
    return cast(P2PHandle, eng.p2p.irecv(src, tag, out, want_shape, want_dtype))


def _gradient_tag(tag: tuple[Any, ...]) -> tuple[int, int]:
    try:
        forward, seq = tag
        return operator.index(forward), operator.index(seq)
    except (TypeError, ValueError):
        raise TensorError(f"a gradient tag is (tag, seq) of ints, got {tag!r}") from None


# argument checks (at the call, on this rank only) ------------------------------------------------
def check_peer(peer: Any, rank: int, size: int, what: str) -> int:
    """``peer`` as a rank other than ``rank`` of a job of ``size``.

    Raises:
        TensorError: it is not an int, outside ``0 .. size-1``, or this rank.
    """
    try:
        value = operator.index(peer)
    except TypeError:
        raise TensorError(f"{what} rank must be an int, got {type(peer).__name__}") from None
    if not 0 <= value < size or value == rank:
        raise TensorError(
            f"{what} rank {value} is not another rank of this job: expected 0 <= {what} < "
            f"{size} and {what} != {rank} (this rank)")
    return value


def check_tag(tag: Any) -> int:
    """``tag`` as an int.

    Raises:
        TensorError: it is not an int.
    """
    try:
        return operator.index(tag)
    except TypeError:
        raise TensorError(f"a point-to-point tag must be an int, got {type(tag).__name__}"
                          ) from None
