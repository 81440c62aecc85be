"""What fp16/bf16 compression of a large CPU gradient costs, against the framework's own cast.

    python benchmarks/cast_cost.py [--framework torch|tensorflow] [--mib 100] [--rounds 9]
                                   [--threads 1]

Compression is the engine's packing of a float32 tensor into the fusion buffer of the wire dtype
(``Executor._pack``), decompression its unpacking into a new float32 output
(``executor.unpack``); both cast through :mod:`ringflow.devices.casts`, which uses the kernel of
the framework that is imported. Each round times, in alternating order (forward, then
reversed), for each wire dtype:

* ``own``: the framework's own cast of its tensor (``t.to(torch.float16)`` /
  ``tf.cast(t, tf.float16)``; back: ``h.to(torch.float32)`` / ``tf.cast(h, tf.float32)``), which
  allocates its result;
* ``into``: (torch only) the same kernel into a tensor allocated once (``b.copy_(t)``): the
  kernel's own speed, without the allocation and first touch that ``own`` pays;
* ``ringflow``: the executor's pack into its (reused) fusion buffer, and unpack;
* ``numpy``: numpy's / ml_dtypes' cast into the same buffer (the path before the kernels), and
  back into a new array.

Printed: the median time of each over the rounds, and the median of the per-round ratios
of each to ``own``. ``--threads`` is the framework's intra-op thread count (one rank
per core: 1). Each framework runs in its own process (``--framework``): with torch imported,
torch's kernel is the one used.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import records  # this directory's (a script's first path)

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _cases(framework: str, x: np.ndarray, threads: int) -> dict[str, dict[str, Callable]]:
    """wire name -> {case: function} for the compression and decompression of ``x``."""
    from ringflow.devices import casts
    from ringflow.executor import Entry, Executor, unpack

    n = x.size
    entry = Entry(None, x, None, None)  # type: ignore[arg-type]
    ref = (SimpleNamespace(shape=(n,)),)
    if framework == "torch":
        import torch

        torch.set_num_threads(threads)
        t = torch.from_numpy(x)
        own = {F16: torch.float16, BF16: torch.bfloat16}

        def own_cast(wire: np.dtype) -> Callable:
            return lambda: t.to(own[wire])

        def own_back(h: object) -> Callable:
            return lambda: h.to(torch.float32)  # type: ignore[attr-defined]

        def own_of(buf: np.ndarray) -> object:
            from ringflow.devices.torch_tensors import host_view

            return host_view(buf).clone()

        def into(wire: np.dtype) -> dict[str, Callable]:
            from ringflow.devices.torch_tensors import host_view

            b, h, o = torch.empty(n, dtype=own[wire]), host_view(np.ones(n, wire)), torch.empty(n)
            return {"compress into": lambda: b.copy_(t), "decompress into": lambda: o.copy_(h)}
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        t = tf.constant(x)
        own = {F16: tf.float16, BF16: tf.bfloat16}

        def own_cast(wire: np.dtype) -> Callable:
            return lambda: tf.cast(t, own[wire])

        def own_back(h: object) -> Callable:
            return lambda: tf.cast(h, tf.float32)

        def own_of(buf: np.ndarray) -> object:
            return tf.constant(buf)

        def into(wire: np.dtype) -> dict[str, Callable]:
            return {}

    cases: dict[str, dict[str, Callable]] = {}
    for wire in (F16, BF16):
        buf = np.empty(n, wire)
        Executor._pack(buf, [entry], [n], 1.0)
        kernel = casts.kernel_for(F32, wire)
        name = f"{wire.name} (kernel: {kernel[0] if kernel else 'numpy'})"
        cases[name] = {
            "compress own": own_cast(wire),
            "compress ringflow": lambda buf=buf: Executor._pack(buf, [entry], [n], 1.0),
            "compress numpy": lambda buf=buf: np.copyto(buf, x, casting="unsafe"),
            "decompress own": own_back(own_of(buf)),
            "decompress ringflow": lambda buf=buf: unpack(buf, ref, [entry]),  # type: ignore
            "decompress numpy": lambda buf=buf: np.copyto(np.empty(n, F32), buf,
                                                          casting="unsafe"),
            **into(wire),
        }
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    parser.add_argument("--mib", type=float, default=100.0, help="float32 gradient size")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    n = int(args.mib * 2**20) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(F32)
    cases = _cases(args.framework, x, args.threads)
    print(f"{args.framework}, {args.mib:g} MiB float32 ({n} elements), {args.threads} thread(s), "
          f"{args.rounds} alternating rounds; ms median, ratio = median of per-round ratios")
    figures: dict[str, dict[str, float]] = {}
    for wire, fns in cases.items():
        times: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        for fn in fns.values():
            fn()  # warm up: first-touch of buffers, kernels built
        for r in range(args.rounds):
            for k in order if r % 2 == 0 else order[::-1]:
                times[k].append(_timed(fns[k]))
        print(f"\n{wire}")
        for step in ("compress", "decompress"):
            own = times[f"{step} own"]
            line = f"  {step:<10} own {statistics.median(own):7.2f}"
            for who in ("into", "ringflow", "numpy"):
                mine = times.get(f"{step} {who}")
                if mine is None:
                    continue
                ratio = statistics.median(m / o for m, o in zip(mine, own, strict=True))
                line += f" | {who} {statistics.median(mine):7.2f} ({ratio:.2f}x)"
                if who == "ringflow":
                    figures.setdefault(wire.split(" ")[0], {})[step] = ratio
            print(line)
    # figures: per wire dtype, ringflow's cast time over the framework's own (median ratio)
    records.append("cast_cost", {"framework": args.framework, "mib": args.mib, **figures})


if __name__ == "__main__":
    main()
