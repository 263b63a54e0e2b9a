"""kmp.config.autocast_block: DeepSpeed's torch_autocast and data_types blocks, read through kmp.load_config.

What DeepSpeed does with them (the module's docstring names the sources): torch_autocast's dtype in
DtypeEnum's spellings, its default module list (Linear, Conv1d, Conv2d, Conv3d), torch.amp.GradScaler()
under float16; data_types' three keys, param_dtype asserted against the fp16/bf16 blocks.
"""

import json
import os
import warnings

import pytest

from kmp.config import autocast_block
from kmp.config.deepspeed import DEEPSPEED_LOSS_SCALE, GRADSCALER_LOSS_SCALE, load_config, to_deepspeed
from kmp.config.settings import Config
from kmp.errors import ConfigError

CORPUS = os.path.join(os.path.dirname(__file__), "data", "deepspeed_configs")


def _load(source):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(source)
    return config, [str(w.message) for w in caught]


def _problems(source):
    with pytest.raises(ConfigError) as info:
        _load(source)
    return {p.path: p for p in info.value.problems}


# --- torch_autocast ------------------------------------------------------------------


@pytest.mark.parametrize("spelling,precision", [
    ("torch.bfloat16", "bf16"), ("bf16", "bf16"), ("bfloat16", "bf16"),
    ("torch.float16", "fp16"), ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"),
])
def test_enabled_autocast_gives_the_precision_in_every_deepspeed_spelling(spelling, precision):
    config, _ = _load({"torch_autocast": {"enabled": True, "dtype": spelling}})
    assert config.precision == precision
    assert config.lower_precision_safe_modules == autocast_block.DEFAULT_SAFE_MODULES


def test_disabled_or_absent_autocast_changes_nothing():
    for raw in ({}, {"torch_autocast": {"enabled": False, "dtype": "fp16",
                                        "lower_precision_safe_modules": ["torch.nn.Linear"]}},
                {"torch_autocast": {}}):
        config, notes = _load(raw)
        assert config.precision == "fp32" and config.lower_precision_safe_modules is None
        assert not any("torch_autocast" in n for n in notes)


