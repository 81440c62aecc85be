"""Engine scenarios, one per ``ringflow-run`` job: ``engine_worker.py SCENARIO OUTDIR``.

Every rank writes ``OUTDIR/<rank>.json`` with what it observed (results checked here in closed
form, error classes and texts, counters); the test compares the ranks' files. A rank whose check
fails exits non-zero with a message naming the rank and what differed.
"""

from __future__ import annotations

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
from ringflow.compression import Compression
from ringflow.errors import RingflowError
from ringflow.ops import BFLOAT16


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def failure(fn: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
    """Run ``fn``; return the class and text of the RingflowError it raises (it must raise)."""
    try:
        value = fn(*args, **kwargs)
    except RingflowError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}
    raise CheckFailed(f"{getattr(fn, '__name__', fn)} returned {value!r} instead of failing")


def wait_failure(handle: rf.Handle, timeout: float = 30.0) -> dict[str, Any]:
    start = time.monotonic()
    out = failure(handle.wait, timeout)
    out["elapsed"] = time.monotonic() - start
    return out


def async_failure(fn: Any, *args: Any, timeout: float = 30.0, **kwargs: Any) -> dict[str, Any]:
    """The failure of an ``*_async`` call: raised at the call when this rank already knows the
    job has failed (every later call raises the job's error), else by its handle."""
    start = time.monotonic()
    try:
        handle = fn(*args, **kwargs)
    except RingflowError as exc:
        return {"type": type(exc).__name__, "text": str(exc), "elapsed": 0.0, "at_call": True}
    out = failure(handle.wait, timeout)
    out["elapsed"] = time.monotonic() - start
    return out


def tri(n: int) -> int:
    return n * (n + 1) // 2


# scenarios ---------------------------------------------------------------------------------------
def random_order(r: int, n: int) -> dict[str, Any]:
    """200 named tensors, a different random order on each rank; then steady-state steps."""
    count = 200
    rng = np.random.default_rng(1000 + r)
    lengths = [(i * 7) % 23 for i in range(count)]  # includes 0, 1 and odd lengths
    dtypes = [np.float64, np.int32, np.float32, np.int64]
    steps = []
    for step in range(3):
        before = rf.stats()
        order = rng.permutation(count)
        handles = {}
        for i in order:
            dtype = dtypes[i % len(dtypes)]
            x = np.full(lengths[i], (r + 1) * (i + 1 + step), dtype)
            handles[int(i)] = rf.allreduce_async(x, name=f"grad.{i}", op=rf.Sum)
        for i, h in handles.items():
            got = h.wait(60)
            want = np.full(lengths[i], tri(n) * (i + 1 + step), dtypes[i % len(dtypes)])
            check(got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want),
                  f"step {step} grad.{i}: got {got[:3]} ({got.dtype}), expected {want[:3]}")
        after = rf.stats()
        steps.append({k: after[k] - before.get(k, 0) for k in after})
    return {"steps": steps, "stats": rf.stats()}


