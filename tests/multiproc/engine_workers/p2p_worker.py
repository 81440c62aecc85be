"""Point-to-point scenarios, one per ``ringflow-run`` job: ``p2p_worker.py SCENARIO OUTDIR``.

Every rank checks what it received in closed form (the value of element ``i`` of the message
that rank ``src`` sent with ``tag`` is :func:`value`) and writes ``OUTDIR/<rank>.json`` with what
it observed (error classes and texts, counters, times); the test compares the ranks' files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from engine_worker import CheckFailed, check, failure, run_scenario, wait_failure  # same folder

import ringflow as rf
from ringflow.errors import RingflowError
from ringflow.ops import DTYPES
from ringflow.p2p import CHUNK_BYTES

LENGTHS = [0, 1, 7, 4099]  # empty, one element, odd, a large odd one


def value(src: int, tag: int, length: int, dtype: np.dtype, shape: Any = None) -> np.ndarray:
    """What rank ``src`` sends with ``tag``: distinct per (src, tag, i), exact in every dtype."""
    raw = (np.arange(length) * 7 + src * 31 + tag * 5) % 97
    out = (raw % 2).astype(dtype) if dtype == np.bool_ else raw.astype(dtype)
    return out if shape is None else out.reshape(shape)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    check(isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
          and np.array_equal(got, want),
          f"{what}: got {getattr(got, 'dtype', type(got))} {np.shape(got)} "
          f"{np.asarray(got).ravel()[:4]}, expected {want.dtype} {want.shape} {want.ravel()[:4]}")


# scenarios ---------------------------------------------------------------------------------------
def ring(r: int, n: int) -> dict[str, Any]:
    """Every rank sends to (r+1) % n and receives from (r-1) % n: every dtype x length, several
    tags at once (received in another order than sent), then out= and shape= forms, then a
    message of several chunks."""
    dst, src = (r + 1) % n, (r - 1) % n
    count = 0
    for dtype in DTYPES.values():
        for length in LENGTHS:
            tags = [3, 0, 11, -2]  # any int
            sends = [rf.isend(value(r, t, length, dtype), dst, tag=t) for t in tags]
            for t in reversed(tags):
                same(rf.recv(src, tag=t), value(src, t, length, dtype),
                     f"{dtype.name}[{length}] tag {t}")
                count += 1
            for h in sends:
                check(h.wait(30) is None, "a send's result is None")
                check(h.is_completed(), "is_completed() after wait()")
            # into out=, and as shape=: the receiver's layout
            h = rf.isend(value(r, 9, length, dtype), dst, tag=9)
            out = np.empty(length, dtype)
            got = rf.recv(src, tag=9, out=out)
            check(got is out, "recv(out=) returns out")
            same(out, value(src, 9, length, dtype), f"{dtype.name}[{length}] out=")
            h.wait(30)
            if length and length % 7 == 0:
                h = rf.isend(value(r, 4, length, dtype), dst, tag=4)
                got = rf.recv(src, tag=4, shape=(7, length // 7), dtype=dtype)
                same(got, value(src, 4, length, dtype, (7, length // 7)), "shape=")
                h.wait(30)
    # several chunks, both into a fresh array and into out=; and a 0-d array
    big = 2 * CHUNK_BYTES // 8 + 12345
    h = rf.isend(value(r, 1, big, np.dtype(np.float64)), dst, tag=1)
    h2 = rf.isend(value(r, 2, big, np.dtype(np.int32)), dst, tag=2)
    same(rf.recv(src, tag=1), value(src, 1, big, np.dtype(np.float64)), "chunked")
    out = np.empty(big, np.int32)
    same(rf.recv(src, tag=2, out=out), value(src, 2, big, np.dtype(np.int32)), "chunked out=")
    h.wait(30)
    h2.wait(30)
    h = rf.isend(np.float32(r + 0.5), dst, tag=6)
    same(rf.recv(src, tag=6), np.asarray(np.float32(src + 0.5)), "0-d")
    h.wait(30)
    return {"count": count, "stats": rf.stats()}


def unexpected(r: int, n: int) -> dict[str, Any]:
    """Rank 0 sends (blocking sends would wait) before rank 1 posts any receive: the messages
    wait at rank 1, and are matched in order per tag, whatever order the tags are asked in."""
    if r == 0:
        hs = [rf.isend(np.full(3, 10 * i + t, np.int64), 1, tag=t)
              for i in range(5) for t in (1, 2)]
        hs.append(rf.isend(np.arange(CHUNK_BYTES // 4 + 3, dtype=np.float32), 1, tag=3))
        rf.barrier()
        for h in hs:
            h.wait(30)
        return {}
    if r == 1:
        deadline = time.monotonic() + 30
        while rf.stats()["p2p_received"] < 11 and time.monotonic() < deadline:
            time.sleep(0.01)  # everything has arrived before any receive is posted
        arrived = rf.stats()["p2p_received"]
        rf.barrier()
        big = rf.recv(0, tag=3)
        same(big, np.arange(CHUNK_BYTES // 4 + 3, dtype=np.float32), "unexpected, chunked")
        got = [int(rf.recv(0, tag=t)[0]) for t in (2, 1, 2, 2, 1, 1, 1, 2, 2, 1)]
        return {"arrived": arrived, "got": got}
    rf.barrier()
    return {}


def fifo(r: int, n: int) -> dict[str, Any]:
    """200 messages of one tag: receives posted at once and waited in reverse order match the
    sends in order; blocking send/recv in a fixed order work too."""
    count = 200
    if r == 0:
        hs = [rf.isend(np.full(2, i, np.int32), 1, tag=7) for i in range(count)]
        for i in range(20):
            rf.send(np.full(1, i, np.int16), 1, tag=8)
        for h in hs:
            h.wait(30)
        return {}
    if r == 1:
        hs = [rf.irecv(0, tag=7) for _ in range(count)]
        got = [int(h.wait(30)[0]) for h in reversed(hs)][::-1]
        check(got == list(range(count)), f"FIFO: {got[:10]}...")
        blocking = [int(rf.recv(0, tag=8)[0]) for _ in range(20)]
        check(blocking == list(range(20)), f"blocking FIFO: {blocking}")
        return {"got": len(got)}
    return {}


def errors(r: int, n: int) -> dict[str, Any]:
    """Mismatches fail both ranks with one text and the next message goes through; local errors
    raise at the call; a dtype ringflow cannot move fails both ranks."""
    out: dict[str, Any] = {}
    x = np.arange(5, dtype=np.float32)
    cases = {  # name -> receive arguments that disagree with a send of x
        "size_shape": {"shape": (4,)},
        "size_out": {"out": np.empty(6, np.float32)},
        "dtype": {"dtype": np.float64},
        "dtype_out": {"out": np.empty(5, np.int32)},
    }
    for i, (case, kwargs) in enumerate(cases.items()):
        if r == 0:
            out[case] = failure(rf.send, x, 1, tag=i)
            rf.send(x + i, 1, tag=i)  # the next message of the same tag goes through
        elif r == 1:
            out[case] = failure(rf.recv, 0, i, **kwargs)
            same(rf.recv(0, tag=i), x + i, f"{case}: next message")
    if r == 0:  # the sender cannot send complex numbers: both ranks fail with its text
        out["bad_dtype"] = failure(rf.send, np.ones(2, np.complex128), 1, tag=20)
        rf.send(x, 1, tag=20)
    elif r == 1:
        out["bad_dtype"] = failure(rf.recv, 0, 20)
        same(rf.recv(0, tag=20), x, "after a bad dtype")
    local = {
        "dst_self": lambda: rf.isend(x, r),
        "dst_range": lambda: rf.isend(x, n),
        "dst_negative": lambda: rf.send(x, -1),
        "src_self": lambda: rf.irecv(r),
        "src_range": lambda: rf.recv(n + 3),
        "tag_type": lambda: rf.isend(x, (r + 1) % n, tag="a"),
        "out_type": lambda: rf.irecv((r + 1) % n, out=[1, 2]),
        "out_shape": lambda: rf.irecv((r + 1) % n, out=np.empty(3), shape=(4,)),
    }
    for case, fn in local.items():
        try:
            fn()
            raise CheckFailed(f"{case}: no error at the call")
        except ValueError as exc:
            check(isinstance(exc, RingflowError), f"{case}: {exc!r} is not a RingflowError")
            out[case] = {"type": type(exc).__name__, "text": str(exc)}
    rf.barrier()
    return out


def quiet(r: int, n: int, outdir: Path) -> dict[str, Any]:
    """Ranks 1 and 2 exchange messages; rank 0 (the coordinator) sees nothing of it."""
    rf.barrier()
    before = rf.stats()
    if r in (1, 2):
        peer = 3 - r
        for i in range(20):
            size = 1024 if i % 2 else CHUNK_BYTES // 4 + 1  # 4 KiB, and two chunks
            h = rf.isend(value(r, i, size, np.dtype(np.float32)), peer, tag=i)
            same(rf.recv(peer, tag=i), value(peer, i, size, np.dtype(np.float32)), "exchange")
            h.wait(30)
        (outdir / f"exchanged.{r}").write_text("done")
    else:
        deadline = time.monotonic() + 60
        while not all((outdir / f"exchanged.{q}").exists() for q in (1, 2)):
            check(time.monotonic() < deadline, "ranks 1 and 2 did not finish their exchange")
            time.sleep(0.01)
    after = rf.stats()
    rf.barrier()
    # (The p2p counters since init: a peer may send its first message before this rank's
    # ``before``.)
    return {"delta": {k: after[k] - before.get(k, 0) for k in after}, "after": after}


def peer_death(r: int, n: int, outdir: Path) -> dict[str, Any]:
    """Rank 2 exits while rank 1 waits for its message and rank 0 for its reply; later calls
    raise at the call."""
    rf.barrier()
    if r == 2:
        (outdir / f"{r}.json").write_text(json.dumps({"rank": r, "exited": True}))
        time.sleep(0.5)  # the others have posted their operations
        os._exit(0)
    start = time.monotonic()
    h = rf.irecv(2, tag=1) if r == 1 else rf.isend(np.ones(4), 2, tag=1)
    if r == 0:
        # The message is already with rank 2 (or in its socket); the send waits for a reply.
        check(not h.is_completed(), "the send completed without a receive")
    pending = wait_failure(h, 30)
    pending["elapsed"] = time.monotonic() - start
    deadline = time.monotonic() + 30
    later: dict[str, Any] = {}
    while time.monotonic() < deadline:  # once the job's error is known, calls raise at once
        try:
            rf.isend(np.ones(2), 1 - r, tag=2)
        except RingflowError as exc:
            later = {"type": type(exc).__name__, "text": str(exc)}
            break
        time.sleep(0.05)
    return {"pending": pending, "later": later}


def shutdown_peer(r: int, n: int) -> dict[str, Any]:
    """Rank 1 shuts down cleanly: rank 0's pending receive from it fails naming it; a message
    it sent before leaving can still be received."""
    if r == 1:
        rf.isend(np.arange(3.0), 0, tag=5)  # not waited: rank 0 receives it after we leave
        rf.barrier()
        rf.shutdown()
        return {}
    rf.barrier()
    h = rf.irecv(1, tag=6)
    pending = wait_failure(h, 30)
    got = rf.recv(1, tag=5)
    same(got, np.arange(3.0), "a message sent before the goodbye")
    return {"pending": pending}


def coordinator_leaves(r: int, n: int, outdir: Path) -> dict[str, Any]:
    """Rank 0 shuts down; ranks 1 and 2 go on exchanging messages, also after timeout_s (a peer
    that said goodbye is not taken for frozen), while their collectives fail naming rank 0."""
    rf.barrier()
    if r == 0:
        rf.shutdown()
        (outdir / "left").write_text("rank 0 has shut down")
        return {}
    deadline = time.monotonic() + 30
    while not (outdir / "left").exists():
        check(time.monotonic() < deadline, "rank 0 did not shut down")
        time.sleep(0.01)
    time.sleep(float(os.environ["RINGFLOW_TIMEOUT_S"]) + 1.5)
    peer = 3 - r
    got = []
    for i in range(5):
        h = rf.isend(np.full(3, 10 * r + i), peer, tag=i)
        got.append(int(rf.recv(peer, tag=i)[0]))
        h.wait(30)
    check(got == [10 * peer + i for i in range(5)], f"exchange after rank 0 left: {got}")
    return {"got": got, "collective": failure(rf.allreduce, np.ones(2), name="after")}


def pingpong(r: int, n: int) -> dict[str, Any]:
    """Latency of one send/recv round trip (rank 0 -> 1 -> 0) at 4 KiB and 64 MiB."""
    out: dict[str, Any] = {}
    for label, nbytes, iters in (("4KiB", 4096, 2000), ("64MiB", 64 << 20, 10)):
        x = np.ones(nbytes // 4, np.float32)
        buf = np.empty_like(x)
        times = []
        for i in range(iters + 3):
            t0 = time.perf_counter()
            if r == 0:
                rf.send(x, 1)
                rf.recv(1, out=buf)
            elif r == 1:
                rf.recv(0, out=buf)
                rf.send(x, 0)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out[label] = times
    return out


SCENARIOS = {"ring": ring, "unexpected": unexpected, "fifo": fifo, "errors": errors,
             "shutdown_peer": shutdown_peer, "pingpong": pingpong}
NEEDS_DIR = {"quiet": quiet, "peer_death": peer_death,
             "coordinator_leaves": coordinator_leaves}


def main() -> None:
    run_scenario(SCENARIOS, NEEDS_DIR)
    rf.shutdown()  # no barrier first: point to point outlives rank 0's shutdown


if __name__ == "__main__":
    main()
