"""One rank of the soak test: ``soak_worker.py OUTDIR SECONDS MIN_STEPS``.

Every rank draws the same sequence of steps from a seeded RNG (the step's generator is seeded
with ``(SEED, step)``, a contribution's with ``(SEED, step, item, rank)``), so every rank knows
every rank's input and computes each expected result itself in numpy. A step is a batch of one
to four collectives submitted at once (fused where they can be) and then waited for: allreduce
with every op, allgather with ragged first dimensions, broadcast, alltoall with random splits,
reducescatter, reduce, gather and scatter, over every dtype ringflow moves, of 0, 1, odd and up to
1 MiB elements' worth of bytes.

Inputs are chosen so that the result does not depend on the order in which the algorithm combines
the contributions (integer values in floats, small enough that every partial sum is exact; powers
of two for products; any value for Min and Max; integers wrap the same way in any order), so the
expected value is exact whatever path (coordinator, shared memory, ring) a collective takes, and a
result is right only if every bit is. Integer Average is the wrapped sum scaled in float64 and
truncated toward zero (:class:`ringflow.algorithms.reduction.Reduction`).

Steps run in blocks of :data:`BLOCK`; after each, rank 0 broadcasts whether to go on (at least
``MIN_STEPS`` steps, and until ``SECONDS`` have passed when that is above 0). RSS, open file
descriptors and threads are sampled after the warm-up (:data:`WARM_UP` steps) and at the end;
``OUTDIR/<rank>.json`` gets the figures and every mismatch.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import ringflow as rf
from ringflow.ops import BFLOAT16

SEED = 18_2026
BLOCK = 50
WARM_UP = 300
MAX_BYTES = 1 << 20
DTYPES = [np.dtype(d) for d in (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.int32,
                                np.int64, np.float16, BFLOAT16, np.float32, np.float64)]
OPS = [rf.Sum, rf.Average, rf.Min, rf.Max, rf.Product]
KINDS = ["allreduce", "allreduce", "allreduce", "allgather", "broadcast", "alltoall",
         "reducescatter", "reduce", "gather", "scatter"]
# Integer magnitudes whose sums over 4 ranks (and quarters of them) are exact in the dtype.
EXACT_INT = {"float16": 8, "bfloat16": 8, "float32": 1 << 20, "float64": 1 << 40}
POWERS = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 0.0])


def resources() -> dict[str, int]:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kb": rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task"))}


def length(rng: np.random.Generator, itemsize: int) -> int:
    """Rows: 0, 1, a small odd number, or (one in ten) an odd number up to 1 MiB of bytes."""
    u = rng.random()
    if u < 0.08:
        return 0
    if u < 0.16:
        return 1
    if u < 0.9:
        return int(rng.integers(0, 1024)) * 2 + 1
    return int(rng.integers(0, MAX_BYTES // itemsize // 2)) * 2 + 1


def values(step: int, item: int, r: int, dtype: np.dtype, shape: tuple[int, ...],
           op: rf.ReduceOp | None) -> np.ndarray:
    """Rank ``r``'s input to item ``item`` of step ``step`` (any rank can compute it)."""
    rng = np.random.default_rng([SEED, step, item, r])
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if op in (rf.Min, rf.Max):
        return (rng.standard_normal(shape) * 100).astype(dtype)
    if op == rf.Product:
        return POWERS[rng.integers(0, len(POWERS), size=shape)].astype(dtype)
    bound = EXACT_INT[dtype.name]
    return rng.integers(-bound, bound, size=shape, endpoint=True).astype(np.float64).astype(dtype)


def reduced(parts: list[np.ndarray], op: rf.ReduceOp) -> np.ndarray:
    """The exact reduction of ``parts`` (every partial result is exact: see the module doc)."""
    dtype, n = parts[0].dtype, len(parts)
    if dtype == np.bool_:
        fn = np.logical_or if op in (rf.Sum, rf.Max) else np.logical_and
        return fn.reduce(np.stack(parts), axis=0) if parts[0].size else parts[0].copy()
    if dtype.kind in "iu":
        stack = np.stack(parts)
        if op in (rf.Sum, rf.Average):
            total = np.add.reduce(stack, axis=0, dtype=dtype)
            if op == rf.Sum:
                return total
            return np.trunc(total.astype(np.float64) * (1.0 / n)).astype(dtype)
        fn = {rf.Min: np.minimum, rf.Max: np.maximum, rf.Product: np.multiply}[op]
        return fn.reduce(stack, axis=0, dtype=dtype)
    stack = np.stack([p.astype(np.float64) for p in parts])
    if op in (rf.Sum, rf.Average):
        out = stack.sum(axis=0) * (1.0 / n if op == rf.Average else 1.0)
    else:
        fn = {rf.Min: np.minimum, rf.Max: np.maximum, rf.Product: np.multiply}[op]
        out = fn.reduce(stack, axis=0)
    return out.astype(dtype)


def share(rows: int, n: int, r: int) -> slice:
    """Rank ``r``'s rows of a reducescatter: lower ranks take the remainder."""
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    return slice(start, start + base + (1 if r < extra else 0))


