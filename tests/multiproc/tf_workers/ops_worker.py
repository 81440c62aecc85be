"""ringflow.tensorflow collectives, gradients, tapes and helpers, eager and in tf.function.

Run as ``ringflow-run -np N python ops_worker.py`` (any N >= 1). Rank r contributes r+1, so the
expected values are closed forms in n: sum n(n+1)/2, mean (n+1)/2, min 1, max n, product n!.
"""

from __future__ import annotations

import math

from common import check, close, finish, np, run, tf

import ringflow.tensorflow as hvd
from ringflow.errors import MismatchError, TensorError

hvd.init()
r, n = hvd.rank(), hvd.size()
SUM, MEAN = n * (n + 1) / 2, (n + 1) / 2
MODES = {"eager": lambda f: f, "graph": tf.function}


def both(label: str, body: object) -> None:
    """Run ``body(wrap)`` eagerly and with tf.function-wrapped callables."""
    for mode, wrap in MODES.items():
        run(f"{label}[{mode}]", lambda wrap=wrap, mode=mode: body(wrap, mode))


def basics() -> None:
    check("rank/size", 0 <= r < n and hvd.local_size() >= 1 and hvd.is_initialized())
    check("rank_op", int(hvd.rank_op()) == r and int(hvd.size_op()) == n)
    check("local ops", int(hvd.local_rank_op()) == hvd.local_rank()
          and int(hvd.local_size_op()) == hvd.local_size())


def allreduce(wrap, mode) -> None:
    x = tf.fill([3, 2], float(r + 1))
    ops = {hvd.Average: MEAN, hvd.Sum: SUM, hvd.Min: 1, hvd.Max: n,
           hvd.Product: math.factorial(n)}
    f = wrap(lambda x: [hvd.allreduce(x, op=op) for op in ops])
    for (op, want), got in zip(ops.items(), f(x), strict=True):
        close(f"allreduce {op.name} {mode}", got, np.full([3, 2], want))
    g = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                                     name="scaled"))
    close(f"allreduce scale factors {mode}", g(x), np.full([3, 2], SUM))
    check(f"allreduce static shape {mode}", g(x).shape == (3, 2))
    scalar = wrap(lambda: [hvd.allreduce(tf.constant(float(r + 1)), op=hvd.Sum, name="scalar"),
                           hvd.broadcast(tf.constant(r + 1), 0, name="scalar_b")])()
    check(f"scalar allreduce/broadcast keep shape () {mode}",
          scalar[0].shape == () and scalar[1].shape == (), [s.shape for s in scalar])
    close(f"scalar allreduce {mode}", scalar[0], SUM)
    for dtype in (tf.float64, tf.int32, tf.float16, tf.bfloat16):
        got = wrap(lambda x, d=dtype: hvd.allreduce(tf.cast(x, d), op=hvd.Sum))(x)
        check(f"allreduce dtype {dtype.name} {mode}", got.dtype == dtype, got.dtype)
        close(f"allreduce {dtype.name} {mode}", tf.cast(got, tf.float64), np.full([3, 2], SUM))
    for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
        got = wrap(lambda x, c=comp: hvd.allreduce(x, compression=c))(x)
        check(f"compression {comp.name} keeps dtype {mode}", got.dtype == tf.float32)
        close(f"compression {comp.name} {mode}", got, np.full([3, 2], MEAN), atol=1e-2)

    class HalfCompressor:  # a user-written TF compressor (Horovod's interface)
        @staticmethod
        def compress(t):
            return tf.cast(t, tf.float16), t.dtype

        @staticmethod
        def decompress(t, ctx):
            return tf.cast(t, ctx)

    got = wrap(lambda x: hvd.allreduce(x, compression=HalfCompressor))(x)
    close(f"custom compressor {mode}", got, np.full([3, 2], MEAN), atol=1e-2)
    gl = wrap(lambda x: hvd.grouped_allreduce([x, 2 * x, tf.ones([5]) * (r + 1)], op=hvd.Sum))(x)
    close(f"grouped_allreduce {mode}", gl[1], np.full([3, 2], 2 * SUM))
    close(f"grouped_allreduce 3rd {mode}", gl[2], np.full([5], SUM))


def sparse(wrap, mode) -> None:
    rows = tf.constant([r % 3, 4], tf.int64)
    slices = tf.IndexedSlices(tf.fill([2, 3], float(r + 1)), rows, tf.constant([5, 3], tf.int64))
    for op, scale in ((hvd.Average, 1 / n), (hvd.Sum, 1.0)):
        out = wrap(lambda s, op=op: hvd.allreduce(s, op=op))(slices)
        check(f"sparse stays IndexedSlices {op.name} {mode}", isinstance(out, tf.IndexedSlices))
        want = np.zeros([5, 3])
        for q in range(n):
            want[[q % 3, 4]] += (q + 1) * scale
        close(f"sparse allreduce {op.name} {mode}", tf.convert_to_tensor(out), want)


