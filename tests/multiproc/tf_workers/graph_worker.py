"""What Horovod's own TensorFlow tests rely on beyond ops_worker.py: TF1 graph mode (a tf.Graph run
by a Session, as ``run_all_in_graph_and_eager_modes`` runs every Horovod test) and the
``tf.errors`` class of each failed collective, eagerly, in ``tf.function`` and in a session.

Run as ``ringflow-run -np N python graph_worker.py`` (any N >= 2). Rank r contributes r+1 where a
value is reduced.
"""

from __future__ import annotations

from common import check, close, finish, np, run, tf

import ringflow.tensorflow as hvd
from ringflow.errors import MismatchError, TensorError

hvd.init()
r, n = hvd.rank(), hvd.size()


def session(fn):
    """``fn`` built into a fresh TF1 graph and evaluated by a Session (Horovod's graph mode)."""
    def call(*args):
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            return sess.run(fn(*[tf.constant(np.asarray(a)) for a in args]))
    return call


MODES = {"eager": lambda f: f, "tf.function": tf.function, "session": session}


def each_mode(label: str, body: object) -> None:
    for mode, wrap in MODES.items():
        run(f"{label}[{mode}]", lambda wrap=wrap, mode=mode: body(wrap, mode))


# errors --------------------------------------------------------------------------------------
def raises(what: str, tf_cls: type, ours: type, fragment: str, fn: object, mode: str) -> None:
    """``fn()`` fails with Horovod's tf.errors class; eagerly it is ringflow's class too."""
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:
        ok = isinstance(exc, tf_cls) and fragment in str(exc)
        if mode == "eager":
            ok = ok and isinstance(exc, ours) and isinstance(exc, hvd.HorovodInternalError)
        check(f"{what} [{mode}]", ok, f"{type(exc).__mro__[:3]}: {str(exc)[-300:]}")
    else:
        check(f"{what} [{mode}]", False, "no error")


def still_works(what: str, wrap, mode: str) -> None:
    got = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, name=f"{what}.after.{mode}"))(
        np.full([2], r + 1.0))
    close(f"{what}: the next operation works [{mode}]", got, np.full([2], n * (n + 1) / 2))


def errors(wrap, mode: str) -> None:
    fp, ia = tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError
    x = np.ones([3], np.int32 if r == 0 else np.float32)
    raises("dtype mismatch: FailedPreconditionError", fp, MismatchError, "dtype of tensor",
           lambda: wrap(lambda t: hvd.allreduce(t, name=f"dtype.{mode}"))(x), mode)
    still_works("dtype", wrap, mode)
    x = np.ones([2, 3 + r], np.float32)
    raises("allgather shape mismatch: FailedPreconditionError", fp, MismatchError, "shape",
           lambda: wrap(lambda t: hvd.allgather(t, name=f"gather.{mode}"))(x), mode)
    still_works("gather", wrap, mode)
    raises("broadcast roots differ: FailedPreconditionError", fp, MismatchError, "root",
           lambda: wrap(lambda t: hvd.broadcast(t, r, name=f"roots.{mode}"))(np.ones(2)), mode)
    still_works("roots", wrap, mode)
    raises("alltoall splits length: InvalidArgumentError", ia, TensorError, "one per rank",
           lambda: wrap(lambda t: hvd.alltoall(t, splits=[1] * (n + 1), name=f"splits.{mode}"))(
               np.ones([n + 1, 2], np.float32)), mode)
    still_works("splits", wrap, mode)
    raises("alltoall rows not a multiple: InvalidArgumentError", ia, TensorError,
           "not an even multiple",
           lambda: wrap(lambda t: hvd.alltoall(t, name=f"even.{mode}"))(
               np.ones([n + 1], np.float32)), mode)
    still_works("even", wrap, mode)


# sparse and compression ------------------------------------------------------------------------
def sparse_integer_average(wrap, mode: str) -> None:
    """Horovod divides the gathered values: integer values average to floating point."""
    def average(values):
        out = hvd.allreduce(tf.IndexedSlices(values, tf.constant([r, r + 1])), op=hvd.Average)
        return tf.math.unsorted_segment_sum(out.values, out.indices, n + 1)

    got = wrap(average)(np.full([2, 3], 2 * (r + 1), np.int32))
    want = np.zeros([n + 1, 3])
    for q in range(n):
        want[[q, q + 1]] += 2 * (q + 1) / n
    check(f"sparse integer average is floating [{mode}]", np.asarray(got).dtype == np.float64,
          np.asarray(got).dtype)
    close(f"sparse integer average [{mode}]", got, want)


def compression(wrap, mode: str) -> None:
    def roundtrip(x):
        half, ctx = hvd.Compression.fp16.compress(x)
        assert half.dtype == tf.float16
        return hvd.Compression.fp16.decompress(half, ctx)

    got = wrap(roundtrip)(np.full([4], 1.5))
    check(f"fp16 compression round trip [{mode}]", np.asarray(got).dtype == np.float64)
    close(f"fp16 compression values [{mode}]", got, np.full([4], 1.5))


