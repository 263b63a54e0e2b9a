"""kmp.data.datasets: the packaged digits file and its train/test split."""

import gzip
import hashlib
import math
import ast
from pathlib import Path
from importlib import resources

import keras
import numpy as np
import pytest

from kmp.data import datasets
from kmp.data.datasets import load_digits
from kmp.errors import ConfigError, KmpError

# The same values as kmp/data/README.md.
DIGITS_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
N = 1797


def _rows(x, y):
    """The examples as sorted (pixels..., label) rows, to compare as multisets."""
    table = np.concatenate([np.rint(x * 16), y[:, None]], axis=1).astype(np.int64)
    return table[np.lexsort(table.T[::-1])]


def test_packaged_file_is_the_documented_one():
    data = (resources.files("kmp") / "data" / "digits.csv.gz").read_bytes()
    assert hashlib.sha256(data).hexdigest() == DIGITS_SHA256


def test_shapes_and_dtypes():
    (x_train, y_train), (x_test, y_test) = load_digits()
    assert x_train.shape == (1438, 64) and x_test.shape == (359, 64)
    assert y_train.shape == (1438,) and y_test.shape == (359,)
    assert x_train.dtype == x_test.dtype == np.float32
    assert y_train.dtype == y_test.dtype == np.int32


def test_pixels_are_sixteenths_in_unit_range():
    (x_train, _), (x_test, _) = load_digits()
    x = np.concatenate([x_train, x_test])
    assert x.min() == 0.0 and x.max() == 1.0
    np.testing.assert_array_equal(x * 16, np.rint(x * 16))


def test_splits_partition_the_dataset():
    (x_train, y_train), (x_test, y_test) = load_digits(seed=3)
    together = _rows(np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]))
    everything = _rows(*_all_examples())
    np.testing.assert_array_equal(together, everything)
    assert np.bincount(together[:, -1]).tolist() == CLASS_COUNTS


@pytest.mark.parametrize(
    "test_fraction, n_test", [(0.2, 359), (0.25, 449), (0.5, 898), (0.01, 18), (0.99, 1779)]
)
def test_split_sizes(test_fraction, n_test):
    (x_train, y_train), (x_test, y_test) = load_digits(test_fraction=test_fraction)
    assert len(x_test) == len(y_test) == n_test
    assert len(x_train) == len(y_train) == N - n_test


@pytest.mark.parametrize("test_fraction", [0.01, 0.2, 0.5, 0.99])
def test_split_is_stratified(test_fraction):
    (_, y_train), (_, y_test) = load_digits(test_fraction=test_fraction)
    test_counts = np.bincount(y_test, minlength=10)
    train_counts = np.bincount(y_train, minlength=10)
    assert (test_counts >= 1).all() and (train_counts >= 1).all()
    expected = np.array(CLASS_COUNTS) * len(y_test) / N
    assert np.abs(test_counts - expected).max() < 1


def test_split_is_shuffled():
    (_, y_train), (_, y_test) = load_digits()
    # Labels in file order change class 9 -> 0 about 150 times in 1797 rows; a
    # class-sorted split would change class only 9 times.
    assert np.count_nonzero(np.diff(y_train)) > 1000
    assert np.count_nonzero(np.diff(y_test)) > 250


def test_same_seed_gives_the_same_split():
    first, second = load_digits(seed=7), load_digits(seed=7)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_other_seed_gives_another_split_with_the_same_class_counts():
    (x_a, y_a), (xt_a, yt_a) = load_digits(seed=0)
    (x_b, y_b), (xt_b, yt_b) = load_digits(seed=1)
    assert not np.array_equal(x_a, x_b)
    assert not np.array_equal(_rows(xt_a, yt_a), _rows(xt_b, yt_b))
    assert np.bincount(y_a).tolist() == np.bincount(y_b).tolist()
    assert np.bincount(yt_a).tolist() == np.bincount(yt_b).tolist()