def allgather(wrap, mode) -> None:
    x = tf.fill([r + 1, 2], float(r))
    got = wrap(lambda x: hvd.allgather(x))(x)
    want = np.concatenate([np.full([q + 1, 2], q) for q in range(n)])
    close(f"allgather uneven {mode}", got, want)
    gg = wrap(lambda x: hvd.grouped_allgather([x, tf.cast(x[:, :1], tf.int64) + 1]))(x)
    close(f"grouped_allgather {mode}", gg[1], want[:, :1] + 1)
    check(f"grouped_allgather dtype {mode}", gg[1].dtype == tf.int64)
    close(f"allgather scalar {mode}", wrap(lambda: hvd.allgather(tf.constant(r)))(),
          np.arange(n))


def broadcast(wrap, mode) -> None:
    x = tf.fill([4], float(r + 1))
    for root in sorted({0, n - 1}):
        got = wrap(lambda x, root=root: hvd.broadcast(x, root))(x)
        close(f"broadcast root {root} {mode}", got, np.full([4], root + 1))


def alltoall(wrap, mode) -> None:
    # Uneven splits that differ between ranks: rank q sends q + d + 1 rows of 100q + d to rank d.
    splits = [r + d + 1 for d in range(n)]
    x = tf.constant(np.concatenate([np.full((s, 1), 100.0 * r + d, np.float32)
                                    for d, s in enumerate(splits)]))
    out, received = wrap(lambda x: hvd.alltoall(x, splits=splits))(x)
    want = np.concatenate([np.full((q + r + 1, 1), 100.0 * q + r, np.float32) for q in range(n)])
    close(f"alltoall uneven {mode}", out, want)
    close(f"alltoall uneven received splits {mode}", received, [q + r + 1 for q in range(n)])
    # Each rank sends 2 rows to every rank.
    x = tf.reshape(tf.range(2 * n, dtype=tf.float32) + 100 * r, [2 * n, 1])
    got = wrap(lambda x: hvd.alltoall(x))(x)
    want = np.concatenate([100 * q + np.arange(2 * r, 2 * r + 2) for q in range(n)])[:, None]
    close(f"alltoall even {mode}", got, want)
    out, received = wrap(lambda x: hvd.alltoall(x, splits=[2] * n))(x)
    close(f"alltoall splits {mode}", out, want)
    close(f"alltoall received splits {mode}", received, [2] * n)


def reducescatter(wrap, mode) -> None:
    rows = 2 * n + 1
    x = tf.fill([rows, 2], float(r + 1))
    mine = rows // n + (1 if r < rows % n else 0)
    got = wrap(lambda x: hvd.reducescatter(x))(x)
    close(f"reducescatter average {mode}", got, np.full([mine, 2], MEAN))
    got = wrap(lambda x: hvd.reducescatter(x, op=hvd.Sum))(x)
    close(f"reducescatter sum {mode}", got, np.full([mine, 2], SUM))
    gs = wrap(lambda x: hvd.grouped_reducescatter([x, x[:, :1] * 2], op=hvd.Sum))(x)
    close(f"grouped_reducescatter {mode}", gs[1], np.full([mine, 1], 2 * SUM))


