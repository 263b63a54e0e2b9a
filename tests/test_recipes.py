"""Every recipe runs: offline, on tensorflow-datasets' mock data for the tfds ones, a few steps each.

`tfds.testing.mock_data` makes `tfds.load("mnist" | "cifar10" | "imdb_reviews")`
return random examples of the real datasets' shapes and dtypes, with the
metadata from the dataset's code (MockPolicy.USE_CODE): no download. The
MultiWorkerMirroredStrategy recipe runs for real under `kmp launch`
(tests/test_launch.py).
"""

import importlib.util
import math
from pathlib import Path

import keras
import pytest
import tensorflow_datasets as tfds

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

pytestmark = pytest.mark.filterwarnings("ignore:precision .mixed_float16. on CPU:UserWarning")


def _recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mock(examples=256):
    return tfds.testing.mock_data(num_examples=examples, policy=tfds.testing.MockPolicy.USE_CODE)


def _finite(result):
    assert math.isfinite(result["train_loss"]) and math.isfinite(result["test_loss"]), result
    assert 0.0 <= result["test_accuracy"] <= 1.0


def test_one_device(capsys):
    with _mock():
        result = _recipe("one_device").main(["--epochs", "1", "--steps", "3", "--batch-size", "16"])
    _finite(result)
    assert result["steps"] == 3 and result["loss_scale"] is None  # bf16: no loss scaling
    assert "one device, mixed_bfloat16, batch 16" in capsys.readouterr().out


def test_mirrored_on_two_logical_cpus(capsys):
    # tests/conftest.py split the CPU in two already: the recipe finds two devices.
    with _mock():
        result = _recipe("mirrored").main(["--epochs", "1", "--steps", "2", "--batch-size", "8"])
    _finite(result)
    assert result["replicas"] == 2 and result["steps"] == 2 and result["loss_scale"] > 0
    out = capsys.readouterr().out
    assert "MirroredStrategy, 2 replicas, mixed_float16, global batch 16" in out


def test_tpu_falls_back_to_the_default_strategy_and_says_so(capsys):
    with _mock():
        result = _recipe("tpu").main(["--epochs", "1", "--steps", "2", "--batch-size", "16"])
    _finite(result)
    assert result["tpu"] is False
    assert "no TPU found: running on _DefaultDistributionStrategy (the default strategy), bfloat16" in (
        capsys.readouterr().out)


def test_accumulation_to_a_large_effective_batch(capsys):
    with _mock(examples=128):
        result = _recipe("accumulation").main(["--steps", "8", "--batch-size", "4", "--accumulation", "4"])
    _finite(result)
    assert result["effective_batch"] == 16
    assert result["steps"] == 2  # 8 micro-batches, 4 per optimizer step
    assert "micro-batch 4 x 4 = effective batch 16" in capsys.readouterr().out


def test_a_real_deepspeed_config(capsys):
    with _mock():
        result = _recipe("deepspeed_config").main(["--steps", "3"])
    _finite(result)
    out = capsys.readouterr().out
    assert "dse__training__cifar__ds_config.json: fp16, micro-batch 16 x 1, optimizer Adam" in out
    assert result["loss_scale"] is not None


def test_precision_table_prints_a_row_per_precision(capsys):
    rows = _recipe("precision_table").main(["--epochs", "1", "--steps", "5"])
    assert [r["precision"] for r in rows] == ["float32", "mixed_bfloat16", "mixed_float16"]
    out = capsys.readouterr().out
    for r in rows:
        assert any(line.startswith(r["precision"]) and f"{r['accuracy']:.4f}" in line for line in out.splitlines())
    assert rows[2]["loss_scale"] is not None and rows[0]["loss_scale"] is None
    assert "accuracy spread:" in out
    assert keras.config.dtype_policy().name == "float32"  # precision_scope put the policy back
