"""kmp.config.auto: Hugging Face's "auto" values, filled from what kmp is given, or one error naming the arguments."""

import json
import warnings
from pathlib import Path

import keras
import pytest

import kmp
from kmp.config.auto import FILLS, Given, auto_paths, fill_auto

CORPUS = Path(__file__).parent / "data" / "deepspeed_configs"
# accelerate's template: every value HF's Trainer fills is "auto"
# (huggingface/accelerate tests/deepspeed/ds_config_zero2.json; SOURCES.json has the commit).
ZERO2 = CORPUS / "accelerate__tests__deepspeed__ds_config_zero2.json"

EVERYTHING = Given(precision="fp16", optimizer={"lr": 2e-5, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01},
                   gradient_clipping=1.0, micro_batch_size=8, gradient_accumulation_steps=2, world_size=4,
                   total_steps=1000, warmup_steps=100)


def test_every_fill_of_the_table():
    raw = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto",
           "optimizer": {"type": "AdamW", "params": {p: "auto" for p in ("lr", "betas", "eps", "weight_decay")}},
           "scheduler": {"type": "WarmupDecayLR", "params": {p: "auto" for p in (
               "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}}
    table = [path for path in FILLS if path != "bfloat16.enabled"]  # bf16's old block name, filled as bf16
    assert sorted(auto_paths(raw)) == sorted(table)
    out, filled, problems = fill_auto(raw, EVERYTHING, ())
    assert problems == []
    assert raw["fp16"]["enabled"] == "auto"  # the caller's dict is not changed
    assert out["fp16"]["enabled"] is True and out["bf16"]["enabled"] is False
    assert out["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}
    assert out["train_micro_batch_size_per_gpu"] == 8 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 8 * 2 * 4  # as HF: world_size * per_device * accumulation
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 100,
                                          "total_num_steps": 1000}
    assert [path for path, _, _ in filled] == table


def test_what_cannot_be_filled_is_one_error_naming_each_argument():
    raw = json.loads(ZERO2.read_text())
    with pytest.raises(kmp.ConfigError) as info:
        kmp.load_config(raw)
    by_path = {p.path: p.fix for p in info.value.problems}
    always = {"scheduler.params.warmup_min_lr"}  # 0, as Hugging Face
    assert set(by_path) == {p for p in auto_paths(raw) if not p.startswith("zero_optimization")} - always
    assert "precision=" in by_path["fp16.enabled"]
    assert "micro_batch_size=" in by_path["train_micro_batch_size_per_gpu"]
    assert "warmup_steps=" in by_path["scheduler.params.warmup_num_steps"]
    assert "optimizer passed to kmp.wrap" in by_path["optimizer.params.lr"]


def test_auto_elsewhere_is_an_error_and_auto_in_zero_blocks_stays():
    with pytest.raises(kmp.ConfigError, match="fp16.hysteresis"):
        kmp.load_config({"fp16": {"enabled": True, "hysteresis": "auto"}})
    config = kmp.load_config({"zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"}})
    assert config.zero_stage == 0


def test_accumulation_is_inferred_or_hugging_faces_default():
    out, filled, _ = fill_auto({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                "gradient_accumulation_steps": "auto"}, Given(world_size=2), ())
    assert "gradient_accumulation_steps" not in out  # DeepSpeed infers 64 // 8 // 2 = 4
    out, _, _ = fill_auto({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"}, Given(), ())
    assert out["gradient_accumulation_steps"] == 1


def test_wrap_fills_from_its_optimizer_policy_strategy_and_arguments(capsys):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ZeRO stage 2: what kmp does instead
            optimizer = kmp.wrap(keras.optimizers.AdamW(2e-5, weight_decay=0.01, global_clipnorm=0.5), ZERO2,
                                 micro_batch_size=4, total_steps=200, warmup_steps=20)
    finally:
        keras.config.set_dtype_policy("float32")
    printed = capsys.readouterr().out
    # The filled values are printed once, in one block, with where each came from.
    assert printed.count("kmp: filled the 'auto' values") == 1
    assert "fp16.enabled" in printed and "the active Keras policy mixed_float16" in printed
    assert "gradient_clipping" in printed and "global_clipnorm" in printed
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert 0.5 in (optimizer.gradient_clipping, optimizer.inner_optimizer.global_clipnorm)
    lr = optimizer.inner_optimizer.learning_rate  # the config's WarmupLR, warmup_max_lr from the optimizer
    assert float(lr) >= 0


def test_load_config_arguments_are_checked():
    with pytest.raises(kmp.ConfigError, match="micro_batch_siz"):
        kmp.load_config({}, micro_batch_siz=4)
    with pytest.raises(kmp.ConfigError, match="precision"):
        kmp.load_config({}, precision="float16")