def gradients(wrap, mode) -> None:
    def grad_of(fn, x):
        def g(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return tape.gradient(y, x)

        return wrap(g)(x)

    x = tf.fill([3], float(r + 1))
    close(f"grad allreduce sum {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum)), x), np.full([3], n))
    close(f"grad allreduce average {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.allreduce(x)), x), np.ones([3]))
    close(f"grad grouped_allreduce {mode}",
          grad_of(lambda x: tf.add_n([tf.reduce_sum(t) for t in hvd.grouped_allreduce(
              [x, 3 * x], op=hvd.Sum)]), x), np.full([3], 4 * n))
    xr = tf.fill([r + 1, 2], 1.0)
    close(f"grad allgather {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.allgather(x) * (r + 1)), xr),
          np.full([r + 1, 2], MEAN))
    close(f"grad grouped_allgather {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.grouped_allgather([x, x])[1] * (r + 1)), xr),
          np.full([r + 1, 2], MEAN))
    close(f"grad broadcast {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.broadcast(x, 0) * (r + 1)), x),
          np.full([3], MEAN if r == 0 else 0.0))
    xa = tf.ones([2 * n])
    close(f"grad alltoall {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.alltoall(x) * (r + 1)), xa),
          np.repeat(np.arange(1, n + 1), 2))
    rows = 2 * n + 1
    bounds = [0]
    for q in range(n):
        bounds.append(bounds[-1] + rows // n + (1 if q < rows % n else 0))
    block = np.concatenate([np.full(bounds[q + 1] - bounds[q], q + 1.0) for q in range(n)])
    xs = tf.ones([rows])
    close(f"grad reducescatter sum {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum) * (r + 1)), xs),
          n * block)
    close(f"grad reducescatter average {mode}",
          grad_of(lambda x: tf.reduce_sum(hvd.reducescatter(x) * (r + 1)), xs), block)


def _data(n_rows: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n_rows, 4).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def tape_equivalence(wrap, mode) -> None:
    """n ranks with batch B reach the weights of one process with batch n*B."""
    batch, steps = 8, 6
    x, y = _data(batch * n * steps)
    init = [np.full([4, 1], 0.1, np.float32), np.zeros([1], np.float32)]

    def train(distributed: bool, as_context: bool = False, **tape_kw):
        w, b = tf.Variable(init[0]), tf.Variable(init[1])
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.5)

        def step(xb, yb):
            if as_context:
                with hvd.DistributedGradientTape(tf.GradientTape(), **tape_kw) as tape:
                    loss = tf.reduce_mean(tf.square(xb @ w + b - yb))
            else:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(xb @ w + b - yb))
                if distributed:
                    tape = hvd.DistributedGradientTape(tape, **tape_kw)
            grads = tape.gradient(loss, [w, b])
            opt.apply_gradients(zip(grads, [w, b], strict=True))
            return loss

        step = wrap(step)
        for s in range(steps):
            lo = s * batch * n
            if distributed:
                lo += r * batch
                step(x[lo:lo + batch], y[lo:lo + batch])
            else:
                step(x[lo:lo + batch * n], y[lo:lo + batch * n])
        return [w.numpy(), b.numpy()]

    ref = train(False)
    for label, kw in (("plain", {}), ("context", {"as_context": True}),
                      ("num_groups", {"num_groups": 2}),
                      ("predivide", {"gradient_predivide_factor": 2.0})):
        got = train(True, **kw)
        close(f"tape equivalence {label} W {mode}", got[0], ref[0], atol=1e-5)
        close(f"tape equivalence {label} b {mode}", got[1], ref[1], atol=1e-5)
    got = train(True, compression=hvd.Compression.fp16)
    close(f"tape equivalence fp16 {mode}", got[0], ref[0], atol=2e-2, rtol=1e-2)


def tape_variants(wrap, mode) -> None:
    w = tf.Variable(tf.ones([3]))
    emb = tf.Variable(tf.ones([5, 2]))
    local = tf.keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    local.build((None, 3))

    def grads(kind):
        def f():
            with tf.GradientTape() as tape:
                picked = tf.gather(emb, [r % 5, 4])  # IndexedSlices gradient
                loss = (tf.reduce_sum(w * (r + 1)) + tf.reduce_sum(picked) * (r + 1)
                        + tf.reduce_sum(local(tf.ones([1, 3]) * (r + 1))))
            if kind == "partial":
                tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
            else:
                tape = hvd.DistributedGradientTape(tape, sparse_as_dense=kind == "dense",
                                                   groups=[[w]] if kind == "groups" else None)
            gw, gemb, gl = tape.gradient(loss, [w, emb, local.kernel])
            return gw, tf.convert_to_tensor(gemb), gl, isinstance(gemb, tf.IndexedSlices)

        return wrap(f)()

    want_emb = np.zeros([5, 2])
    for q in range(n):
        want_emb[[q % 5, 4]] += (q + 1) / n
    for kind in ("sparse", "dense", "groups", "partial"):
        gw, gemb, gl, was_sparse = grads(kind)
        close(f"tape {kind} dense grad {mode}", gw, np.full([3], MEAN))
        close(f"tape {kind} sparse grad {mode}", gemb, want_emb)
        if kind in ("sparse", "groups", "partial"):
            check(f"tape {kind} keeps IndexedSlices {mode}", bool(was_sparse))
        if kind == "dense":
            check(f"tape sparse_as_dense densifies {mode}", not bool(was_sparse))
        want_local = (r + 1) / n if kind == "partial" else MEAN
        close(f"tape {kind} local grad {mode}", gl, np.full([3, 1], want_local))


def objects() -> None:
    obj = hvd.broadcast_object({"rank": r, "list": list(range(r + 3))} if r == 0 else None, 0)
    check("broadcast_object", obj == {"rank": 0, "list": [0, 1, 2]}, obj)
    fn = hvd.broadcast_object_fn(root_rank=n - 1)
    check("broadcast_object_fn", fn(("x", r)) == ("x", n - 1))
    gathered = hvd.allgather_object({"r": r, "pad": "x" * r})
    check("allgather_object", gathered == [{"r": q, "pad": "x" * q} for q in range(n)], gathered)
    v = [tf.Variable(tf.fill([3], float(r))), tf.Variable(tf.fill([2, 2], r + 10.0)),
         tf.Variable(r, dtype=tf.int64)]
    hvd.broadcast_variables(v, root_rank=n - 1)
    close("broadcast_variables eager", v[1], np.full([2, 2], n + 9.0))
    check("broadcast_variables scalar", int(v[2].numpy()) == n - 1 and v[2].shape == ())
    v2 = tf.Variable(tf.fill([3], float(r)))
    @tf.function
    def bcast():
        hvd.broadcast_variables([v2], 0)

    bcast()
    close("broadcast_variables graph", v2, np.zeros([3]))
    v3 = tf.Variable(tf.fill([2], float(r)))
    hvd.broadcast_([v3], 0)
    close("broadcast_", v3, np.zeros([2]))
    try:
        tf.function(lambda: hvd.broadcast_object(1), autograph=False)()
    except TensorError as exc:
        check("broadcast_object in tf.function raises", "tf.function" in str(exc))
    else:
        check("broadcast_object in tf.function raises", False, "no error")


def sync_batch_norm() -> None:
    rows = [q + 2 for q in range(n)]  # unequal batches: statistics must weight by rows
    rng = np.random.RandomState(1)
    full = rng.randn(sum(rows), 3).astype(np.float32) * 2 + 1
    lo = sum(rows[:r])
    mine = full[lo:lo + rows[r]]
    sbn = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    bn = tf.keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3)
    for wrap_name, wrap in MODES.items():
        out = wrap(lambda t: sbn(t, training=True))(tf.constant(mine))
        ref = bn(tf.constant(full), training=True)[lo:lo + rows[r]]
        close(f"sync batch norm output {wrap_name}", out, ref, atol=1e-4)
    close("sync batch norm moving mean", sbn.moving_mean, bn.moving_mean, atol=1e-4)
    close("sync batch norm moving variance", sbn.moving_variance, bn.moving_variance, atol=1e-4)

    xt = tf.constant(mine)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        loss = tf.reduce_sum(sbn(xt, training=True) ** 3)
    gx = tape.gradient(loss, xt)
    xf = tf.constant(full)
    with tf.GradientTape() as tape:
        tape.watch(xf)
        loss = tf.reduce_sum(bn(xf, training=True) ** 3)
    close("sync batch norm input gradient", gx, tape.gradient(loss, xf)[lo:lo + rows[r]],
          atol=1e-3, rtol=1e-3)


def process_sets() -> None:
    everyone = hvd.add_process_set(list(range(n)))
    got = hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum, process_set=everyone)
    close("process set allreduce", got, [SUM])
    got = tf.function(lambda: hvd.allgather(tf.constant([r]), process_set=everyone))()
    close("process set allgather graph", got, np.arange(n))
    check("process set size_op", int(hvd.size_op(everyone.process_set_id)) == n)
    solo = hvd.add_process_set([0])
    if r == 0:
        close("singleton set allreduce", hvd.allreduce(tf.constant([5.0]), process_set=solo),
              [5.0])
    hvd.barrier()
    hvd.remove_process_set(solo)
    hvd.remove_process_set(everyone)


