"""Negotiation: which named tensors are ready on every rank, in which order, fused how.

Protocol (rank 0 of the job is the coordinator for every process set)::

    worker -> coordinator : Submit(requests, bits)   new requests in full; cached ones as bit ids
    coordinator -> all    : Plan(items)              items in execution order, the same for all

* A *request* names a tensor and everything the ranks must agree on (op, dtype, shape, reduce op,
  root, scale factors, compression, device, group). A rank whose tensor failed local validation
  still submits it, with ``error`` set, so that every rank learns of the failure.
* A name is *ready* when every member of its process set has submitted it; ranks that called
  ``join()`` count as submitted (they contribute zeros to allreduce; other kinds fail).
  A grouped name waits until every name of its group is ready.
* When a name is ready its requests are validated against each other; any disagreement becomes an
  error response naming the tensor, the field and each rank's value, delivered to every rank.
* Ready allreduces with the same process set, wire dtype, reduce op, scale factors and device are
  fused into one item up to ``fusion_threshold_bytes``; allgathers of one dtype likewise.

Response cache (fast path): every rank processes the same plans in the same order, and
:meth:`ResponseCache.record` assigns a bit to each newly negotiated name in plan order, so bits are
identical on every rank without any message about them. A rank whose request for a cached name is
unchanged sends only the bit; a plan item of cached allreduces is only their bits. Bits are never
reassigned (a full cache just stops caching new names), so a bit in flight always means the name
it meant when it was sent.

Small tensors (eager path): with the bit of an allreduce of at most ``EAGER_BYTES`` a rank also
sends the tensor (prescaled, in its wire dtype). When a cached allreduce is ready and every member
sent its data, the coordinator reduces it on the spot, in rank order
(:func:`~ringflow.algorithms.local.reduce_parts`, the same arithmetic as the shared-memory path),
fused with other such tensors up to ``EAGER_BYTES``, and the plan item carries the result: the
whole allreduce costs one round trip to rank 0 instead of a round trip plus a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .algorithms.local import reduce_parts
from .collectives import COLLECTIVES, EAGER_BYTES, Kind, collective
from .ops import ReduceOp
from .requests import CachedAllreduce, Key, Request, Response, wire_dtype

__all__ = ["CachedAllreduce", "Coordinator", "Request", "Response", "ResponseCache"]

log = logging.getLogger(__name__)

#: Names that begin with this are used once (a library numbers them, e.g. torch.distributed's
#: collectives on backend "ringflow"): the response cache never takes them, since its bits are
#: never reassigned and such a name would hold one for good.
ONCE = "once:"



class ResponseCache:
    """Bits for negotiated names, assigned identically on every rank (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bit_of: dict[Key, int] = {}
        self.key_of: list[Key] = []
        self.ref: list[Request] = []  # the reference request of each bit
        self.mine: dict[Key, Request] = {}  # what this rank last submitted for a cached name

    def lookup(self, request: Request) -> int | None:
        """The bit to send instead of ``request``, if this rank's last request was the same."""
        key = request.key
        bit = self.bit_of.get(key)
        if bit is not None:
            mine = self.mine.get(key)
            # The request memo hands back the same object for an unchanged request: no need
            # to compare its fields.
            if mine is request or mine == request:
                return bit
        return None

    def record(self, item: Response, mine: Callable[[Key], Request | None]) -> None:
        """Note a successful full response of the plan; every rank calls this in plan order."""
        if item.error or not collective(item.kind).cacheable:
            return
        for ref in item.requests:
            key = ref.key
            bit = self.bit_of.get(key)
            if bit is None:
                if len(self.key_of) >= self.capacity or key[1].startswith(ONCE):
                    continue
                bit = len(self.key_of)
                self.bit_of[key] = bit
                self.key_of.append(key)
                self.ref.append(ref)
            else:
                self.ref[bit] = ref
            own = mine(key)
            if own is None:
                self.mine.pop(key, None)
            else:
                self.mine[key] = own


class Coordinator:
    """Rank 0's negotiation state for all process sets. Pure logic: no I/O, no threads."""

    def __init__(
        self,
        size: int,
        members: Callable[[int], Sequence[int]],
        fusion_threshold_bytes: int,
        cache: ResponseCache,
    ) -> None:
        self.size = size
        self.members = members
        self.fusion_threshold = fusion_threshold_bytes
        #: What plan items carry (:class:`Response`'s ``wire`` and ``chunk``): set by the engine
        #: from ``RINGFLOW_WIRE_COMPRESSION`` / ``_CHUNK_BYTES`` or the autotuner.
        self.wire = ""
        self.chunk = 0
        self.cache = cache
        self.table: dict[Key, dict[int, Request]] = {}
        self.via_bits: dict[Key, set[int]] = {}
        self.first_seen: dict[Key, float] = {}
        self.warned: set[Key] = set()
        self.known: dict[Key, dict[int, Request]] = {}  # per-rank requests of cached names
        self.payload: dict[Key, dict[int, np.ndarray]] = {}  # eager data sent with bits
        self.joined: list[int] = []
        self.gone: dict[int, str] = {}
        # plan() looks only at the names submitted to since its last call (a step of 10,000
        # names used to cost 10,000 scans of the whole table), and at every name again when
        # something else may have made names ready: joins, departures, process-set changes.
        self._touched: dict[Key, None] = {}
        self._ready_keys: set[Key] = set()
        self._order: dict[Key, int] = {}  # the table's order: when each name was first submitted
        self._next = 0
        self._seen_state: tuple = ()
        self.next_set_id = 1
        self.holding = False  # see plan()
        self.last_change = time.monotonic()  # last submission or plan (see stalled())
        self._ready_since: float | None = None
        self.stats = {"negotiated": 0, "cache_hits": 0, "plans": 0, "fused_items": 0}

    # input -------------------------------------------------------------------------------------
    def submit(self, rank: int, requests: Sequence[Request], bits: Sequence[int],
               data: Sequence[np.ndarray | None] = ()) -> None:
        """``data[i]``, if given and not None, is the tensor of ``bits[i]`` (eager path)."""
        for i, bit in enumerate(bits):
            key = self.cache.key_of[bit]
            self._add(rank, self.known[key][rank], via_bit=True)
            if i < len(data) and data[i] is not None:
                self.payload.setdefault(key, {})[rank] = data[i]
        for req in requests:
            if req.kind == "join":
                if rank not in self.joined:
                    self.joined.append(rank)
                continue
            self._add(rank, req, via_bit=False)

    def _add(self, rank: int, req: Request, via_bit: bool) -> None:
        self.last_change = time.monotonic()
        key = req.key
        slot = self.table.get(key)
        if slot is None:
            slot = self.table[key] = {}
            self._order[key] = self._next
            self._next += 1
        self._touched[key] = None
        if rank in slot and not req.error:
            req = dataclasses.replace(
                req, error=f"rank {rank} submitted {req.name!r} again while it was in flight"
            )
        slot[rank] = req
        self.first_seen.setdefault(key, time.monotonic())
        bits = self.via_bits.setdefault(key, set())
        if via_bit:
            bits.add(rank)
        else:
            bits.discard(rank)

    def rank_gone(self, rank: int, reason: str) -> None:
        self.gone[rank] = reason

    def rescan(self) -> None:
        """Process sets changed: every pending name may be ready now (see plan())."""
        self._seen_state = ()

    def _ready_names(self) -> list[tuple[Key, dict[int, Request]]]:
        """The ready names, in table order, with a scan of only what may have changed."""
        state = (tuple(self.joined), tuple(self.gone))
        if state != self._seen_state:
            self._seen_state = state
            self._ready_keys.clear()
            candidates: Iterable[Key] = list(self.table)
        else:
            candidates = list(self._touched)
        self._touched.clear()
        for key in candidates:
            slot = self.table.get(key)
            if slot is not None and self._ready(key, slot):
                self._ready_keys.add(key)
        self._ready_keys &= self.table.keys()
        return [(key, self.table[key]) for key in sorted(self._ready_keys, key=self._order.get)]

    # output ------------------------------------------------------------------------------------
    def plan(self, hold: float = 0.0) -> list[Response | CachedAllreduce]:
        """Take every ready name out of the table and return the plan items, fused.

        Fusion window: while other names are still waiting for some rank, ready names are held
        back until ``hold`` seconds after the first of them was ready (or until they fill the
        fusion buffer), so that a burst of submissions becomes a few large collectives rather
        than one per name. A lone name is planned at once. While it holds, ``holding`` is True
        and the caller must call again within ``hold``.
        """
        ready: list[tuple[Key, dict[int, Request]]] = []
        groups: dict[tuple[int, str], list[Key]] = {}
        candidates = self._ready_names()
        waiting = len(candidates) < len(self.table)
        for key, slot in candidates:
            group = next(iter(slot.values())).group
            if group:
                groups.setdefault((key[0], group), []).append(key)
            else:
                ready.append((key, slot))
        broken: list[Response] = []
        for (ps, group), keys in groups.items():
            members = [k for k in self.table if k[0] == ps and self._group_of(k) == group]
            sizes: dict[int, int] = {}
            for k in members:
                for rank, req in self.table[k].items():
                    if req.group == group:  # a rank that did not group it: validate() says so
                        sizes.setdefault(rank, req.group_size)
            if len(set(sizes.values())) > 1:
                # Ranks grouped different tensors: the whole group fails at once on every rank
                # (waiting for it to be complete would wait forever for names some never send).
                broken.extend(self._fail_group(members, sizes))
                continue
            size = next(iter(self.table[keys[0]].values())).group_size
            if len(keys) >= size:
                ready.extend((k, self.table[k]) for k in keys)
            else:
                waiting = True
        self.holding = False
        if broken:
            self.stats["plans"] += 1
            self.last_change = time.monotonic()
            return broken + self.plan(hold)
        if not ready and not self._all_joined():
            return []
        if ready and hold > 0 and waiting:
            now = time.monotonic()
            if self._ready_since is None:
                self._ready_since = now
            nbytes = sum(next(iter(slot.values())).nbytes for _, slot in ready)
            if now - self._ready_since < hold and nbytes < self.fusion_threshold:
                self.holding = True
                return []
        self._ready_since = None
        items: list[Response | CachedAllreduce] = []
        fusable: dict[tuple, list[tuple[Response, dict[int, np.ndarray] | None]]] = {}
        for key, slot in ready:
            del self.table[key]
            self._order.pop(key, None)
            self._ready_keys.discard(key)
            self.first_seen.pop(key, None)
            self.warned.discard(key)
            payload = self.payload.pop(key, None)
            cached = self.via_bits.pop(key, set()) >= set(slot) and bool(slot)
            item = self._respond(key, slot, cached)
            if item.error or not collective(item.kind).fusable:
                items.append(dataclasses.replace(item, chunk=self.chunk)
                             if self.chunk and not item.error else item)
                continue
            ref = item.requests[0]
            cached_allreduce = cached and item.kind == "allreduce"
            eager = (cached_allreduce and not item.joined and payload is not None
                     and len(payload) == len(slot) and ref.reduce_op != ReduceOp.ADASUM)
            wire = self._wire_for(item, eager)
            fkey = (item.kind, key[0], wire_dtype(wire, ref.dtype) if wire else ref.wire_dtype,
                    ref.reduce_op, ref.prescale, ref.postscale, ref.device, item.joined,
                    cached_allreduce, eager, wire)
            fusable.setdefault(fkey, []).append((item, payload if eager else None))
        for fkey, members in fusable.items():
            items.extend(self._fuse(fkey[0], fkey[-3], members, fkey[-1]))
        if self._all_joined():
            items.append(Response("join", 0, (), value=self.joined[-1]))
            self.joined = []
        if items:
            self.stats["plans"] += 1
            self.last_change = time.monotonic()
        return items

    def _wire_for(self, item: Response, eager: bool) -> str:
        """The wire compression the coordinator gives ``item`` ("" for its requests' own)."""
        ref = item.requests[0]
        if (not self.wire or eager or item.kind != Kind.ALLREDUCE or ref.compression != "none"
                or ref.dtype != "float32" or ref.device != "cpu" or ref.nbytes <= EAGER_BYTES
                or ref.reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE)):
            return ""
        return self.wire

    def _group_of(self, key: Key) -> str:
        return next(iter(self.table[key].values())).group

    def _fail_group(self, keys: list[Key], sizes: dict[int, int]) -> list[Response]:
        """Error items for every pending name of a group whose size the ranks disagree on."""
        by_size: dict[int, list[int]] = {}
        for rank in sorted(sizes):
            by_size.setdefault(sizes[rank], []).append(rank)
        parts = "; ".join(f"{v!r} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                          for v, rs in by_size.items())
        items = []
        for key in keys:
            slot = self.table.pop(key)
            self._order.pop(key, None)
            self._ready_keys.discard(key)
            self.first_seen.pop(key, None)
            self.warned.discard(key)
            self.via_bits.pop(key, None)
            self.payload.pop(key, None)
            text = f"ranks disagree on group_size of tensor {key[1]!r}: {parts}"
            items.append(_error(slot[min(slot)], text, "MismatchError"))
        return items

    def _ready(self, key: Key, slot: dict[int, Request]) -> bool:
        members = self.members(key[0])
        # Joined and departed ranks count as present: the response then says what they lack.
        return not members or set(slot) | set(self.joined) | set(self.gone) >= set(members)

    def _all_joined(self) -> bool:
        return bool(self.joined) and len(set(self.joined)) == self.size

    def _respond(self, key: Key, slot: dict[int, Request], cached: bool) -> Response:
        members = self.members(key[0])
        first = slot[min(slot)]
        if not members:
            return _error(first, f"process set {key[0]} was removed while {first.name!r} was "
                          "pending on it", "TensorError")
        missing_gone = sorted(set(members) - set(slot) & set(self.gone))
        if missing_gone:
            r = missing_gone[0]
            return _error(
                first,
                f"rank {r} left the job ({self.gone[r]}) before submitting {first.name!r}",
                "ShutdownError",
            )
        if cached:
            self.stats["cache_hits"] += 1
        else:
            self.stats["negotiated"] += 1
            problem = validate(first.name, slot)
            if problem:
                return _error(first, problem[1], problem[0])
        joined = tuple(r for r in members if r not in slot)
        entry = collective(first.kind)
        if joined and not entry.joinable:
            joinable = sorted(k for k, c in COLLECTIVES.items() if c.joinable)
            return _error(
                first,
                f"{first.kind.capitalize()} is not supported with Join at this time (Horovod's "
                f"text): ranks {list(joined)} have joined, so they cannot take part in "
                f"{first.kind} {first.name!r}; only {', '.join(joinable)} proceed past join()",
                "TensorError",
            )
        if entry.cacheable and not key[1].startswith(ONCE) and (
                key in self.cache.bit_of or len(self.cache.key_of) < self.cache.capacity):
            # Only a name that has (or may get) a cache bit is ever submitted as one. Keeping
            # every name would grow without bound where names never repeat (unnamed tensors,
            # torch.distributed's numbered collectives).
            # Merged, not replaced: a rank that joined submitted nothing, and it keeps the bit
            # of its last request (a plan of cache bits changes no rank's memory of what it
            # sent), which it may send again once it is back.
            self.known.setdefault(key, {}).update(slot)
        if entry.rooted:
            first = slot[first.root]  # validated: a member, and every member names it
        if entry.shape == "rows":
            dims = tuple(slot[r].shape[0] if r in slot else 0 for r in members)
            return Response(first.kind, key[0], (first,), first_dims=(dims,), joined=joined)
        if first.kind == "add_process_set":
            self.next_set_id += 1
            return Response(first.kind, key[0], (first,), value=self.next_set_id - 1)
        return Response(first.kind, key[0], (first,), joined=joined)

    def _fuse(
        self, kind: str, cached: bool,
        items: list[tuple[Response, dict[int, np.ndarray] | None]], wire: str = "",
    ) -> list[Response | CachedAllreduce]:
        out: list[Response | CachedAllreduce] = []
        batch: list[Response] = []
        data: list[dict[int, np.ndarray]] = []
        eager = items[0][1] is not None  # the same for every item: it is part of the fusion key
        limit = min(self.fusion_threshold, EAGER_BYTES) if eager else self.fusion_threshold
        total = 0

        def flush() -> None:
            if not batch:
                return
            if len(batch) > 1:
                self.stats["fused_items"] += 1
            if cached:
                bits = tuple(self.cache.bit_of[b.requests[0].key] for b in batch)
                out.append(CachedAllreduce(bits, _reduce(batch[0].requests[0], data)
                                           if eager else None, wire, self.chunk))
            else:
                out.append(dataclasses.replace(
                    batch[0],
                    requests=tuple(b.requests[0] for b in batch),
                    first_dims=tuple(d for b in batch for d in b.first_dims),
                    wire=wire, chunk=self.chunk,
                ))
            batch.clear()
            data.clear()

        for item, payload in items:
            nbytes = item.requests[0].nbytes
            if kind == "allgather":
                nbytes = nbytes // max(item.requests[0].shape[0], 1) * sum(item.first_dims[0])
            if batch and (limit == 0 or total + nbytes > limit):
                flush()
                total = 0
            batch.append(item)
            if payload is not None:
                data.append(payload)
            total += nbytes
        flush()
        return out

    def _elsewhere(self, ranks: list[int]) -> list[str]:
        """What each of ``ranks`` (missing from some name) waits in instead, with its site."""
        parts = []
        for rank in ranks:
            mine = [(key[1], slot[rank]) for key, slot in self.table.items() if rank in slot]
            if mine:
                name, req = mine[0]
                more = f" (and {len(mine) - 1} more)" if len(mine) > 1 else ""
                at = f" submitted at {req.site}" if req.site else ""
                parts.append(f"rank {rank} waits in {name!r}{at}{more}")
            else:
                parts.append(f"rank {rank} has submitted nothing pending (busy before its call)")
        return parts

    def stalled(self, warn_after: float, fail_after: float,
                deadlock_after: float = 0.0) -> tuple[list[str], str]:
        """Warnings for names waiting past ``warn_after`` s; a fatal message past ``fail_after``,
        or past ``deadlock_after`` for a deadlock (0 disables either).

        A *deadlock* is a stall in which every rank that some name waits for has itself
        submitted a name that waits for others (ranks issued collectives in different orders,
        or one skipped a collective and went on to the next), and nothing was submitted or
        planned for ``deadlock_after`` s. With blocking calls nobody can go on, so it is failed
        long before ``fail_after``, which is sized for a rank that is merely busy elsewhere
        (evaluating, writing a checkpoint) while the others wait.
        """
        now = time.monotonic()
        warnings: list[str] = []
        waits: list[tuple[Key, list[int], list[int]]] = []
        # Names are in the order they were first seen: only the oldest can be past a limit,
        # unless the deadlock check needs them all. (Every name's report used to be written on
        # every call, costing the square of the pending names: a step of 10,000 names starved
        # rank 0 for a minute.)
        limits = [t for t in (warn_after, fail_after) if t]
        deadlock = bool(deadlock_after) and now - self.last_change > deadlock_after
        more = 0
        for key, since in self.first_seen.items():
            waited = now - since
            if not deadlock and (not limits or waited <= min(limits)):
                break
            slot = self.table[key]
            missing = sorted(set(self.members(key[0])) - set(slot) - set(self.joined)
                             - set(self.gone))
            waits.append((key, sorted(slot), missing))
            past_fail = fail_after and waited > fail_after
            past_warn = warn_after and waited > warn_after and key not in self.warned
            if past_warn and not past_fail and len(warnings) >= _WARNINGS:
                self.warned.add(key)
                more += 1  # counted, not described: a report costs a scan of the table
                continue
            if not (past_fail or past_warn):
                continue
            text = (
                f"tensor {key[1]!r} has waited {waited:.0f} s: submitted by ranks "
                f"{sorted(slot)}, missing ranks {missing}"
                f"{_details([*_sites(slot), *self._elsewhere(missing)])}"
            )
            if past_fail:
                return warnings, (
                    f"stall: {text}; the missing ranks never submitted it (a rank skipped a "
                    f"collective or is stuck). RINGFLOW_STALL_SHUTDOWN_S sets this limit."
                )
            if past_warn:
                self.warned.add(key)
                warnings.append(text)
        if more:
            warnings.append(f"{more} more tensors have waited more than {warn_after:.0f} s")
        awaited = {r for _, _, missing in waits for r in missing}
        waiting = {r for _, slot, _ in waits for r in slot}
        if deadlock and awaited and awaited <= waiting:
            parts = "; ".join(f"{key[1]!r} submitted by ranks {slot}, missing ranks {missing}"
                              f"{_details(_sites(self.table[key]))}"
                              for key, slot, missing in waits if missing)
            return warnings, (
                f"deadlock: every rank that a collective waits for is itself waiting in another "
                f"one, and nothing changed for {now - self.last_change:.0f} s: {parts}. The "
                f"ranks called collectives in different orders, or one skipped a collective; "
                f"pass the same names in the same order on every rank. "
                f"RINGFLOW_DEADLOCK_SHUTDOWN_S sets this limit."
            )
        return warnings, ""


#: Stall warnings described in full per inspection; the others are counted in one more line.
_WARNINGS = 5


def _sites(slot: dict[int, Request]) -> list[str]:
    """Where the ranks of ``slot`` called: ``ranks 0, 2 called at f.py:3`` per site known."""
    by_site: dict[str, list[int]] = {}
    for rank in sorted(slot):
        if slot[rank].site:
            by_site.setdefault(slot[rank].site, []).append(rank)
    return [f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} called at {site}"
            for site, rs in by_site.items()]