@pytest.mark.parametrize(
    "test_fraction",
    [0, 0.0, 1, 1.0, -0.1, 1.5, math.nan, math.inf, "0.2", None, True],
)
def test_rejects_bad_test_fraction(test_fraction):
    with pytest.raises(ConfigError) as info:
        load_digits(test_fraction=test_fraction)
    message = str(info.value)
    assert "expected a number in (0, 1)" in message
    assert f"Received: test_fraction={test_fraction!r}" in message
    assert "test_fraction=0.2" in message


@pytest.mark.parametrize("seed", [-1, 1.5, "0", None, True])
def test_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match=r"expected an integer >= 0\. Received: seed="):
        load_digits(seed=seed)


def test_accepts_numpy_scalars():
    (_, _), (x_test, _) = load_digits(test_fraction=np.float32(0.25), seed=np.int64(2))
    assert len(x_test) == 449


def test_reports_all_argument_problems_together():
    with pytest.raises(ConfigError) as info:
        load_digits(test_fraction=2.0, seed=-3)
    assert [p.path for p in info.value.problems] == ["test_fraction", "seed"]


@pytest.mark.parametrize("test_fraction", [0.001, 0.005, 0.995])
def test_rejects_fraction_that_empties_a_class(test_fraction):
    with pytest.raises(ConfigError, match="at least one example of every class") as info:
        load_digits(test_fraction=test_fraction)
    assert "Use a value from 0.01 to 0.99." in str(info.value)


def _write_gzip(path, text):
    with gzip.open(path, "wt", encoding="ascii") as f:
        f.write(text)
    return path


def _csv(rows):
    return "".join(",".join(str(int(v)) for v in row) + "\n" for row in rows)


def _all_examples():
    pixels, labels = datasets._read_digits(datasets._data_file())
    return pixels / 16, labels


def _good_table():
    pixels, labels = datasets._read_digits(datasets._data_file())
    return np.concatenate([pixels, labels[:, None]], axis=1)


def _damage(kind, tmp_path):
    path = tmp_path / "digits.csv.gz"
    table = _good_table()
    if kind == "missing":
        return path
    if kind == "64 columns":
        return _write_gzip(path, _csv(table[:, 1:]))
    if kind == "too few rows":
        return _write_gzip(path, _csv(table[:100]))
    if kind == "pixel 17":
        table[5, 3] = 17
        return _write_gzip(path, _csv(table))
    if kind == "label 10":
        table[5, -1] = 10
        return _write_gzip(path, _csv(table))
    if kind == "not a number":
        return _write_gzip(path, _csv(table).replace("16", "x", 1))
    if kind == "fraction":
        return _write_gzip(path, _csv(table).replace("16", "1.5", 1))
    if kind == "not gzip":
        path.write_text(_csv(table))
        return path
    if kind == "truncated gzip":
        data = datasets._data_file().read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, received",
    [
        ("missing", "no file at that path"),
        ("64 columns", "a table of shape (1797, 64)"),
        ("too few rows", "a table of shape (100, 65)"),
        ("pixel 17", "pixel values from 0 to 17"),
        ("label 10", "labels from 0 to 10"),
        ("not a number", "a file that is not gzip-compressed CSV"),
        ("fraction", "values that are not integers"),
        ("not gzip", "a file that is not gzip-compressed CSV"),
        ("truncated gzip", "a file that is not gzip-compressed CSV"),
    ],
)
def test_damaged_file_raises_a_clear_error(kind, received, tmp_path, monkeypatch):
    path = _damage(kind, tmp_path)
    monkeypatch.setattr(datasets, "_data_file", lambda: path)
    with pytest.raises(KmpError) as info:
        load_digits()
    message = str(info.value)
    assert f"Received: {received}" in message
    assert "expected 1797 rows of 65 comma-separated integers" in message
    assert "Reinstall kmp" in message


def test_imports_no_tensorflow():
    """The loader itself needs only numpy (the package's __init__ brings TF)."""
    tree = ast.parse(Path(datasets.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n.split(".")[0] for n in names} & {"tensorflow", "keras"}


def test_float32_mlp_learns_the_digits():
    """A plain float32 MLP passes 0.9 test accuracy: the labels match the pixels."""
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits()
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu", dtype="float32"),
            keras.layers.Dense(10, activation="softmax", dtype="float32"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=64, epochs=10, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    assert accuracy > 0.9
