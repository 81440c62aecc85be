"""Horovod 0.28 conformance, one rank of a ringflow-run job: ``worker.py MODE[,MODE...]``.

MODE is ``torch`` (ringflow.torch), ``tf-eager`` / ``tf-function`` (ringflow.tensorflow, every
collective called eagerly or inside a ``tf.function``) or ``cross`` (the same forward and
gradient of every differentiable collective in torch and in TensorFlow, compared). Several
modes run one after the other in the same job (a TensorFlow process costs several CPU-seconds
to start).

Each point of issue 14 is a named section: the expected value is written in closed form from
the rank and the world size, every error case is checked on every rank, and every error is
followed by an operation that must succeed with the exact result (the process survives its
errors). For each mode a rank prints ``PASS <mode>: <n> checks`` or names each failed check;
it exits 1 if any failed.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np

import ringflow
from ringflow import errors

MODES = sys.argv[1].split(",")
faulthandler.dump_traceback_later(100 * len(MODES) + 50, exit=True)
FAILURES: list[str] = []
PASSED: list[str] = []


def check(what: str, ok: bool, detail: object = "") -> None:
    (PASSED if ok else FAILURES).append(what if ok else f"{what}: {detail}")


def equal(what: str, got: Any, want: Any, tol: float = 0.0) -> None:
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and (
        np.array_equal(got, want) if tol == 0 else
        np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol))
    check(what, ok, f"got {got.tolist()!s:.300}, want {want.tolist()!s:.300}")


def section(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        FAILURES.append(f"{name}: raised\n{traceback.format_exc()}")


# frameworks --------------------------------------------------------------------------------------
class Torch:
    """How a check calls ringflow.torch: tensors in, numpy out, gradients by backward()."""

    def __init__(self) -> None:
        import torch

        import ringflow.torch as hvd

        torch.set_num_threads(1)
        self.torch, self.hvd, self.graph = torch, hvd, False

    def t(self, x: Any) -> Any:
        return self.torch.from_numpy(np.array(x))

    def np(self, x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return [self.np(v) for v in x]
        return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)

    def call(self, fn: Callable[..., Any], *xs: Any) -> Any:
        return self.np(fn(*[self.t(x) for x in xs]))

    def grad(self, fn: Callable[..., Any], xs: list[np.ndarray], w: float) -> list[np.ndarray]:
        """Gradients of ``sum(w * sum(fn(*xs)))`` with respect to ``xs``."""
        ts = [self.t(x).requires_grad_() for x in xs]
        outs = fn(*ts)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        (sum(o.sum() for o in outs) * w).backward()
        return [t.grad.numpy() for t in ts]


def one_thread(tf: Any) -> None:
    """TensorFlow's pools at one thread each, unless an earlier script of this process set them
    (one_process.py: rooted/worker.py sets the same); once TensorFlow ran, setting them raises, so
    a different count fails here, loudly."""
    threading = tf.config.threading
    for get, set_ in ((threading.get_inter_op_parallelism_threads,
                       threading.set_inter_op_parallelism_threads),
                      (threading.get_intra_op_parallelism_threads,
                       threading.set_intra_op_parallelism_threads)):
        if get() != 1:
            set_(1)


class TF:
    """How a check calls ringflow.tensorflow, eagerly or inside a tf.function."""

    def __init__(self, graph: bool) -> None:
        import tensorflow as tf

        import ringflow.tensorflow as hvd

        tf.get_logger().setLevel("ERROR")  # retracing warnings: every check traces anew
        one_thread(tf)
        self.tf, self.hvd, self.graph = tf, hvd, graph

    def t(self, x: Any) -> Any:
        return self.tf.constant(np.array(x))

    def np(self, x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return [self.np(v) for v in x]
        if isinstance(x, self.tf.IndexedSlices):
            x = self.tf.convert_to_tensor(x)
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.tf.function(fn)(*args) if self.graph else fn(*args)

    def call(self, fn: Callable[..., Any], *xs: Any) -> Any:
        def dense(*ts: Any) -> Any:
            out = fn(*ts)
            if isinstance(out, self.tf.IndexedSlices):
                out = self.tf.convert_to_tensor(out)
            return out

        return self.np(self._run(dense, *[self.t(x) for x in xs]))

    def grad(self, fn: Callable[..., Any], xs: list[np.ndarray], w: float) -> list[np.ndarray]:
        tf = self.tf

        def body(*ts: Any) -> Any:
            with tf.GradientTape() as tape:
                for t in ts:
                    tape.watch(t)
                outs = fn(*ts)
                outs = outs if isinstance(outs, (list, tuple)) else [outs]
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float64)) for o in outs]) * w
            return tape.gradient(loss, list(ts))

        return self.np(self._run(body, *[self.t(x) for x in xs]))


def failure(fw: Any, fn: Callable[..., Any], *xs: Any) -> tuple[str, str]:
    """(class name, text) of the error ``fw.call(fn, *xs)`` raises; ("", value) if none.

    Eagerly the error must be a ringflow error and a ``hvd.HorovodInternalError`` (a
    RuntimeError); inside tf.function TensorFlow reports it as a ``tf.errors`` class whose text
    names the ringflow class. An error a TensorFlow op raised must be the ``tf.errors`` class
    Horovod's op raises for it (``ringflow.tensorflow.status``), eagerly too.
    """
    try:
        value = fw.call(fn, *xs)
    except Exception as exc:
        text = str(exc)
        if fw.graph:
            name = next((n for n in dir(errors) if f"{n}:" in text), type(exc).__name__)
        else:
            ok = isinstance(exc, fw.hvd.HorovodInternalError) and isinstance(exc, RuntimeError)
            name = type(exc).__name__ if ok else f"not HorovodInternalError {type(exc)!r}"
        cls = getattr(errors, name, None)
        if hasattr(fw, "tf") and isinstance(exc, fw.tf.errors.OpError) and cls is not None:
            from ringflow.tensorflow import status

            want = status.tf_class(cls(text))
            if want is not None and not isinstance(exc, want):
                name = f"{name} raised as {type(exc).__name__}, not {want.__name__}"
        return name, text
    return "", repr(value)


def expect_failure(fw: Any, what: str, kinds: tuple[str, ...], fragment: str,
                   fn: Callable[..., Any], *xs: Any) -> None:
    kind, text = failure(fw, fn, *xs)
    check(what, kind in kinds and fragment in text, f"{kind}: {text[:400]}")


def still_works(fw: Any, what: str) -> None:
    """The next operation after an error succeeds with the exact result."""
    hvd, n, r = fw.hvd, ringflow.size(), ringflow.rank()
    got = fw.call(lambda x: hvd.allreduce(x, op=hvd.Sum, name=f"{what}.after"),
                  np.full(3, r + 1.0))
    equal(f"{what}: next operation", got, np.full(3, n * (n + 1) / 2))


# the points of the issue -----------------------------------------------------------------------
def errors_are_horovods(fw: Any) -> None:
    hvd, r = fw.hvd, ringflow.rank()
    check("HorovodInternalError is a RuntimeError",
          issubclass(hvd.HorovodInternalError, RuntimeError)
          and hvd.HorovodInternalError is errors.HorovodInternalError)
    check("HostsUpdatedInterrupt", hvd.HostsUpdatedInterrupt(True).skip_sync is True)
    x = np.ones(3 if r == 0 else 4, np.float32)
    expect_failure(fw, "mismatch", ("MismatchError",), "shape",
                   lambda t: hvd.allreduce(t, name="c.mismatch"), x)
    still_works(fw, "mismatch")
    n = ringflow.size()
    expect_failure(fw, "root outside the job", ("TensorError",), f"root rank {n} is outside",
                   lambda t: hvd.broadcast(t, n, name="c.badroot"), np.ones(2))
    still_works(fw, "badroot")
    splits = [1] * (n + 1)
    expect_failure(fw, "alltoall splits length", ("TensorError",), "one per rank",
                   lambda t: hvd.alltoall(t, splits=splits, name="c.splits"),
                   np.ones((n + 1, 2), np.float32))
    still_works(fw, "splits")


def duplicate_names(fw: Any) -> None:
    """A name submitted again while in flight raises at the call on that rank (torch: only its
    async forms can have two operations in flight)."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    torch = fw.torch
    x = torch.ones(n, 2)
    forms = {
        "allreduce": lambda: hvd.allreduce_async(x, name="d.ar", op=hvd.Sum),
        "allreduce_": lambda: hvd.allreduce_async_(x.clone(), name="d.ar_", op=hvd.Sum),
        "grouped_allreduce": lambda: hvd.grouped_allreduce_async([x, x], name="d.gar",
                                                                 op=hvd.Sum),
        "grouped_allreduce_": lambda: hvd.grouped_allreduce_async_([x.clone()], name="d.gar_",
                                                                   op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(x, name="d.ag"),
        "grouped_allgather": lambda: hvd.grouped_allgather_async([x], name="d.gag"),
        "broadcast": lambda: hvd.broadcast_async(x, 0, name="d.bc"),
        "broadcast_": lambda: hvd.broadcast_async_(x.clone(), 0, name="d.bc_"),
        "alltoall": lambda: hvd.alltoall_async(x, name="d.a2a"),
        "reducescatter": lambda: hvd.reducescatter_async(x, name="d.rs", op=hvd.Sum),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter_async([x], name="d.grs",
                                                                         op=hvd.Sum),
    }
    firsts = {}
    if r == 0:
        for form, start in forms.items():
            firsts[form] = start()
            try:
                start()
                check(f"duplicate {form} raises at the call", False, "no error")
            except ValueError as exc:
                check(f"duplicate {form} raises at the call",
                      isinstance(exc, hvd.HorovodInternalError)
                      and "submitted again while it was in flight" in str(exc), repr(exc))
    hvd.barrier()  # the others submit only now: rank 0's first operations are still in flight
    if r != 0:
        firsts = {form: start() for form, start in forms.items()}
    got = hvd.synchronize(firsts["allreduce"])
    equal("duplicate: the first allreduce finishes", got.numpy(), np.full((n, 2), float(n)))
    for handle in firsts.values():
        hvd.synchronize(handle)
    still_works(fw, "duplicate")


def global_root(fw: Any) -> None:
    """root_rank inside a process set is a global rank; one outside the set fails on members."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    ranks = list(range(1, n))
    ps = hvd.add_process_set(ranks)
    if r in ranks:
        for root in ranks:
            got = fw.call(lambda t, root=root: hvd.broadcast(t, root, name=f"g.{root}",
                                                             process_set=ps),
                          np.full(3, 10.0 * r))
            equal(f"set {ranks} broadcast from global root {root}", got, np.full(3, 10.0 * root))
        expect_failure(fw, "root outside the set", ("TensorError",), "not a member",
                       lambda t: hvd.broadcast(t, 0, name="g.out", process_set=ps),
                       np.ones(2))
        got = fw.call(lambda t: hvd.allreduce(t, op=hvd.Sum, name="g.after", process_set=ps),
                      np.ones(2))
        equal("set: next operation", got, np.full(2, float(len(ranks))))
    hvd.remove_process_set(ps)
    still_works(fw, "global_root")


def sparse(fw: Any) -> None:
    """Sparse allreduce: allgather of indices and values; Average divides; not Max."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    rows, cols = 5, 3
    idx = np.array([r % rows, (r + 2) % rows, r % rows])  # a duplicate index, overlaps others
    vals = np.stack([np.full(cols, r + 1.0), np.full(cols, 2.0), np.full(cols, 0.5)])

    def dense_of(q: int) -> np.ndarray:
        d = np.zeros((rows, cols))
        np.add.at(d, np.array([q % rows, (q + 2) % rows, q % rows]),
                  np.stack([np.full(cols, q + 1.0), np.full(cols, 2.0), np.full(cols, 0.5)]))
        return d

    total = sum(dense_of(q) for q in range(n))
    if isinstance(fw, Torch):
        torch = fw.torch

        def make() -> Any:
            return torch.sparse_coo_tensor(torch.from_numpy(idx[None]), torch.from_numpy(vals),
                                           (rows, cols), check_invariants=True)

        for op, want in [(hvd.Sum, total), (hvd.Average, total / n)]:
            got = hvd.allreduce(make(), op=op, name=f"s.{op.name}")
            check(f"sparse allreduce {op.name} stays sparse", got.is_sparse)
            equal(f"sparse allreduce {op.name}", got.to_dense().numpy(), want, 1e-12)
            got = hvd.synchronize(hvd.sparse_allreduce_async(make(), f"s.async.{op.name}", op))
            equal(f"sparse_allreduce_async {op.name}", got.to_dense().numpy(), want, 1e-12)
        try:
            hvd.allreduce(make(), op=hvd.Max, name="s.max")
            check("sparse Max raises", False)
        except ValueError as exc:
            check("sparse Max raises", "supports op Sum or Average" in str(exc), repr(exc))
        sparse_as_dense(fw)
    else:
        tf = fw.tf

        def fn(v: Any, i: Any, op: Any) -> Any:
            return hvd.allreduce(tf.IndexedSlices(v, i, dense_shape=[rows, cols]), op=op,
                                 name=f"s.{op.name}")

        for op, want in [(hvd.Sum, total), (hvd.Average, total / n)]:
            got = fw.call(lambda v, i, op=op: fn(v, i, op), vals, idx)
            equal(f"IndexedSlices allreduce {op.name}", got, want, 1e-12)
    still_works(fw, "sparse")


def sparse_as_dense(fw: Any) -> None:
    """DistributedOptimizer with a sparse embedding: sparse and sparse_as_dense give the same
    parameters, equal to averaging the dense gradients."""
    hvd, torch, r, n = fw.hvd, fw.torch, ringflow.rank(), ringflow.size()
    ids = torch.tensor([r % 4, 3, (r + 1) % 4])
    results = []
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(4, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        start = emb.weight.detach().clone()
        (emb(ids).sum() * (r + 1)).backward()
        opt.step()
        results.append(emb.weight.detach().numpy().copy())
    grad = np.zeros((4, 2))
    for q in range(n):
        np.add.at(grad, [q % 4, 3, (q + 1) % 4], q + 1.0)
    equal("sparse_as_dense equals the sparse path", results[1], results[0], 1e-6)
    equal("sparse gradient average", results[0], start.numpy() - grad / n, 1e-6)


def reducescatter_rules(fw: Any) -> None:
    """Horovod's reducescatter gradient and the scale arithmetic of integer and fp16 tensors."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    w = r + 1.0
    blocks = np.repeat(np.arange(1, n + 1, dtype=np.float64), 2)[:, None] * np.ones((1, 2))
    for op, mult in [(hvd.Sum, n), (hvd.Average, 1)]:
        for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
            (g,) = fw.grad(lambda x, op=op, pre=pre, post=post: hvd.reducescatter(
                x, op=op, name=f"r.{op.name}.{pre}", prescale_factor=pre,
                postscale_factor=post), [np.ones((2 * n, 2))], w)
            equal(f"reducescatter grad {op.name} pre={pre} post={post}", g,
                  blocks * mult * pre * post, 1e-12)
    gs = fw.grad(lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum, name="r.g"),
                 [np.ones(2 * n), np.ones((2 * n, 2))], w)
    equal("grouped reducescatter grad", gs[1], blocks * n, 1e-12)
    # integers: prescale before the sum and postscale after it, each in float64, truncated
    xi = (np.array([7, -7, 5, 3, 1], np.int32) * (r + 1)).astype(np.int32)
    got = fw.call(lambda t: hvd.allreduce(t, op=hvd.Sum, name="r.int", prescale_factor=0.5,
                                          postscale_factor=1.5), xi)
    pre = [np.trunc((np.array([7, -7, 5, 3, 1]) * (q + 1)) * 0.5) for q in range(n)]
    equal("int32 prescale/postscale", got, np.trunc(np.sum(pre, axis=0) * 1.5).astype(np.int32))
    # float16: multiplied in float32 by the float32 factor, rounded once (not by fp16(0.1))
    cand = np.arange(1, 2049, dtype=np.float16)
    horovod = (cand.astype(np.float32) * np.float32(0.1)).astype(np.float16)
    xs = cand[horovod != cand * np.float16(0.1)][:8]
    check("fp16 values where the arithmetic matters exist", xs.size > 0)
    got = fw.call(lambda t: hvd.allreduce(t, op=hvd.Sum, name="r.fp16", prescale_factor=0.1), xs)
    one = (xs.astype(np.float32) * np.float32(0.1)).astype(np.float16).astype(np.float32)
    equal("float16 prescale in float32", got, (one * n).astype(np.float16))


def adasum(fw: Any) -> None:
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    x = np.cos(np.arange(7) * 0.7 + r).astype(np.float32)
    if n & (n - 1) == 0:
        got = fw.call(lambda t: hvd.allreduce(t, op=hvd.Adasum, name="a.ok"), x)
        vs = [np.cos(np.arange(7) * 0.7 + q).astype(np.float64) for q in range(n)]
        while len(vs) > 1:
            nxt = []
            for a, b in zip(vs[::2], vs[1::2], strict=True):
                d = a @ b
                nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
            vs = nxt
        equal("Adasum allreduce", got, vs[0].astype(np.float32), 1e-6)
    else:
        expect_failure(fw, "Adasum on a non-power of two", ("AdasumError",), "non-power of 2",
                       lambda t: hvd.allreduce(t, op=hvd.Adasum, name="a.np2"), x)
        if not fw.graph:
            try:
                fw.call(lambda t: hvd.allreduce(t, op=hvd.Adasum, name="a.np2b"), x)
                check("AdasumError is a NotImplementedError", False, "no error")
            except NotImplementedError:
                check("AdasumError is a NotImplementedError", True)
    still_works(fw, "adasum")
    expect_failure(fw, "reducescatter with Adasum", ("TensorError",),
                   "Reducescatter currently only supports AVERAGE and SUM",
                   lambda t: hvd.reducescatter(t, op=hvd.Adasum, name="a.rs"),
                   np.ones((n, 2), np.float32))
    still_works(fw, "adasum_rs")


def join(fw: Any) -> None:
    """Rank 0 joins at once; the others go on with allreduce; allgather and broadcast fail on
    every one of them, as in Horovod (test_horovod_join_allgather / _broadcast)."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    if r != 0:
        others = range(1, n)
        got = fw.call(lambda t: hvd.allreduce(t, op=hvd.Sum, name="j.sum"), np.full(3, r + 1.0))
        equal("allreduce Sum after a join", got, np.full(3, float(sum(q + 1 for q in others))))
        got = fw.call(lambda t: hvd.allreduce(t, name="j.avg"), np.full(3, r + 1.0))
        equal("allreduce Average after a join (divides by the size)", got,
              np.full(3, sum(q + 1 for q in others) * (1 / n)))  # Horovod: times 1/size
        expect_failure(fw, "allgather after a join", ("TensorError",),
                       "Allgather is not supported with Join",
                       lambda t: hvd.allgather(t, name="j.ag"), np.full((1, 2), r, np.int64))
        expect_failure(fw, "broadcast after a join", ("TensorError",),
                       "Broadcast is not supported with Join",
                       lambda t: hvd.broadcast(t, n - 1, name="j.bc"), np.full(2, 10.0 * r))
        if r == n - 1:
            time.sleep(0.3)  # the last to join
    last = hvd.join()
    equal("join returns the last rank to join", int(np.asarray(last)), n - 1)
    still_works(fw, "join")


def optimizer_state(fw: Any) -> None:
    """broadcast_optimizer_state for every torch.optim optimizer; broadcast_object with None."""
    hvd, torch, r = fw.hvd, fw.torch, ringflow.rank()
    names = [k for k in dir(torch.optim) if isinstance(getattr(torch.optim, k), type)
             and issubclass(getattr(torch.optim, k), torch.optim.Optimizer)
             and getattr(torch.optim, k) is not torch.optim.Optimizer]
    for name in names:
        cls = getattr(torch.optim, name)
        torch.manual_seed(r)  # different parameters and state on every rank
        w = torch.nn.Parameter(torch.randn(4, 3))
        kwargs = {"lr": 0.01 * (r + 1)}
        opt = cls([w], **kwargs)
        if r == 0 or r == 2:  # the root and rank 2 have state; the other ranks none
            for _ in range(2 + r):
                w.grad = torch.randn(4, 3).to_sparse() if name == "SparseAdam" else \
                    torch.randn(4, 3)
                if name == "LBFGS":
                    opt.step(lambda w=w: (w ** 2).sum())
                else:
                    opt.step()
        if r == 0 and opt.state:  # a scalar, a None and a root-only entry
            opt.state[w]["ringflow_scalar"] = 3
            opt.state[w]["ringflow_none"] = None
        if r == 1:
            opt.state[w]["only_here"] = torch.ones(1)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mine = _digest(torch, opt)
        root = hvd.broadcast_object(mine if r == 0 else None, 0, name=f"o.{name}")
        check(f"broadcast_optimizer_state {name}", mine == root, f"{mine}\n!=\n{root}")
    obj = {"a": [1, 2], "f": (lambda v: v + 1)} if r == 0 else None
    got = hvd.broadcast_object(obj, 0)
    check("broadcast_object with None elsewhere", got["a"] == [1, 2] and got["f"](1) == 2)
    got = hvd.allgather_object({"rank": r})
    check("allgather_object", got == [{"rank": q} for q in range(ringflow.size())], got)


def _digest(torch: Any, opt: Any) -> str:
    state = opt.state_dict()
    parts = [repr(state["param_groups"])]
    for key in sorted(state["state"]):
        for k, v in sorted(state["state"][key].items()):
            if torch.is_tensor(v):
                v = v.to_dense() if v.is_sparse else v
                v = (str(v.dtype), tuple(v.shape), np.round(v.double().numpy(), 12).tolist())
            parts.append(f"{key}.{k}={v!r}")
    return "\n".join(parts)


# point to point ----------------------------------------------------------------------------------
def _recv(fw: Any, src: int, tag: int, **kwargs: Any) -> Any:
    """The adapter's recv with numpy ``dtype=`` turned into the framework's dtype."""
    if "dtype" in kwargs:
        dtype = np.dtype(kwargs["dtype"]).name
        kwargs["dtype"] = (getattr(fw.torch, dtype) if isinstance(fw, Torch)
                           else fw.tf.as_dtype(dtype))
    return fw.hvd.recv(src, tag=tag, **kwargs)


def ring_exchange(fw: Any, a: Any, tag: int) -> Any:
    """Send ``a`` to the next rank and receive the previous rank's: even ranks send first, odd
    ranks receive first (a send waits for its receive). Returns ``2 * received + token``."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        token = hvd.send(a, nxt, tag=tag)
        b = _recv(fw, prv, tag, dtype=np.float64)
    else:
        b = _recv(fw, prv, tag, dtype=np.float64)
        token = hvd.send(a, nxt, tag=tag)
    return b * 2 + token


def point_to_point(fw: Any) -> None:
    """A differentiable ring exchange in closed form; a mismatch fails both ranks; the
    asynchronous forms; the next operation works."""
    hvd, r, n = fw.hvd, ringflow.rank(), ringflow.size()
    prv = (r - 1) % n
    x = np.arange(6.0).reshape(2, 3) + 10 * r
    got = fw.call(lambda a: ring_exchange(fw, a, 1), x)
    equal("p2p ring: values", got, 2 * (np.arange(6.0).reshape(2, 3) + 10 * prv))
    (g,) = fw.grad(lambda a: ring_exchange(fw, a, 2), [x], r + 1.0)
    # rank r's tensor went to rank r+1, whose loss weighs it 2 * (r + 2)
    equal("p2p ring: gradient comes back from the receiver", g,
          np.full((2, 3), 2.0 * ((r + 1) % n + 1)))
    if r in (0, 1):  # a size mismatch fails the send and the receive
        if r == 0:
            expect_failure(fw, "p2p mismatch (sender)", ("MismatchError",),
                           "rank 0 sent 5 elements of float64 (shape (5,)), rank 1 expected 4",
                           lambda t: hvd.send(t, 1, tag=3), np.ones(5))
            fw.call(lambda t: hvd.send(t, 1, tag=3), np.arange(4.0))
        else:
            expect_failure(fw, "p2p mismatch (receiver)", ("MismatchError",),
                           "rank 0 sent 5 elements of float64 (shape (5,)), rank 1 expected 4",
                           lambda t: _recv(fw, 0, 3, shape=(4,), dtype=np.float64) + t,
                           np.zeros(4))
            got = fw.call(lambda t: _recv(fw, 0, 3, shape=(4,), dtype=np.float64) + t,
                          np.zeros(4))
            equal("p2p: the next message after a mismatch", got, np.arange(4.0))
    for name in ("bool", "uint8", "int8", "uint16", "int16", "int32", "int64", "float16",
                 "bfloat16", "float32", "float64"):  # every dtype both frameworks move
        def exchange(a: Any, name: str = name) -> Any:
            dtype = getattr(fw.torch, name) if isinstance(fw, Torch) else fw.tf.as_dtype(name)
            a = a.to(dtype) if isinstance(fw, Torch) else fw.tf.cast(a, dtype)
            if r % 2 == 0:
                hvd.send(a, (r + 1) % n, tag=5)
                b = hvd.recv(prv, tag=5, dtype=dtype)
            else:
                b = hvd.recv(prv, tag=5, dtype=dtype)
                hvd.send(a, (r + 1) % n, tag=5)
            return b.to(fw.torch.int64) if isinstance(fw, Torch) else fw.tf.cast(b, fw.tf.int64)

        got = fw.call(exchange, (np.arange(7) * 3 + r) % 2 if name == "bool" else
                      np.arange(7) * 3 + r)
        want = (np.arange(7) * 3 + prv) % 2 if name == "bool" else np.arange(7) * 3 + prv
        equal(f"p2p ring: {name}", got, want)
    if not fw.graph:  # handles (torch.distributed's Work): is_completed(), wait()
        work = hvd.isend(fw.t(np.full(3, r, np.int32)), (r + 1) % n, tag=4)
        got = hvd.irecv(prv, tag=4).wait()
        work.wait()
        check("p2p isend: is_completed after wait", work.is_completed())
        equal("p2p irecv", fw.np(got), np.full(3, prv, np.int32))
    still_works(fw, "p2p")


def model_parallel(fw: Any) -> None:
    """A pipeline over every rank (stage k on rank k, activations sent forward, gradients back):
    each rank's parameter gradients equal those of the whole model on one process."""
    r, n = ringflow.rank(), ringflow.size()
    rng = np.random.default_rng(7)
    widths = [4] + [3 + k % 2 for k in range(n)]
    weights = [rng.standard_normal((widths[k], widths[k + 1])) * 0.5 for k in range(n)]
    x = rng.standard_normal((5, 4))
    y = rng.standard_normal((5, widths[-1]))
    if isinstance(fw, Torch):
        torch, hvd = fw.torch, fw.hvd
        ws = [torch.tensor(w, requires_grad=True) for w in weights]
        h = torch.tensor(x)
        for w in ws:
            h = torch.tanh(h @ w)
        torch.mean((h - torch.tensor(y)) ** 2).backward()
        want = ws[r].grad.numpy()
        w = torch.tensor(weights[r], requires_grad=True)
        h = torch.tensor(x) if r == 0 else hvd.recv(r - 1, tag=30)
        check("model parallel: the received activation requires grad", r == 0 or h.requires_grad)
        h = torch.tanh(h @ w)
        if r == n - 1:
            torch.mean((h - torch.tensor(y)) ** 2).backward()
        else:
            hvd.send(h, r + 1, tag=30).backward()
        equal("model parallel: stage gradient equals the single-process one", w.grad.numpy(),
              want, 1e-12)
        return
    tf, hvd = fw.tf, fw.hvd
    ws = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        h = tf.constant(x)
        for w in ws:
            h = tf.tanh(h @ w)
        loss = tf.reduce_mean((h - y) ** 2)
    want = tape.gradient(loss, ws[r]).numpy()
    w = tf.Variable(weights[r])

    def step() -> Any:
        with tf.GradientTape() as tape:
            h = tf.constant(x) if r == 0 else hvd.recv(r - 1, tag=30, dtype=tf.float64)
            h = tf.tanh(h @ w)
            target = tf.reduce_mean((h - y) ** 2) if r == n - 1 else hvd.send(h, r + 1, tag=30)
        return tape.gradient(target, w)

    got = (tf.function(step) if fw.graph else step)()
    equal("model parallel: stage gradient equals the single-process one", got.numpy(), want,
          1e-12)


# cross-framework ---------------------------------------------------------------------------------
def cross_point_to_point() -> None:
    """The ring exchange's forward values and gradients are equal in torch and TensorFlow."""
    tfw, thw = TF(graph=False), Torch()
    r = ringflow.rank()
    x = np.linspace(-1, 1, 6).reshape(3, 2) + r
    fwd_t = thw.call(lambda a: ring_exchange(thw, a, 40), x)
    fwd_f = tfw.call(lambda a: ring_exchange(tfw, a, 40), x)
    equal("send/recv: forward torch == tf", fwd_t, fwd_f)
    (gt,) = thw.grad(lambda a: ring_exchange(thw, a, 41), [x], r + 1.0)
    (gf,) = tfw.grad(lambda a: ring_exchange(tfw, a, 41), [x], r + 1.0)
    equal("send/recv: gradient torch == tf", gt, gf)
    check("send/recv: gradient is not zero", np.all(gt != 0), gt)


def cross() -> None:
    """Forward and gradients of every differentiable collective, equal in torch and TF."""
    tfw, thw = TF(graph=False), Torch()
    t, f = thw.hvd, tfw.hvd
    r, n = ringflow.rank(), ringflow.size()
    x = np.arange(2 * n * 3, dtype=np.float64).reshape(2 * n, 3) * 0.25 + r
    y = np.linspace(-1, 1, (r + 2) * 2).reshape(r + 2, 2) + r  # allgather: rows differ
    splits = [(q + r) % 3 for q in range(n)]
    z = np.ones((sum(splits), 2)) * (r + 1)
    cases: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[np.ndarray]]] = {}
    for op in ("Sum", "Average", "Min", "Max"):
        cases[f"allreduce {op}"] = (
            lambda a, op=op, h=t: h.allreduce(a, op=getattr(h, op), name=f"x.ar.{op}",
                                              prescale_factor=0.5, postscale_factor=3.0),
            lambda a, op=op, h=f: h.allreduce(a, op=getattr(h, op), name=f"x.ar.{op}",
                                              prescale_factor=0.5, postscale_factor=3.0), [x])
    cases["grouped_allreduce"] = (
        lambda a, b: t.grouped_allreduce([a, b], op=t.Sum, name="x.gar"),
        lambda a, b: f.grouped_allreduce([a, b], op=f.Sum, name="x.gar"), [x, x[0]])
    cases["allgather"] = (lambda a: t.allgather(a, name="x.ag"),
                          lambda a: f.allgather(a, name="x.ag"), [y])
    cases["grouped_allgather"] = (lambda a, b: t.grouped_allgather([a, b], name="x.gag"),
                                  lambda a, b: f.grouped_allgather([a, b], name="x.gag"), [y, x])
    for root in range(n):
        cases[f"broadcast root {root}"] = (
            lambda a, root=root: t.broadcast(a, root, name=f"x.bc{root}"),
            lambda a, root=root: f.broadcast(a, root, name=f"x.bc{root}"), [x])
    cases["alltoall"] = (lambda a: t.alltoall(a, splits=splits, name="x.a2a")[0],
                         lambda a: f.alltoall(a, splits=splits, name="x.a2a")[0], [z])
    for op in ("Sum", "Average"):
        cases[f"reducescatter {op}"] = (
            lambda a, op=op: t.reducescatter(a, op=getattr(t, op), name=f"x.rs.{op}",
                                             prescale_factor=2.0),
            lambda a, op=op: f.reducescatter(a, op=getattr(f, op), name=f"x.rs.{op}",
                                             prescale_factor=2.0), [x])
    cases["grouped_reducescatter"] = (
        lambda a, b: t.grouped_reducescatter([a, b], op=t.Sum, name="x.grs"),
        lambda a, b: f.grouped_reducescatter([a, b], op=f.Sum, name="x.grs"), [x, x])
    for what, (tfn, ffn, xs) in cases.items():
        fwd_t, fwd_f = thw.call(tfn, *xs), tfw.call(ffn, *xs)
        for a, b in zip(_listed(fwd_t), _listed(fwd_f), strict=True):
            equal(f"{what}: forward torch == tf", a, b, 1e-12)
        gt = thw.grad(tfn, xs, r + 1.0)
        gf = tfw.grad(ffn, xs, r + 1.0)
        for i, (a, b) in enumerate(zip(gt, gf, strict=True)):
            equal(f"{what}: gradient {i} torch == tf", a, b, 1e-12)
            check(f"{what}: gradient {i} is not zero everywhere",
                  what.startswith(("allreduce Min", "allreduce Max", "broadcast"))
                  or np.any(a != 0), a)


