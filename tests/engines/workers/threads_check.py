"""Prints this rank's thread counts after ``ringflow.init()``, read back from torch and from the
OpenMP runtime it loaded, as one line: ``THREADS {json}``.

    python threads_check.py [--torch-threads N] [--tensorflow]

``--torch-threads`` calls ``torch.set_num_threads(N)`` before ``init()`` (a user's setting);
``--tensorflow`` imports TensorFlow before ``init()`` and reports its intra/inter-op settings.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import threading

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--torch-threads", type=int)
parser.add_argument("--tensorflow", action="store_true")
args = parser.parse_args()
if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
before = torch.get_num_threads()
if args.tensorflow:
    import tensorflow as tf

import ringflow  # noqa: E402
from ringflow import threads  # noqa: E402

ringflow.init()


def openmp_max_threads() -> dict[str, int]:
    """``omp_get_max_threads()`` of each OpenMP runtime loaded (torch's, and any other library's:
    TensorFlow brings scikit-learn's), called through ctypes, by path."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    return {path: int(ctypes.CDLL(path).omp_get_max_threads()) for path in sorted(paths)}


def in_a_new_thread() -> int:
    """torch's count as a thread started after init() sees it (what DataLoader's pin thread or
    an autograd engine thread would use)."""
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return seen[0]


info = torch.__config__.parallel_info()
runtimes = openmp_max_threads()
plan = threads.current()
record = {
    "rank": ringflow.rank(), "before": before, "torch": torch.get_num_threads(),
    "torch_new_thread": in_a_new_thread(),
    "omp": int(re.search(r"omp_get_max_threads\(\) : (\d+)", info).group(1)),
    "omp_ctypes": next((v for k, v in runtimes.items() if "/torch/" in k), None),
    "omp_runtimes": runtimes,
    "env": {k: os.environ.get(k) for k in threads.VARIABLES},
    "plan": plan.metadata() if plan is not None else None,
}
if args.tensorflow:
    record["tf"] = [tf.config.threading.get_intra_op_parallelism_threads(),
                    tf.config.threading.get_inter_op_parallelism_threads()]
print("THREADS " + json.dumps(record), flush=True)
ringflow.shutdown()
