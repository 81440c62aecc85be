"""examples/digits.py gives the examples what scikit-learn's ``load_digits`` and
``train_test_split`` give, to the bit. scikit-learn is imported in the tests, not when the file is
collected (test_tiers.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "digits", Path(__file__).resolve().parents[2] / "examples" / "digits.py")
assert _SPEC and _SPEC.loader
digits = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(digits)


def test_load_is_load_digits() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    want = datasets.load_digits()
    images, labels = digits.load()
    assert images.dtype == want.images.dtype and images.shape == (1797, 8, 8)
    assert np.array_equal(images, want.images)
    assert labels.dtype == want.target.dtype and np.array_equal(labels, want.target)


@pytest.mark.parametrize("test_size", [0.25, 451, 0.1, 1])
@pytest.mark.parametrize("seed", [0, 7])
def test_split_is_train_test_split(test_size: float | int, seed: int) -> None:
    selection = pytest.importorskip("sklearn.model_selection")
    every = np.arange(1797)
    want_train, want_test = selection.train_test_split(every, test_size=test_size,
                                                       random_state=seed)
    train, test = digits.split(len(every), test_size, seed)
    assert np.array_equal(train, want_train) and np.array_equal(test, want_test)


def test_train_test_is_what_the_ray_and_spark_examples_computed_in_their_workers() -> None:
    """Their loop's tensors before digits.train_test (torch's cast and scaling, then
    train_test_split), to the bit."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("sklearn.datasets")
    selection = pytest.importorskip("sklearn.model_selection")
    loaded = datasets.load_digits()
    x = torch.tensor(loaded.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(loaded.target)
    want = selection.train_test_split(x, y, test_size=0.25, random_state=0)  # xtr, xte, ytr, yte
    got = [torch.from_numpy(a) for a in digits.train_test()]  # xtr, ytr, xte, yte
    for g, w in zip(got, [want[0], want[2], want[1], want[3]], strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