class Item:
    """One collective of a step: what this rank submits and what it must get back."""

    def __init__(self, step: int, item: int, rng: np.random.Generator, r: int, n: int) -> None:
        self.kind = KINDS[int(rng.integers(0, len(KINDS)))]
        dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
        op = OPS[int(rng.integers(0, len(OPS)))]
        if dtype == np.bool_ and op == rf.Average:
            op = rf.Sum  # bool cannot be averaged (a documented TensorError)
        self.op = op if self.kind in ("allreduce", "reducescatter", "reduce") else None
        cols = 1 if rng.random() < 0.7 else int(rng.integers(1, 5))
        trail = () if cols == 1 and rng.random() < 0.5 else (cols,)
        self.root = int(rng.integers(0, n))
        self.name = f"{self.kind}.{dtype.name}.{item}"
        itemsize = dtype.itemsize * cols

        def make(rank: int, rows: int, salt: int = 0) -> np.ndarray:
            return values(step, item * 16 + salt, rank, dtype, (rows, *trail), self.op)

        if self.kind in ("allreduce", "reducescatter", "reduce", "broadcast"):
            rows = length(rng, itemsize)
            parts = [make(q, rows) for q in range(n)]
            self.input: Any = parts[r]
            if self.kind == "broadcast":
                self.want: Any = parts[self.root]
            else:
                total = reduced(parts, self.op)
                if self.kind == "reducescatter":
                    total = total[share(rows, n, r)]
                self.want = total if self.kind != "reduce" or r == self.root else None
        elif self.kind in ("allgather", "gather"):
            lens = [length(rng, itemsize * n) for _ in range(n)]
            parts = [make(q, lens[q]) for q in range(n)]
            self.input = parts[r]
            self.want = (np.concatenate(parts) if self.kind == "allgather" or r == self.root
                         else None)
        elif self.kind == "alltoall":
            splits = [[length(rng, itemsize * n * n) for _ in range(n)] for _ in range(n)]
            blocks = [[make(src, splits[src][dst], dst) for dst in range(n)] for src in range(n)]
            self.input = np.concatenate(blocks[r])
            self.splits = splits[r]
            self.want = (np.concatenate([blocks[src][r] for src in range(n)]),
                         np.array([splits[src][r] for src in range(n)]))
        else:  # scatter
            pieces = [make(self.root, length(rng, itemsize * n), q) for q in range(n)]
            self.input = pieces if r == self.root else None
            self.want = pieces[r]

    def submit(self) -> rf.Handle:
        k = self.kind
        if k == "allreduce":
            return rf.allreduce_async(self.input, name=self.name, op=self.op)
        if k == "reducescatter":
            return rf.reducescatter_async(self.input, name=self.name, op=self.op)
        if k == "reduce":
            return rf.reduce_async(self.input, self.root, op=self.op, name=self.name)
        if k == "broadcast":
            return rf.broadcast_async(self.input, self.root, name=self.name)
        if k == "allgather":
            return rf.allgather_async(self.input, name=self.name)
        if k == "gather":
            return rf.gather_async(self.input, self.root, name=self.name)
        if k == "alltoall":
            return rf.alltoall_async(self.input, self.splits, name=self.name)
        return rf.scatter_async(self.input, self.root, name=self.name)

    def check(self, got: Any) -> str:
        """Empty if ``got`` is bit-for-bit what was expected, else what differs."""
        want = self.want
        if self.kind == "alltoall":
            rows, splits = got
            if not np.array_equal(np.asarray(splits), want[1]):
                return f"received splits {list(splits)}, expected {list(want[1])}"
            got, want = rows, want[0]
        if want is None or got is None:
            return "" if want is None and got is None else f"got {got!r}, expected {want!r}"
        got = np.asarray(got)
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"got {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
        if got.tobytes() != want.tobytes():
            bad = np.flatnonzero(got.view(np.uint8).reshape(-1)
                                 != want.view(np.uint8).reshape(-1))
            return f"{bad.size} bytes differ, the first at byte {bad[0]}"
        return ""


def main() -> None:
    outdir, seconds, min_steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    stacks = open(Path(outdir) / f"stacks-{os.getpid()}", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks)
    rf.init()
    r, n = rf.rank(), rf.size()
    out: dict[str, Any] = {"rank": r, "pid": os.getpid(), "mismatches": [], "kinds": {},
                           "bytes": 0}
    digest = hashlib.sha256()
    start = time.monotonic()
    step = 0
    go = True
    while go:
        for _ in range(BLOCK):
            rng = np.random.default_rng([SEED, step])
            items = [Item(step, i, rng, r, n) for i in range(int(rng.integers(1, 5)))]
            handles = [item.submit() for item in items]
            for item, handle in zip(items, handles, strict=True):
                got = handle.wait(120)
                why = item.check(got)
                if why:
                    out["mismatches"].append(f"step {step} {item.name} root {item.root} "
                                             f"op {item.op}: {why}")
                out["kinds"][item.kind] = out["kinds"].get(item.kind, 0) + 1
                if item.kind in ("allreduce", "allgather", "broadcast"):
                    digest.update(np.ascontiguousarray(got).tobytes())
                    out["bytes"] += np.asarray(got).nbytes
            step += 1
            if step == WARM_UP:
                out["warm"] = resources()
                out["warm_at"] = time.monotonic() - start
        more = step < min_steps or (seconds > 0 and time.monotonic() - start < seconds)
        go = bool(rf.broadcast(np.array([more]), 0, name="soak.go")[0])
    out["end"] = resources()
    out["steps"] = step
    out["seconds"] = time.monotonic() - start
    digests = rf.allgather(np.frombuffer(digest.digest(), np.uint8)[None, :], name="soak.digest")
    out["same_bits_everywhere"] = bool((digests == digests[0]).all())
    path = Path(outdir) / f"{r}.json"
    path.with_suffix(".tmp").write_text(json.dumps(out))
    path.with_suffix(".tmp").replace(path)
    rf.shutdown()


if __name__ == "__main__":
    main()
