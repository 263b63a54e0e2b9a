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


TINY_LM = ["--steps", "2", "--batch-size", "4", "--length", "32"]
HF_ZERO2 = "transformers__tests__deepspeed__ds_config_zero2.json"


def test_causal_lm_on_one_device_in_fp16_from_hugging_faces_config(capsys):
    with _mock(examples=64):
        # No --steps: the whole mock split, 64 reviews in batches of 16.
        result = _recipe("causal_lm").main(["--batch-size", "16", "--length", "32", "--cpus", "1", "--no-xla",
                                            "--preset", "no_such_preset"])
    _finite(result)
    assert result["steps"] == 4 and result["loss_scale"] > 0 and result["preset"] is None
    out = capsys.readouterr().out
    assert "preset 'no_such_preset' is not available offline" in out
    assert "one device (the default strategy) | tiny GPT-2 (2 layers, hidden 64, vocabulary 256 bytes)" in out
    assert "mixed_float16" in out
    # The config's "auto" values, filled from the recipe's arguments.
    assert "train_micro_batch_size_per_gpu     16" in out and "scheduler.params.warmup_num_steps  1" in out
    assert (f"{HF_ZERO2}: fp16, batch 16 = micro-batch 16 x 1 x 1 replicas, AdamW lr 0.001, warmup 1 of 4 steps, "
            "sequence 32") in out


def test_causal_lm_mirrored_on_two_logical_cpus(capsys):
    # tests/conftest.py split the CPU in two already: the recipe finds two devices.
    with _mock(examples=64):
        result = _recipe("causal_lm").main([*TINY_LM, "--no-xla", "--precision", "bf16"])
    _finite(result)
    # bf16 needs no loss scaling: on two replicas kmp's optimizer runs with a static scale of 1.
    assert result["replicas"] == 2 and result["steps"] == 2 and result["loss_scale"] == 1.0
    out = capsys.readouterr().out
    assert "MirroredStrategy, 2 replicas | tiny GPT-2" in out and "mixed_bfloat16" in out
    assert f"{HF_ZERO2}: bf16, batch 8 = micro-batch 4 x 1 x 2 replicas" in out


def test_causal_lm_fine_tunes_a_preset_directory_with_its_own_tokenizer(tmp_path, capsys):
    import keras_hub
    from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode

    vocabulary = {c: i for i, c in enumerate(bytes_to_unicode()[1] + ["Ġt", "<|endoftext|>"])}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["Ġ t"])
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=len(vocabulary), num_layers=1, num_heads=2,
                                             hidden_dim=32, intermediate_dim=64, max_sequence_length=32)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=32)
    keras_hub.models.GPT2CausalLM(backbone, preprocessor=preprocessor).save_to_preset(str(tmp_path))
    with _mock(examples=64):
        result = _recipe("causal_lm").main([*TINY_LM, "--cpus", "1", "--no-xla", "--preset", str(tmp_path)])
    _finite(result)
    assert result["preset"] == str(tmp_path)
    out = capsys.readouterr().out
    assert f"| preset {tmp_path}, 17,888 parameters, mixed_float16" in out


def test_a_preset_counts_as_local_only_when_its_files_are_here(tmp_path, monkeypatch):
    from kagglehub.cache import Cache
    from kagglehub.handle import parse_model_handle

    local_preset = _recipe("causal_lm").local_preset
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path / "cache"))
    assert local_preset(str(tmp_path)) == str(tmp_path)
    for absent in ("gpt2_base_en", "kaggle://keras/gpt2/keras/gpt2_base_en/3", "kaggle://keras/gpt2/keras/gpt2_base_en",
                   "hf://openai-community/gpt2", str(tmp_path / "missing")):
        assert local_preset(absent) is None, absent
    handle, cache = parse_model_handle("keras/gpt2/keras/gpt2_base_en/3"), Cache()
    for name in ("config.json", "model.weights.h5"):
        path = Path(cache.get_path(handle, name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        cache.mark_as_complete(handle, name)
    assert local_preset("gpt2_base_en") == cache.get_path(handle) == str(Path(path).parent)