def test_float16_autocast_without_an_fp16_block_scales_as_torch_gradscaler():
    config, _ = _load({"torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert config.loss_scale == GRADSCALER_LOSS_SCALE
    assert (config.loss_scale.initial_scale, config.loss_scale.dynamic_growth_steps, config.loss_scale.hysteresis,
            config.loss_scale.growth_rule) == (2.0**16, 2000, 1, "every_window")
    # Beside an fp16 block, the block's keys (and DeepSpeed's fp16 defaults) decide.
    config, _ = _load({"fp16": {"enabled": True, "hysteresis": 3},
                       "torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert config.loss_scale.hysteresis == 3
    assert config.loss_scale.dynamic_growth_steps == DEEPSPEED_LOSS_SCALE.dynamic_growth_steps


def test_a_block_asking_for_the_same_dtype_is_accepted_and_a_different_one_refused():
    config, _ = _load({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    assert config.precision == "bf16"
    problems = _problems({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    assert problems["torch_autocast.dtype"].expected == "'bf16', what bf16.enabled asks for"
    assert "one lower precision" in problems["torch_autocast.dtype"].fix


def test_missing_dtype_is_deepspeeds_documented_bfloat16_said_once():
    config, notes = _load({"torch_autocast": {"enabled": True}})
    assert config.precision == "bf16"
    assert sum("torch_autocast.dtype is not given" in n for n in notes) == 1


def test_autocast_keys_and_types_are_checked_with_key_paths():
    problems = _problems({"torch_autocast": {"enabled": 1, "dtype": "fp32", "lower_precision_safe_module": [],
                                             "lower_precision_safe_modules": "torch.nn.Linear"}})
    assert set(problems) == {"torch_autocast.enabled", "torch_autocast.dtype",
                             "torch_autocast.lower_precision_safe_module",
                             "torch_autocast.lower_precision_safe_modules"}
    assert "Did you mean 'lower_precision_safe_modules'" in problems["torch_autocast.lower_precision_safe_module"].fix
    assert "float16 or bfloat16 only" in problems["torch_autocast.dtype"].fix
    assert _problems({"torch_autocast": {"enabled": True, "dtype": "int8"}})
    assert _problems({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear", 3]}})
    assert _problems({"torch_autocast": True})


def test_unmappable_names_are_said_once_with_why():
    names = ["torch.nn.modules.linear.Linear", "torch.nn.GELU", "transformers.models.llama.LlamaRMSNorm",
             "torch.nn.Lienar", "torch.nn.MultiheadAttention"]
    config, notes = _load({"torch_autocast": {"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": names}})
    assert config.lower_precision_safe_modules == tuple(names)
    said = [n for n in notes if "cannot map" in n]
    assert len(said) == 1
    assert "torch.nn.modules.linear.Linear" not in said[0]
    for name in names[1:]:
        assert name in said[0]
    assert "Did you mean 'Linear'" in said[0]
    assert "activation function" in said[0]
    assert "not a torch.nn class" in said[0]


def test_torch_names_map_to_keras_layer_classes_that_exist():
    import keras

    mapped, why_not = autocast_block.keras_classes(autocast_block.DEFAULT_SAFE_MODULES + ("torch.nn.Embedding",))
    assert mapped == {"torch.nn.Linear": ("Dense", "EinsumDense"),
                      "torch.nn.Conv1d": ("Conv1D", "DepthwiseConv1D", "SeparableConv1D"),
                      "torch.nn.Conv2d": ("Conv2D", "DepthwiseConv2D", "SeparableConv2D"),
                      "torch.nn.Conv3d": ("Conv3D",), "torch.nn.Embedding": ("Embedding",)}
    assert not why_not
    for classes in autocast_block.TORCH_TO_KERAS.values():
        for name in classes:
            assert isinstance(getattr(keras.layers, name), type), name


def test_round_trip_with_autocast():
    for config in (Config(precision="bf16", lower_precision_safe_modules=("torch.nn.Linear",)),
                   Config(precision="fp16", lower_precision_safe_modules=autocast_block.DEFAULT_SAFE_MODULES,
                          loss_scale=GRADSCALER_LOSS_SCALE),
                   _load({"torch_autocast": {"enabled": True, "dtype": "half",
                                             "lower_precision_safe_modules": []}})[0]):
        written = to_deepspeed(config)
        assert written["torch_autocast"]["enabled"] is True
        assert _load(json.loads(json.dumps(written)))[0] == config
    assert "torch_autocast" not in to_deepspeed(Config(precision="bf16"))


def test_config_refuses_safe_modules_without_a_lower_precision():
    with pytest.raises(ConfigError, match="lower_precision_safe_modules"):
        Config(lower_precision_safe_modules=("torch.nn.Linear",))
    with pytest.raises(ConfigError, match="lower_precision_safe_modules"):
        Config(precision="bf16", lower_precision_safe_modules="torch.nn.Linear")


# --- data_types ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["fp32", "float32", "torch.float32", "float", None])
def test_grad_accum_dtype_fp32_is_what_kmp_does(value):
    _, notes = _load({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": value}})
    assert not any("grad_accum_dtype" in n for n in notes)


@pytest.mark.parametrize("value", ["bf16", "fp16", "torch.bfloat16", "half"])
def test_grad_accum_dtype_16_bit_gets_one_sentence(value):
    config, notes = _load({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": value}})
    said = [n for n in notes if "grad_accum_dtype" in n]
    assert len(said) == 1 and "kmp accumulates gradients in float32" in said[0]
    assert config == _load({"bf16": {"enabled": True}})[0]  # nothing else changes


def test_data_types_keys_and_values_are_checked():
    problems = _problems({"data_types": {"grad_accum_dtype": "int8", "grad_acum_dtype": "fp32",
                                         "buffer_dtype": "fp64", "param_dtype": 16}})
    assert set(problems) == {"data_types.grad_accum_dtype", "data_types.grad_acum_dtype",
                             "data_types.buffer_dtype", "data_types.param_dtype"}
    assert "Did you mean 'grad_accum_dtype'" in problems["data_types.grad_acum_dtype"].fix
    assert _problems({"data_types": ["fp32"]})


def test_param_dtype_must_match_the_blocks_as_deepspeed_asserts():
    assert _load({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}})[0].precision == "bf16"
    assert _load({"data_types": {"param_dtype": "fp32"}})[0].precision == "fp32"
    problems = _problems({"fp16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}})
    assert problems["data_types.param_dtype"].expected.startswith("'fp16'")
    # torch_autocast does not count: DeepSpeed's model dtype comes from the fp16/bf16 blocks.
    assert _problems({"torch_autocast": {"enabled": True, "dtype": "bf16"}, "data_types": {"param_dtype": "bf16"}})


def test_buffer_dtype_16_bit_is_said():
    _, notes = _load({"data_types": {"buffer_dtype": "bf16"}})
    assert sum("buffer_dtype" in n and "float32" in n for n in notes) == 1


# --- the real files ------------------------------------------------------------------------


def test_the_corpus_files_with_torch_autocast_load():
    # DeepSpeedExamples training/bf16_master_weight/configs (tests/data/deepspeed_configs/SOURCES.json).
    base = "dse__training__bf16_master_weight__configs__"
    baseline, notes = _load(os.path.join(CORPUS, base + "baseline.json"))
    assert (baseline.precision, baseline.lower_precision_safe_modules) == ("bf16", None)
    assert not any("torch_autocast" in n for n in notes)
    full, notes = _load(os.path.join(CORPUS, base + "bf16_full.json"))
    assert (full.precision, full.lower_precision_safe_modules) == ("bf16", autocast_block.DEFAULT_SAFE_MODULES)
    assert not any("torch_autocast" in n for n in notes)  # nothing to say: its dtype agrees, every name maps