def fusion(r: int, n: int) -> dict[str, Any]:
    count = 64
    xs = [np.full(16, (r + 1) * (i + 1), np.float32) for i in range(count)]
    # Warm up (negotiate every name once), then measure a steady-state step.
    out: dict[str, Any] = {}
    for label in ("first", "steady"):
        before = rf.stats()
        hs = [rf.allreduce_async(x, name=f"small.{i}", op=rf.Sum) for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            check(np.array_equal(h.wait(60), np.full(16, tri(n) * (i + 1), np.float32)),
                  f"small.{i} wrong")
        after = rf.stats()
        out[label] = {k: after[k] - before.get(k, 0) for k in after}
    before = rf.stats()
    got = rf.grouped_allreduce(xs, name="group", op=rf.Sum)
    after = rf.stats()
    for i, g in enumerate(got):
        check(np.array_equal(g, np.full(16, tri(n) * (i + 1), np.float32)), f"group.{i} wrong")
    out["grouped"] = {k: after[k] - before.get(k, 0) for k in after}
    fired: list[bool] = []
    group = rf.grouped_allreduce_async(xs, name="group.cb", op=rf.Sum)
    group.add_done_callback(lambda h: fired.append(h.poll()))
    group.wait(60)
    end = time.monotonic() + 10
    while not fired and time.monotonic() < end:  # callbacks run on the engine thread
        time.sleep(0.001)
    out["group_callback"] = fired
    out["count"] = count
    return out


def _mismatch_cases(r: int, n: int) -> list[tuple[str, str, Any]]:
    last = r == n - 1
    x = np.arange(4, dtype=np.float32)
    return [
        ("collective", "m.op",
         lambda: (rf.allgather if last else rf.allreduce)(x, name="m.op")),
        ("reduce_op", "m.reduce_op",
         lambda: rf.allreduce(x, name="m.reduce_op", op=rf.Max if last else rf.Sum)),
        ("dtype", "m.dtype",
         lambda: rf.allreduce(x.astype(np.float64 if last else np.float32), name="m.dtype")),
        ("shape", "m.shape", lambda: rf.allreduce(np.zeros(5 if last else 4), name="m.shape")),
        ("shape[1:]", "m.gather",
         lambda: rf.allgather(np.zeros((2, 4 if last else 3)), name="m.gather")),
        ("root", "m.root", lambda: rf.broadcast(x, 1 if last else 0, name="m.root")),
        ("prescale", "m.prescale",
         lambda: rf.allreduce(x, name="m.prescale", prescale_factor=2.0 if last else 1.0)),
        ("postscale", "m.postscale",
         lambda: rf.allreduce(x, name="m.postscale", postscale_factor=0.5 if last else 1.0)),
        ("compression", "m.compression",
         lambda: rf.allreduce(x, name="m.compression",
                              compression=Compression.fp16 if last else Compression.none)),
        ("group", "m.group.0",
         lambda: rf.allreduce(x, name="m.group.0") if last
         else rf.grouped_allreduce([x], name="m.group")),
    ]


def mismatch(r: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, name, call in _mismatch_cases(r, n):
        out[field] = failure(call)
        out[field]["name"] = name
        # The next good op succeeds.
        got = rf.allreduce(np.full(3, r + 1.0), name=f"after.{field}", op=rf.Sum)
        check(np.array_equal(got, np.full(3, float(tri(n)))), f"op after {field} mismatch: {got}")
    # A cached name whose request changes on one rank is negotiated again, and disagrees.
    for _ in range(2):
        rf.allreduce(np.ones(4), name="m.cached", op=rf.Sum)
    out["cached"] = failure(rf.allreduce, np.ones(5 if r == n - 1 else 4), name="m.cached")
    out["cached"]["name"] = "m.cached"
    got = rf.allreduce(np.ones(4), name="m.cached", op=rf.Sum)
    check(np.array_equal(got, np.full(4, float(n))), f"cached name after its mismatch: {got}")
    # Different first dimensions are fine for allgather.
    got = rf.allgather(np.full((r + 1, 3), r), name="ok.gather")
    want = np.concatenate([np.full((q + 1, 3), q) for q in range(n)])
    check(np.array_equal(got, want), f"allgather with uneven first dims: {got}")
    # Unnamed ops issued in swapped order: shapes differ, so the ranks must not pair them.
    a, b = np.zeros(3), np.zeros(5)
    first, second = (b, a) if r % 2 else (a, b)
    h1, h2 = rf.allreduce_async(first), rf.allreduce_async(second)
    out["unnamed"] = [wait_failure(h1), wait_failure(h2)]
    got = rf.allreduce(np.full(2, r + 1.0), op=rf.Sum)  # unnamed ops pair again afterwards
    check(np.array_equal(got, np.full(2, float(tri(n)))), f"unnamed op after mismatch: {got}")
    return out


def local_errors(r: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = np.ones(4, np.float32)
    bad_dtype = np.ones(4, np.complex64) if r == 1 else x
    out["dtype"] = failure(rf.allreduce, bad_dtype, name="l.dtype")
    rf.allreduce(x, name="l.after1")
    out_buf = np.empty(8, np.float32)[::2] if r == 1 else np.empty(4, np.float32)
    out["out"] = failure(rf.allreduce, x, name="l.out", out=out_buf)
    rf.allreduce(x, name="l.after2")
    out["bool"] = failure(rf.allreduce, np.ones(3, bool), name="l.bool", op=rf.Average)
    out["root"] = failure(rf.broadcast, x, n, name="l.root")
    # A name submitted again while in flight: that call raises at once on its rank (as Horovod
    # does); the first goes on. The others submit it after rank 0's second call, so the first
    # cannot have finished by then.
    if r == 0:
        h1 = rf.allreduce_async(np.full(4, r + 1.0), name="l.dup", op=rf.Sum)
        out["dup_second"] = failure(rf.allreduce_async, x, name="l.dup")
    rf.barrier()
    if r != 0:
        h1 = rf.allreduce_async(np.full(4, r + 1.0), name="l.dup", op=rf.Sum)
    out["dup"] = h1.wait(30).tolist()
    got = rf.allreduce(np.full(4, r + 1.0), name="l.after3", op=rf.Sum)
    check(np.array_equal(got, np.full(4, float(tri(n)))), f"op after local errors: {got}")
    return out


def process_sets(r: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    low, high = rf.add_process_set([0, 1]), rf.add_process_set([2, 3])
    mine, other = (low, high) if r < 2 else (high, low)
    base = 0 if r < 2 else 2
    hs = [rf.allreduce_async(np.full(5, (r + 1) * (i + 1), np.int64), name=f"ps.{i}", op=rf.Sum,
                             process_set=mine) for i in range(20)]
    for i, h in enumerate(hs):
        want = (base + 1 + base + 2) * (i + 1)
        check(np.array_equal(h.wait(60), np.full(5, want)), f"ps.{i} in {mine}: wrong")
    got = rf.allgather(np.full(1, r), name="ps.gather", process_set=mine)
    check(got.tolist() == [base, base + 1], f"allgather in {mine}: {got}")
    got = rf.broadcast(np.full(2, r), base + 1, name="ps.bcast", process_set=mine)  # global root
    check(got.tolist() == [base + 1] * 2, f"broadcast in {mine}: {got}")
    out["non_member"] = failure(rf.allreduce, np.ones(2), name="ps.outsider", process_set=other)
    got = rf.allreduce(np.full(2, r + 1), name="ps.global", op=rf.Sum)
    check(got.tolist() == [tri(n)] * 2, f"global op with sets: {got}")
    # Only rank 0 submits this one; removing the set fails it instead of leaving it waiting.
    orphan = rf.allreduce_async(np.ones(2), name="ps.orphan", process_set=low) if r == 0 else None
    out["removed"] = [rf.remove_process_set(low), rf.remove_process_set(high)]
    if orphan is not None:
        out["orphan"] = wait_failure(orphan, 30)
    out["after_remove"] = failure(rf.allreduce, np.ones(2), name="ps.gone", process_set=mine)
    again = rf.add_process_set([1, 2, 3])
    if again.included():
        got = rf.allreduce(np.full(2, r), name="ps.again", op=rf.Sum, process_set=again)
        check(got.tolist() == [6, 6], f"allreduce in re-added set: {got}")
    rf.barrier()
    return out


def join(r: int, n: int) -> dict[str, Any]:
    steps = [2 + 3 * q for q in range(n)]  # rank n-1 does the most steps, so it joins last
    for s in range(steps[r]):
        got = rf.allreduce(np.full(6, r + 1, np.float64), name=f"j.{s}", op=rf.Sum)
        want = sum(q + 1 for q in range(n) if steps[q] > s)
        check(np.array_equal(got, np.full(6, float(want))), f"j.{s}: got {got}, expected {want}")
    last = rf.join()
    got = rf.allreduce(np.full(2, r + 1.0), name="j.after", op=rf.Sum)
    check(np.array_equal(got, np.full(2, float(tri(n)))), f"allreduce after join: {got}")
    return {"last": last}


_EXACT = {np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)}


def dtypes_ops(r: int, n: int) -> dict[str, Any]:
    """Every dtype x op at lengths 0, 1 and odd; compression round trips; the fp16 overflow case."""
    import math

    checked = 0
    for dtype in (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64,
                  np.float16, BFLOAT16, np.float32, np.float64):
        dtype = np.dtype(dtype)
        for op in (rf.Sum, rf.Min, rf.Max, rf.Product, rf.Average):
            if dtype == np.bool_:
                if op == rf.Average:
                    continue
                value, want = r == 0, {rf.Sum: True, rf.Max: True}.get(op, n == 1)
            else:
                value = r + 1
                want = {rf.Sum: tri(n), rf.Min: 1, rf.Max: n, rf.Product: math.factorial(n),
                        rf.Average: (n + 1) / 2}[op]
                if op == rf.Average and dtype.kind in "iu":
                    want = np.float64(tri(n)) / n  # ints: the mean rounded toward zero
                    want = int(want)
            for length in (0, 1, 7, 1001):
                x = np.full(length, value, dtype)
                name = f"d.{dtype.name}.{op.name}.{length}"
                exp = np.full(length, want).astype(dtype)
                # Twice: negotiated (a data-plane collective), then cached (rank 0 reduces it).
                for attempt in ("negotiated", "cached"):
                    got = rf.allreduce(x, name=name, op=op)
                    check(got.dtype == dtype and got.shape == (length,)
                          and np.array_equal(got, exp),
                          f"{name} ({attempt}): got {got[:3]}, expected {exp[:3]}")
                checked += 1
    for comp in (Compression.fp16, Compression.bf16):
        for dtype in (np.float32, np.float64):
            x = np.arange(33, dtype=dtype) * (r + 1)  # small integers: exact in 16 bits
            for _ in range(2):  # negotiated, then cached
                got = rf.allreduce(x, name=f"c.{comp.name}.{np.dtype(dtype).name}", op=rf.Sum,
                                   compression=comp)
                check(got.dtype == dtype
                      and np.array_equal(got, np.arange(33, dtype=dtype) * tri(n)),
                      f"{comp.name} round trip of {np.dtype(dtype).name}: {got[:4]}")
            checked += 1
        got = rf.allgather(np.full(2, r + 0.5, np.float32), name=f"c.{comp.name}.gather")
        check(got.tolist() == [q + 0.5 for q in range(n) for _ in range(2)], f"gather: {got}")
    # fp16 overflow: every rank 40000 (< 65504), sum 160000 would overflow float16 mid-ring.
    for label, x, comp in (("fp16 wire", np.full(9, 40000.0, np.float32), Compression.fp16),
                           ("float16", np.full(9, 40000.0, np.float16), Compression.none)):
        for _ in range(2):  # negotiated, then cached
            got = rf.allreduce(x, name=f"o.{label}", op=rf.Average, compression=comp)
            check(np.array_equal(got, np.full(9, 40000.0)), f"{label} average of 40000: {got[:3]}")
        checked += 1
    return {"checked": checked, "eager": rf.stats()["eager"]}


def callbacks(r: int, n: int) -> dict[str, Any]:
    """A done-callback may submit the next op (callbacks run outside the engine's lock)."""
    chained: list[rf.Handle] = []
    first = rf.allreduce_async(np.full(3, r + 1.0), name="cb.first", op=rf.Sum)
    first.add_done_callback(lambda h: chained.append(
        rf.allreduce_async(h.wait() * 2, name="cb.second", op=rf.Sum)))
    first.wait(30)
    end = time.monotonic() + 10
    while not chained and time.monotonic() < end:
        time.sleep(0.001)
    check(len(chained) == 1, "the callback did not run")
    got = chained[0].wait(30)
    check(np.array_equal(got, np.full(3, 2.0 * tri(n) * n)), f"chained: {got}")
    return {"ok": True}


def eager(r: int, n: int) -> dict[str, Any]:
    """Small cached allreduces that rank 0 reduces itself: the same bits as the data plane.

    Random inputs (fixed seeds), every rank computes every rank's input, so the closed form is a
    numpy sum in rank order. Each name runs negotiated (a data-plane collective) and then cached
    (eager when small): the two results must be bitwise equal, on every rank.
    """
    from ringflow.negotiation import EAGER_BYTES

    cases = []  # (name, dtype, length, op, prescale, postscale, compression)
    for dtype in (np.float32, np.float64, np.float16, np.int32):
        for length in (0, 1, 5, 1001, EAGER_BYTES // np.dtype(dtype).itemsize,
                       EAGER_BYTES // np.dtype(dtype).itemsize + 1):
            cases.append((dtype, length, rf.Sum, 1.0, 1.0, Compression.none))
        cases.append((dtype, 333, rf.Average, 1.0, 1.0, Compression.none))
        cases.append((dtype, 333, rf.Sum, 0.5, 3.0, Compression.none))
    cases.append((np.float32, 777, rf.Average, 2.0, 1.0, Compression.fp16))
    cases.append((np.float64, 777, rf.Sum, 1.0, 0.25, Compression.bf16))

    def inputs(rank: int, i: int, dtype: Any, length: int) -> np.ndarray:
        rng = np.random.default_rng(7919 * i + rank)
        if np.dtype(dtype).kind == "i":
            return rng.integers(-1000, 1000, length).astype(dtype)
        return rng.standard_normal(length).astype(dtype)

    results: dict[str, list] = {}
    for attempt in ("negotiated", "cached"):
        # Async, all at once: the cached round fuses them (eager items up to EAGER_BYTES).
        handles = []
        for i, (dtype, length, op, pre, post, comp) in enumerate(cases):
            handles.append(rf.allreduce_async(inputs(r, i, dtype, length), name=f"e.{i}", op=op,
                                              prescale_factor=pre, postscale_factor=post,
                                              compression=comp))
        for i, (h, (dtype, length, op, pre, post, comp)) in enumerate(
                zip(handles, cases, strict=True)):
            got = h.wait(60)
            parts = [inputs(q, i, dtype, length).astype(np.float64) * pre for q in range(n)]
            if np.dtype(dtype).kind == "i":
                parts = [np.trunc(p) for p in parts]  # the prescaled input is cast back to int
            want = np.sum(parts, axis=0) * post / (n if op == rf.Average else 1)
            loose = np.dtype(dtype) == np.float16 or comp is not Compression.none
            tol = 2e-2 if loose else 1e-5
            if np.dtype(dtype).kind == "i":
                want = np.trunc(want)
            check(got.dtype == np.dtype(dtype) and got.shape == (length,)
                  and np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * n),
                  f"e.{i} ({attempt}): got {got[:3]}, expected {want[:3]}")
            if attempt == "cached":
                check(got.tobytes() == results[f"e.{i}"], f"e.{i}: cached result differs in bits")
            else:
                results[f"e.{i}"] = got.tobytes()
    return {"digest": sorted((k, hashlib.sha256(v).hexdigest()) for k, v in results.items()),
            "eager": rf.stats()["eager"], "cases": len(cases)}


# failures ----------------------------------------------------------------------------------------
def shutdown_pending(r: int, n: int) -> dict[str, Any]:
    rf.allreduce(np.ones(2), name="sd.ok")
    h = rf.allreduce_async(np.ones(2), name=f"sd.only.{r}")  # never ready: no other rank has it
    rf.shutdown()
    return {"pending": wait_failure(h, 10), "later": failure(rf.allreduce, np.ones(2))}


def peer_exit(r: int, n: int, outdir: Path) -> dict[str, Any]:
    rf.allreduce(np.ones(2), name="pe.ok")
    if r == n - 1:
        (outdir / f"{r}.json").write_text(json.dumps({"rank": r, "exited": True}))
        os._exit(0)
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name="pe.after")}


def peer_exit_midop(r: int, n: int, outdir: Path) -> dict[str, Any]:
    """The last rank exits while the others are inside large allreduces."""
    import threading

    x = np.ones(2_000_000)
    rf.allreduce(x, name="pm.big")
    if r == n - 1:
        (outdir / f"{r}.json").write_text(json.dumps({"rank": r, "exited": True}))
        threading.Timer(0.2, os._exit, args=(0,)).start()
    start = time.monotonic()
    for _ in range(10_000):
        try:
            rf.allreduce(x, name="pm.big")
        except RingflowError as exc:
            return {"pending": {"type": type(exc).__name__, "text": str(exc),
                                "elapsed": time.monotonic() - start}}
    raise CheckFailed("10,000 allreduces succeeded although a rank exited")


def shutdown_early(r: int, n: int) -> dict[str, Any]:
    """Rank 1 shuts down cleanly; what the others submit afterwards fails, naming it."""
    rf.allreduce(np.ones(2), name="se.ok")
    if r == 1:
        rf.shutdown()
        return {}
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name="se.after")}