# TF1 graph mode --------------------------------------------------------------------------------
def broadcast_gradient_in_a_session() -> None:
    """Off the root the gradient is zeros that still depend on the gradient's allreduce: when
    they did not, session.run pruned that rank's collectives and the root waited forever."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        for root in range(n):
            for dim in (1, 2):
                x = tf.ones([5] * dim) * r
                y = hvd.broadcast(x, root)
                grad = tf.gradients(y, x, tf.ones([5] * dim))[0]
                close(f"broadcast gradient, root {root}, dim {dim}", sess.run(grad),
                      np.full([5] * dim, 1.0 if r == root else 0.0))


def graph_names_are_the_same_on_every_rank() -> None:
    """Op names (and so the names ranks match collectives by) come from the graph's unique
    names; gradients that differ by rank (the broadcast's) create ops in their own scope only."""
    with tf.Graph().as_default() as graph:
        for root in range(n):
            x = tf.ones([3]) * r
            tf.gradients(hvd.broadcast(x, root), x)
            tf.gradients(hvd.allreduce(x * 2), x)
            hvd.allgather(tf.reshape(x, [1, 3]))
        names = [op.name for op in graph.get_operations() if op.type == "EagerPyFunc"]
    everyone = hvd.allgather_object(names)
    check("graph op names equal on every rank", all(v == names for v in everyone),
          [v[:6] for v in everyone])


def collectives_of_earlier_runs_fetched_again() -> None:
    """A TF1 graph's collectives are one chain in trace order across session.run calls, so a run
    that fetches earlier collectives again with a new one (Horovod's fused tests) runs them in
    that order on every rank. Starting a new chain after each run deadlocked here: independent
    blocking ops, scheduled differently by rank, once they take every executor thread."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2)
    with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as sess:
        outs = []
        for i in range(12):
            outs.append(hvd.allgather(tf.fill([1, 2], float(r + i))))
            got = sess.run(outs)
            close(f"earlier collectives fetched again, step {i}", got,
                  [np.repeat(np.arange(n, dtype=np.float64) + j, 2).reshape(n, 2)
                   for j in range(i + 1)])


def inplace_broadcast_in_a_session() -> None:
    from tensorflow.python.ops import resource_variable_ops
    from tensorflow.python.ops.ref_variable import RefVariable

    for kind, make in (("resource", resource_variable_ops.ResourceVariable),
                       ("ref", RefVariable)):
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            v = make(tf.fill([2, 3], float(r + 1)))
            sess.run(tf.compat.v1.global_variables_initializer())
            out, = hvd.broadcast_([v], n - 1)
            check(f"broadcast_ returns tensors in a graph ({kind})",
                  isinstance(out, tf.Tensor) and out.dtype.base_dtype == tf.float32, type(out))
            close(f"broadcast_ value ({kind})", sess.run(out), np.full([2, 3], float(n)))
            close(f"broadcast_ assigned the variable ({kind})", sess.run(v),
                  np.full([2, 3], float(n)))


def global_variables_in_a_session() -> None:
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        a = tf.compat.v1.Variable(tf.fill([3], float(r)), name="a")
        b = tf.compat.v1.Variable(r + 10, name="b")
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))
        close("broadcast_global_variables", sess.run(a), np.zeros([3]))
        check("broadcast_global_variables int", int(sess.run(b)) == 10, sess.run(b))
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError as exc:
        check("broadcast_global_variables eagerly raises", "eager" in str(exc), exc)
    else:
        check("broadcast_global_variables eagerly raises", False, "no error")


def objects_in_a_graph() -> None:
    with tf.Graph().as_default(), tf.compat.v1.Session():
        obj = hvd.broadcast_object({"hello": 123, 0: [1, 2]} if r == 0 else {}, root_rank=0)
        check("broadcast_object in a TF1 graph", obj == {"hello": 123, 0: [1, 2]}, obj)
        got = hvd.allgather_object({"r": r})
        check("allgather_object in a TF1 graph", got == [{"r": q} for q in range(n)], got)


each_mode("errors", errors)
each_mode("sparse_integer_average", sparse_integer_average)
each_mode("compression", compression)
run("broadcast_gradient_in_a_session", broadcast_gradient_in_a_session)
run("graph_names_are_the_same_on_every_rank", graph_names_are_the_same_on_every_rank)
run("collectives_of_earlier_runs_fetched_again", collectives_of_earlier_runs_fetched_again)
run("inplace_broadcast_in_a_session", inplace_broadcast_in_a_session)
run("global_variables_in_a_session", global_variables_in_a_session)
run("objects_in_a_graph", objects_in_a_graph)
finish(r)