def _details(parts: list[str]) -> str:
    return f" ({'; '.join(parts)})" if parts else ""


def validate(name: str, slot: dict[int, Request]) -> tuple[str, str] | None:
    """(error class name, message) if the ranks' requests for ``name`` disagree, else None."""
    for rank in sorted(slot):
        if slot[rank].error:
            return "TensorError", f"rank {rank}: {slot[rank].error}"
    entry = collective(slot[min(slot)].kind)
    fields: list[tuple[str, Callable[[Request], object]]] = [
        ("collective" if f == "kind" else f, lambda r, f=f: getattr(r, f))
        for f in entry.compared
    ]
    if entry.shape == "rows":
        fields.append(("shape[1:]", lambda r: r.shape[1:]))
    elif entry.shape == "full":
        fields.append(("shape", lambda r: r.shape))
    for field, get in fields:
        values: dict[object, list[int]] = {}
        for rank in sorted(slot):
            values.setdefault(get(slot[rank]), []).append(rank)
        if len(values) > 1:
            parts = "; ".join(f"{v!r} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                              for v, rs in values.items())
            hint = ""
            if ".noname." in name:
                hint = (" (unnamed tensors are matched by call order; pass name= so that ranks "
                        "issuing collectives in different orders pair them correctly)")
            return "MismatchError", f"ranks disagree on {field} of tensor {name!r}: {parts}{hint}"
    return None


def _reduce(ref: Request, data: list[dict[int, np.ndarray]]) -> np.ndarray:
    """The eager result: each tensor's contributions reduced in rank order, fused, scaled once."""
    ranks = sorted(data[0])
    parts = [data[0][r] if len(data) == 1 else np.concatenate([d[r] for d in data])
             for r in ranks]
    result = np.empty(parts[0].size, ref.wire_dtype)
    reduce_parts(parts, 0, result.size, result, ReduceOp(ref.reduce_op), ref.postscale)
    return result


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _error(req: Request, message: str, error_type: str) -> Response:
    return Response(req.kind, req.process_set, (req,), error=message, error_type=error_type)
