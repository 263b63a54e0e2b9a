"""Small real datasets that ship inside kmp, so the demo and tests need no network.

`load_digits` loads the 1,797 8x8 handwritten digits of the UCI "Optical
Recognition of Handwritten Digits" dataset (Alpaydin & Kaynak 1998, CC BY 4.0,
https://doi.org/10.24432/C50P49). The file is scikit-learn's copy of it,
unchanged. kmp/data/README.md gives its format, provenance and checksum.

This module imports only numpy.
"""

from __future__ import annotations

import gzip
import math
import numbers
import zlib
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import numpy as np

from kmp.errors import KmpError, Problem, check

Split = tuple[np.ndarray, np.ndarray]

_DIGITS_FILE = "digits.csv.gz"
_ROWS = 1797
_PIXELS = 64
_PIXEL_MAX = 16
_CLASSES = 10


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """The UCI handwritten digits, split into train and test sets by `seed`.

    Returns `((x_train, y_train), (x_test, y_test))`:
    - `x`: float32 pixels, shape `(n, 64)` (row-major 8x8 images), in [0, 1].
    - `y`: int32 labels 0..9, shape `(n,)`.

    The split is stratified. The test set holds `round(1797 * test_fraction)`
    examples, and every class has about the same share in both splits:

        n_test = round(n * test_fraction)
        quota[c] = count[c] * n_test / n
        take[c] = floor(quota[c]), plus 1 for the classes with the largest
                  remainders until sum(take) == n_test
        for each class c: shuffle its examples with `seed`;
                          the first take[c] go to test, the rest to train
        shuffle train and test

    The same `seed` gives the same arrays on every platform
    (`np.random.default_rng`). The class counts of each split do not depend on
    `seed`.

    Args:
      test_fraction: the fraction of examples held out for testing, in (0, 1).
        Both splits must keep at least one example of every class. Any value
        from 0.01 to 0.99 does.
      seed: a non-negative integer that selects the split and its order.

    Raises:
      ConfigError: an argument is invalid. All problems are listed together.
      KmpError: the packaged data file is missing or damaged.
    """
    problems: list[Problem] = []
    _check_fraction(test_fraction, problems)
    _check_seed(seed, problems)
    check(problems, "load_digits arguments")

    pixels, labels = _read_digits(_data_file())
    test_counts = _test_counts(np.bincount(labels, minlength=_CLASSES), test_fraction)

    rng = np.random.default_rng(seed)
    train_parts, test_parts = [], []
    for label, take in enumerate(test_counts):
        rows = rng.permutation(np.flatnonzero(labels == label))
        test_parts.append(rows[:take])
        train_parts.append(rows[take:])
    train = rng.permutation(np.concatenate(train_parts))
    test = rng.permutation(np.concatenate(test_parts))

    x = pixels.astype(np.float32) / np.float32(_PIXEL_MAX)
    y = labels.astype(np.int32)
    return (x[train], y[train]), (x[test], y[test])


def _check_fraction(value: Any, out: list[Problem]) -> None:
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_real or not math.isfinite(value) or not 0 < value < 1:
        out.append(
            Problem(
                "test_fraction",
                "a number in (0, 1), the fraction of examples held out for testing",
                value,
                "Use, for example, test_fraction=0.2.",
            )
        )


def _check_seed(value: Any, out: list[Problem]) -> None:
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not is_int or value < 0:
        out.append(Problem("seed", "an integer >= 0", value, "Use, for example, seed=0."))


def _test_counts(class_counts: np.ndarray, test_fraction: float) -> np.ndarray:
    """How many examples of each class go to the test set (largest remainders)."""
    total = int(class_counts.sum())
    n_test = int(round(total * test_fraction))
    quotas = class_counts * n_test / total
    take = np.floor(quotas).astype(np.int64)
    # A stable sort breaks ties by class index, so the counts are deterministic.
    by_remainder = np.argsort(-(quotas - take), kind="stable")
    take[by_remainder[: n_test - int(take.sum())]] += 1

    if (take < 1).any() or (take > class_counts - 1).any():
        check(
            [
                Problem(
                    "test_fraction",
                    "a fraction that keeps at least one example of every class "
                    f"in both splits ({n_test} test and {total - n_test} train "
                    f"examples here, for {len(class_counts)} classes)",
                    test_fraction,
                    "Use a value from 0.01 to 0.99.",
                )
            ],
            "load_digits arguments",
        )
    return take


def _data_file() -> Traversable:
    # importlib.resources finds the file inside an installed wheel or zip too.
    return resources.files("kmp") / "data" / _DIGITS_FILE


def _read_digits(source: Traversable) -> tuple[np.ndarray, np.ndarray]:
    """Pixels (int64, 0..16) and labels (int64, 0..9) from the packaged file."""
    try:
        with source.open("rb") as raw, gzip.open(raw, "rt", encoding="ascii") as text:
            table = np.loadtxt(text, delimiter=",", dtype=np.float64, ndmin=2)
    except FileNotFoundError:
        raise _damaged(source, "no file at that path") from None
    except (OSError, EOFError, zlib.error, ValueError) as error:
        # gzip raises OSError/EOFError/zlib.error; loadtxt and the ASCII codec
        # raise ValueError.
        raise _damaged(source, f"a file that is not gzip-compressed CSV ({error})") from error

    if table.shape != (_ROWS, _PIXELS + 1):
        raise _damaged(source, f"a table of shape {table.shape}")
    if not np.array_equal(table, np.round(table)):
        raise _damaged(source, "values that are not integers")
    pixels = table[:, :_PIXELS].astype(np.int64)
    labels = table[:, _PIXELS].astype(np.int64)
    if pixels.min() < 0 or pixels.max() > _PIXEL_MAX:
        raise _damaged(source, f"pixel values from {pixels.min()} to {pixels.max()}")
    if labels.min() < 0 or labels.max() >= _CLASSES:
        raise _damaged(source, f"labels from {labels.min()} to {labels.max()}")
    return pixels, labels


def _damaged(source: Traversable, received: str) -> KmpError:
    return KmpError(
        f"kmp's digits data file {source} is missing or damaged: expected "
        f"{_ROWS} rows of {_PIXELS + 1} comma-separated integers (64 pixels in "
        f"0..{_PIXEL_MAX}, then a label in 0..{_CLASSES - 1}), gzip-compressed. "
        f"Received: {received}. Reinstall kmp (pip install --force-reinstall "
        "--no-deps kmp), or restore kmp/data/digits.csv.gz from the repository; "
        "kmp/data/README.md gives its sha256."
    )
