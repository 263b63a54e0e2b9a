"""kmp.config.optimizer_block: DeepSpeed's optimizer block -> the Keras optimizer, with DeepSpeed's defaults."""

import re
import warnings
from pathlib import Path

import keras
import pytest

import kmp
from kmp.config.optimizer_block import build_optimizer, check, keras_arguments

CORPUS = Path(__file__).parent / "data" / "deepspeed_configs"


def _built(block, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer = build_optimizer(check(block), **kwargs)
    return optimizer, [str(w.message) for w in record]


@pytest.mark.parametrize("block,cls,expected", [
    # Left-out params take DeepSpeed's class defaults, not Keras's (eps 1e-7, AdamW's decay 0.004).
    ({"type": "Adam"}, keras.optimizers.Adam, {"learning_rate": 1e-3, "epsilon": 1e-8, "weight_decay": None}),
    ({"type": "adamw", "params": {"lr": 3e-5, "weight_decay": 0.01}}, keras.optimizers.AdamW,
     {"learning_rate": 3e-5, "weight_decay": 0.01, "epsilon": 1e-8, "beta_2": 0.999}),
    # DeepSpeed's "Adam" decays weights decoupled (ADAM_W_MODE_DEFAULT = True).
    ({"type": "Adam", "params": {"weight_decay": 0.1, "betas": [0.8, 0.99]}}, keras.optimizers.AdamW,
     {"weight_decay": 0.1, "beta_1": 0.8, "beta_2": 0.99}),
    ({"type": "Lamb", "params": {"lr": 0.011, "weight_decay": 0.01}}, keras.optimizers.Lamb,
     {"learning_rate": 0.011, "weight_decay": 0.01, "epsilon": 1e-8}),
    ({"type": "Lion"}, keras.optimizers.Lion, {"beta_1": 0.9, "beta_2": 0.999}),  # FusedLion's default, not 0.99
    ({"type": "Adagrad"}, keras.optimizers.Adagrad,
     {"learning_rate": 1e-2, "initial_accumulator_value": 0.0, "epsilon": 1e-10}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, keras.optimizers.SGD,
     {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ({"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False}},
     keras.optimizers.Adam, {"learning_rate": 4e-4}),
    ({"type": "ZeroOneAdam", "params": {"weight_decay": 0.01, "var_freeze_step": 1000}}, keras.optimizers.AdamW,
     {"weight_decay": 0.01}),
    ({"type": "OneBitLamb", "params": {"lr": 11e-3, "max_coeff": 0.3, "min_coeff": 0.01}}, keras.optimizers.Lamb,
     {"learning_rate": 11e-3}),
])
def test_each_type_builds_its_keras_optimizer_with_deepspeeds_defaults(block, cls, expected):
    optimizer, _ = _built(block)
    assert type(optimizer) is cls
    config = optimizer.get_config()
    for key, value in expected.items():
        assert config[key] == pytest.approx(value) if value is not None else config[key] is None, key


def test_what_keras_does_differently_is_said_once():
    _, notes = _built({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01, "bias_correction": False}})
    assert len(notes) == 1
    assert "L2 penalty" in notes[0] and "bias_correction=false" in notes[0]
    _, notes = _built({"type": "OneBitAdam"})
    assert len(notes) == 1 and "all-reduces the momentum in 1 bit" in notes[0]
    _, notes = _built({"type": "Lamb"})
    assert "trust ratio" in notes[0]
    _, notes = _built({"type": "SGD", "params": {"momentum": 0.9}})
    assert notes == []  # nothing differs


@pytest.mark.parametrize("block", [
    {"type": "OneBitAdam", "params": {"freeze_step": 400}},
    {"type": "OneBitAdam", "params": {"weight_decay": 0.01}},
    {"type": "ZeroOneAdam", "params": {"var_freeze_step": 1000}},
    {"type": "OneBitLamb"},
])
def test_a_compressed_type_names_one_class_the_one_built(block):
    optimizer, notes = _built(block)
    built = type(optimizer).__name__
    assert len(notes) == 1 and f"kmp builds keras.optimizers.{built} " in notes[0]
    named = {name.lower() for name in re.findall(r"\b(adamw?|lamb)\b", notes[0], re.IGNORECASE)}
    assert named == {built.lower()}, notes[0]  # what it is trained as is said once: the class built
    freeze = "var_freeze_step" if block["type"] == "ZeroOneAdam" else "freeze_step"
    assert f"{freeze} ({block.get('params', {}).get(freeze, 100000)}) on" in notes[0]


@pytest.mark.parametrize("block,path,text", [
    ({"type": "Adamm"}, "optimizer.type", "Did you mean 'Adam'?"),
    ({"type": "sgd"}, "optimizer.type", "Did you mean 'SGD'?"),  # torch.optim names are exact in DeepSpeed
    ({"type": "RMSprop"}, "optimizer.type", "pass a Keras optimizer to kmp.wrap"),
    ({"type": "MuAdam"}, "optimizer.type", "mu-P"),
    ({"type": "Adam", "params": {"learnig_rate": 1}}, "optimizer.params.learnig_rate", "Adam"),
    ({"type": "Adam", "params": {"betas": [0.9]}}, "optimizer.params.betas", "[beta1, beta2]"),
    ({"type": "Adam", "params": {"lr": -1}}, "optimizer.params.lr", ">= 0"),
    ({"type": "Adam", "params": {"eps": 0}}, "optimizer.params.eps", "> 0"),
    ({"type": "SGD", "params": {"nesterov": "yes"}}, "optimizer.params.nesterov", "true or false"),
    ({"type": "Lamb", "params": {"amsgrad": True}}, "optimizer.params.amsgrad", "refuses AMSGrad"),
    ({"type": "SGD", "params": {"betas": [0.9, 0.99]}}, "optimizer.params.betas", "a parameter of SGD"),
    ({"type": "Adam", "param": {}}, "optimizer.param", "Did you mean 'params'?"),
])
def test_bad_blocks_name_the_key(block, path, text):
    with pytest.raises(kmp.ConfigError) as info:
        kmp.load_config({"optimizer": block})
    problem = info.value.problems[0]
    assert problem.path == path
    assert text in f"{problem.expected} {problem.fix}"


def test_max_grad_norm_in_params_is_ignored_with_a_warning():
    # Files from before DeepSpeed 0.3 (bing_bert) have it; DeepSpeed refuses it today.
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 is ignored"):
        config = kmp.load_config(CORPUS / "dse__bing_bert__deepspeed_bsz4096_adam_config.json")
    assert keras_arguments(config.optimizer)[0] in ("Adam", "AdamW")


def test_the_transformers_zero3_file_trains_with_its_own_optimizer():
    # The example: lr 3e-5, weight decay 3e-7 (not Keras's 1e-3 and 0.004).
    keras.config.set_dtype_policy("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = kmp.wrap(config=CORPUS / "transformers__tests__deepspeed__ds_config_zero3.json",
                             precision="float32")
    inner = optimizer.inner_optimizer if isinstance(optimizer, kmp.LossScaleOptimizer) else optimizer
    assert type(inner) is keras.optimizers.AdamW
    assert inner.weight_decay == pytest.approx(3e-7) and inner.beta_1 == 0.8 and inner.epsilon == 1e-8


def test_a_passed_optimizer_wins_and_one_warning_lists_what_differs():
    keras.config.set_dtype_policy("float32")
    mine = keras.optimizers.AdamW(1e-3, weight_decay=0.004)
    with pytest.warns(UserWarning) as record:
        got = kmp.wrap(mine, {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 3e-7,
                                                                         "eps": 1e-7}}})
    assert got is mine
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert "lr: 3e-05 in the config, 0.001 in the optimizer" in messages[0]
    assert "weight_decay" in messages[0] and "eps" not in messages[0]  # eps matches


def test_no_optimizer_anywhere_is_an_error():
    with pytest.raises(kmp.ConfigError, match="an optimizer, or a config with an optimizer block"):
        kmp.wrap(config={"fp16": {"enabled": False}})


def test_round_trip_keeps_the_optimizer_block():
    config = kmp.load_config({"optimizer": {"type": "OneBitLamb", "params": {"lr": 0.01, "max_coeff": 0.3}}})
    assert kmp.load_config(kmp.to_deepspeed(config)) == config