def _listed(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


def run_mode(mode: str) -> None:
    if mode == "cross":
        section("cross", cross)
        section("cross point to point", cross_point_to_point)
        return
    fw = Torch() if mode == "torch" else TF(graph=mode == "tf-function")
    section("errors", lambda: errors_are_horovods(fw))
    if mode == "torch":
        section("duplicate names", lambda: duplicate_names(fw))
        section("optimizer state", lambda: optimizer_state(fw))
    section("global root", lambda: global_root(fw))
    section("sparse", lambda: sparse(fw))
    section("reducescatter and scaling", lambda: reducescatter_rules(fw))
    section("adasum", lambda: adasum(fw))
    section("join", lambda: join(fw))
    section("point to point", lambda: point_to_point(fw))
    section("model parallel", lambda: model_parallel(fw))


def main() -> None:
    first = MODES[0]
    fw_hvd = (Torch() if first in ("torch", "cross") else TF(graph=False)).hvd
    fw_hvd.init()
    r = ringflow.rank()
    failed = 0
    for mode in MODES:
        PASSED.clear()
        FAILURES.clear()
        run_mode(mode)
        if FAILURES:
            failed += 1
            sys.stderr.write(f"rank {r}: {mode}: {len(FAILURES)} failed checks\n"
                             + "\n".join(FAILURES) + "\n")
        else:
            print(f"PASS {mode}: {len(PASSED)} checks (rank {r})", flush=True)
    fw_hvd.shutdown()
    faulthandler.cancel_dump_traceback_later()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