def join_and_barrier() -> None:
    hvd.barrier()
    @tf.function
    def graph_barrier():
        hvd.barrier()

    graph_barrier()
    if r == 0:
        got = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum, name="only_rank0")
        close("allreduce while others joined", got, [1.0, 2.0])
    last = hvd.join()
    check("join returns last rank", int(last) == 0, int(last))
    last = tf.function(lambda: hvd.join())()
    check("join in tf.function", 0 <= int(last) < n, int(last))


def errors() -> None:
    try:
        hvd.allreduce(tf.zeros([r + 1]), name="shape_mismatch")
    except MismatchError as exc:
        check("mismatch names the tensor", "shape_mismatch" in str(exc), exc)
    except Exception as exc:
        check("mismatch names the tensor", n == 1, repr(exc))
    else:
        check("mismatch names the tensor", n == 1, "no error")
    try:
        hvd.allreduce(tf.constant(["text"]), name="strings")
    except TensorError as exc:
        check("string tensor rejected on every rank", "strings" in str(exc) or "dtype" in str(exc))
    except Exception as exc:
        check("string tensor rejected on every rank", False, repr(exc))
    else:
        check("string tensor rejected on every rank", False, "no error")


run("basics", basics)
both("allreduce", allreduce)
both("sparse", sparse)
both("allgather", allgather)
both("broadcast", broadcast)
both("alltoall", alltoall)
both("reducescatter", reducescatter)
both("gradients", gradients)
both("tape_equivalence", tape_equivalence)
both("tape_variants", tape_variants)
run("objects", objects)
run("sync_batch_norm", sync_batch_norm)
run("process_sets", process_sets)
run("join_and_barrier", join_and_barrier)
run("errors", errors)
finish(r)
