"""reduce, gather and scatter through the engine on every rank, in closed form.

    ringflow-run -np N python worker.py FRAMEWORK[,FRAMEWORK...]   (numpy, torch, tensorflow)

For each framework, one after the other in the same job: every dtype the framework moves,
lengths 0, 1, odd and large, every root; then each error case (the same class and text on every
rank) followed by an operation that succeeds. TensorFlow runs every case eagerly and, for the
last root, inside ``tf.function``. Prints ``PASS <framework> rank r/n`` for each.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

import ringflow
from ringflow.ops import DTYPES

LENGTHS = (0, 1, 7, 30_001)


def values(q: int, rows: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    j = np.arange(rows)[:, None]
    c = np.arange(2)[None, :]
    raw = (q * 7 + j * 3 + c + seed) % (2 if dtype == np.bool_ else 50)
    return raw.astype(dtype)


def contribution(q: int, length: int, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return np.arange(length) % 2 == q % 2
    return (q + 1 + np.arange(length) % 3).astype(dtype)


def reduced(n: int, length: int, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return np.full(length, n > 1) | (np.arange(length) % 2 == 0)
    return (n * (n + 1) // 2 + n * (np.arange(length) % 3)).astype(dtype)


def rows_of(q: int, length: int) -> int:
    return (q + length) % 3 + (length // 100)  # ragged, 0 for some ranks


class Numpy:
    def __init__(self) -> None:
        self.hvd = ringflow
        self.dtypes = list(DTYPES.values())

    def t(self, a: np.ndarray) -> np.ndarray:
        return a

    def np(self, x):
        return None if x is None else np.asarray(x)

    def off_root(self, x) -> bool:
        return x is None


class Torch(Numpy):
    def __init__(self) -> None:
        import torch

        import ringflow.torch as hvd

        self.torch, self.hvd = torch, hvd
        self.dtypes = [d for d in DTYPES.values() if d.name != "bfloat16"] + ["bfloat16"]

    def t(self, a: np.ndarray):
        if a.dtype.name == "bfloat16":
            return self.torch.tensor(a.astype(np.float32)).to(self.torch.bfloat16)
        return self.torch.from_numpy(np.ascontiguousarray(a))

    def np(self, x):
        if x.dtype == self.torch.bfloat16:
            return x.float().numpy().astype(DTYPES["bfloat16"])
        return x.numpy()

    def off_root(self, x) -> bool:
        return x.numel() == 0


class TensorFlow(Torch):
    def __init__(self) -> None:
        import tensorflow as tf

        import ringflow.tensorflow as hvd

        tf.config.threading.set_inter_op_parallelism_threads(1)  # as the TensorFlow scripts
        tf.config.threading.set_intra_op_parallelism_threads(1)  # after it (framework_jobs.py)
        self.tf, self.hvd = tf, hvd
        self.dtypes = [d for d in DTYPES.values() if d.name != "uint16"]  # tf has no uint16 ops

    def t(self, a: np.ndarray):
        return self.tf.convert_to_tensor(a)

    def np(self, x):
        return x.numpy()

    def off_root(self, x) -> bool:
        return int(self.tf.size(x)) == 0


def check(what: str, ok: bool) -> None:
    if not ok:
        raise AssertionError(what)


def run_cases(fw, r: int, n: int, roots, graph: bool = False) -> int:
    hvd, count = fw.hvd, 0
    tf = getattr(fw, "tf", None)
    for dtype in fw.dtypes:
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        for length in LENGTHS:
            for root in roots:
                tag = f"{dt.name}.{length}.{root}{'.g' if graph else ''}"
                x = fw.t(contribution(r, length, dt))
                mine = fw.t(values(r, rows_of(r, length), dt))
                pieces = ([fw.t(values(q, rows_of(q, length), dt, 1)) for q in range(n)]
                          if r == root else None)
                extra = {"dtype": dt} if graph else {}
                calls = (
                    functools.partial(hvd.reduce, x, root, op=hvd.Sum, name=f"r.{tag}"),
                    functools.partial(hvd.gather, mine, root, name=f"g.{tag}"),
                    functools.partial(hvd.scatter, pieces, root, name=f"s.{tag}", **extra),
                )
                if graph:
                    calls = tuple(tf.function(c) for c in calls)
                red, gat, sca = (c() for c in calls)
                if r == root:
                    check(f"reduce {tag}: {fw.np(red)}",
                          np.array_equal(fw.np(red), reduced(n, length, dt)))
                    want = np.concatenate([values(q, rows_of(q, length), dt) for q in range(n)])
                    check(f"gather {tag}", np.array_equal(fw.np(gat), want))
                else:
                    check(f"reduce {tag} off the root", fw.off_root(red))
                    check(f"gather {tag} off the root", fw.off_root(gat))
                got = fw.np(sca)
                check(f"scatter {tag} dtype {got.dtype}", got.dtype == dt)
                check(f"scatter {tag}", np.array_equal(got, values(r, rows_of(r, length), dt, 1)))
                count += 3
    return count


def errors(fw, r: int, n: int) -> int:
    hvd = fw.hvd
    x = fw.t(np.ones(4, np.float32))
    cases = [
        ("root outside", lambda: hvd.reduce(x, n, name="e.root"), "outside"),
        ("shape mismatch", lambda: hvd.reduce(fw.t(np.ones(2 + r, np.float32)), 0,
                                              name="e.shape"), "disagree on shape"),
        ("gather rows", lambda: hvd.gather(fw.t(np.ones((2, 1 + r), np.float32)), 0,
                                           name="e.rows"), "disagree on shape[1:]"),
        ("scatter count", lambda: hvd.scatter([x] * (n + 1) if r == 0 else None, 0,
                                              name="e.count"), "one array per rank"),
        ("reduce adasum", lambda: hvd.reduce(x, 0, op=hvd.Adasum, name="e.adasum"),
         "Adasum is an allreduce op"),
    ]
    if n == 1:
        cases = [c for c in cases if c[0] not in ("shape mismatch", "gather rows")]
    for what, call, fragment in cases:
        try:
            call()
        except ringflow.errors.HorovodInternalError as exc:
            check(f"{what}: {exc}", fragment in str(exc))
        else:
            raise AssertionError(f"{what} did not fail")
        got = hvd.reduce(x, 0, op=hvd.Sum, name=f"after.{what}")
        check(f"after {what}", r != 0 or np.array_equal(fw.np(got), np.full(4, float(n))))
    return len(cases)


def main() -> None:
    ringflow.init()
    r, n = ringflow.rank(), ringflow.size()
    for name in sys.argv[1].split(","):
        fw = {"numpy": Numpy, "torch": Torch, "tensorflow": TensorFlow}[name]()
        count = run_cases(fw, r, n, range(n))
        if name == "tensorflow":
            count += run_cases(fw, r, n, [n - 1], graph=True)
        count += errors(fw, r, n)
        print(f"PASS {name} rank {r}/{n}: {count} operations", flush=True)
    ringflow.shutdown()


if __name__ == "__main__":
    main()
