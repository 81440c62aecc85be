"""The examples' data: scikit-learn's digits (1,797 images of 8x8 pixels, 10 classes), which ship
with scikit-learn, so nothing is downloaded.

``from sklearn.datasets import load_digits`` imports SciPy's statistics on the way and costs every
rank 2.3 to 3 CPU-seconds before its first step (RESULTS.md section 36); this module reads the same
file (``sklearn/datasets/data/digits.csv.gz``) with numpy alone, and splits it as scikit-learn's
``train_test_split(..., random_state=seed)`` does. tests/unit/test_digits.py checks both against
scikit-learn's own functions.

    images, labels = digits.load()             # load_digits().images, load_digits().target
    train, test = digits.split(len(labels), 0.25)    # indices, as train_test_split picks them
    x_train, y_train, x_test, y_test = digits.train_test()   # scaled, split, one channel

ray_train_torch.py and spark_torch_distributor.py call :func:`train_test` in the driver and hand
the arrays to their training function, which runs in Ray's or Spark's workers, where this file
is not importable (and scikit-learn need not be installed).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os

import numpy as np


def load() -> tuple[np.ndarray, np.ndarray]:
    """The images (float64, shape (1797, 8, 8), values 0 to 16) and their labels (int64)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits ship with scikit-learn: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def split(n: int, test_size: float | int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The indices (train, test) of ``n`` samples that ``train_test_split(test_size=test_size,
    random_state=seed)`` picks: a fraction rounds the test set up, a count is taken as it is."""
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else int(test_size)
    order = np.random.RandomState(seed).permutation(n)
    return order[n_test:], order[:n_test]


def train_test(test_size: float | int = 0.25,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: the images as float32 in [0, 1], shape (n, 1, 8, 8)
    (one channel), and their labels, split as :func:`split` splits them."""
    images, labels = load()
    x = (images / 16.0).astype(np.float32)[:, None]
    train, test = split(len(labels), test_size, seed)
    return x[train], labels[train], x[test], labels[test]