def peer_frozen(r: int, n: int, outdir: Path) -> dict[str, Any]:
    rf.allreduce(np.ones(2), name="pf.ok")
    if r == n - 1:
        (outdir / "frozen.pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"resumed": True}
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name="pf.after",
                                     timeout=60)}


def stall(r: int, n: int) -> dict[str, Any]:
    rf.allreduce(np.ones(2), name="st.ok")
    if r == n - 1:
        time.sleep(5)  # past RINGFLOW_STALL_SHUTDOWN_S: the job has failed by now
        return {"pending": failure(rf.allreduce, np.ones(2), name="st.skipped")}
    return {"pending": async_failure(rf.allreduce_async, np.ones(2), name="st.skipped")}


SCENARIOS = {
    "random_order": random_order, "fusion": fusion, "mismatch": mismatch,
    "local_errors": local_errors, "process_sets": process_sets, "join": join,
    "dtypes_ops": dtypes_ops, "eager": eager, "callbacks": callbacks,
    "shutdown_pending": shutdown_pending,
    "shutdown_early": shutdown_early, "stall": stall,
}
NEEDS_DIR = {"peer_exit": peer_exit, "peer_exit_midop": peer_exit_midop,
             "peer_frozen": peer_frozen}


def main() -> None:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    rf.init()
    r, n = rf.rank(), rf.size()
    try:
        if scenario in NEEDS_DIR:
            result = NEEDS_DIR[scenario](r, n, outdir)
        else:
            result = SCENARIOS[scenario](r, n)
    except CheckFailed as exc:
        sys.stderr.write(f"rank {r}: {scenario}: {exc}\n")
        sys.stderr.flush()
        os._exit(3)
    result["rank"] = r
    (outdir / f"{r}.json.tmp").write_text(json.dumps(result))
    os.replace(outdir / f"{r}.json.tmp", outdir / f"{r}.json")
    if scenario == "peer_frozen" and r == 0:
        # The frozen rank would never exit; end it now that the survivors have reported.
        os.kill(int((outdir / "frozen.pid").read_text()), signal.SIGKILL)
    rf.shutdown()


if __name__ == "__main__":
    main()
