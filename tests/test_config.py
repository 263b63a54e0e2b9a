"""kmp.config.settings: defaults, one problem per invalid field, validation on construction, numpy scalars,
float32/int64 ranges."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest

import kmp
from kmp.config.settings import Communication, Config, LossScaleConfig
from kmp.errors import ConfigError


def problems_of(kind, **fields):
    """The problems constructing `kind(**fields)` reports ([] when it is valid)."""
    try:
        kind(**fields)
    except ConfigError as e:
        return list(e.problems)
    return []


def test_loss_scale_defaults_are_the_specs_python_column():
    # The loss-scaling contract's Defaults table, left column (Keras's); docs/loss-scaling.md.
    c = LossScaleConfig()
    assert c.initial_scale == 2.0**15
    assert c.dynamic_growth_steps == 2000
    assert c.hysteresis == 1
    assert c.consecutive_hysteresis is False
    assert c.min_scale == 1.0
    assert c.raise_at_min_scale is True
    assert c.growth_rule == "every_window"
    assert c.max_scale == 2.0**24
    assert c.static_scale is None and c.dynamic
    assert (c.growth_factor, c.backoff_factor) == (2.0, 0.5)


def test_config_defaults():
    c = Config()
    assert c.precision == "fp32"
    assert c.loss_scale == LossScaleConfig()
    assert c.gradient_clipping is None
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (None, None, None)


def test_static_scale_is_not_dynamic():
    assert not LossScaleConfig(static_scale=128.0).dynamic


# Each bad value alone must give exactly one problem, on its own field.
LOSS_SCALE_BAD = [
    ("initial_scale", 0), ("initial_scale", -1.0), ("initial_scale", math.inf), ("initial_scale", math.nan),
    ("initial_scale", "1024"), ("initial_scale", True), ("initial_scale", 0.5), ("initial_scale", 2.0**30),
    ("initial_scale", 1e39), ("dynamic_growth_steps", 2**63), ("hysteresis", 2**63), ("hysteresis", 2**70),
    ("min_scale", 1e-300), ("max_scale", 1e39), ("static_scale", 1e39), ("static_scale", 1e-300),
    ("dynamic_growth_steps", 0), ("dynamic_growth_steps", 10.0), ("dynamic_growth_steps", "10"),
    ("dynamic_growth_steps", True),
    ("hysteresis", 0), ("hysteresis", 2.0), ("hysteresis", None), ("hysteresis", True),
    ("consecutive_hysteresis", 1), ("consecutive_hysteresis", "true"), ("consecutive_hysteresis", None),
    ("min_scale", 0), ("min_scale", -1), ("min_scale", math.inf), ("min_scale", "1"), ("min_scale", True),
    ("max_scale", 0), ("max_scale", math.inf), ("max_scale", "big"), ("max_scale", False),
    ("raise_at_min_scale", 0), ("raise_at_min_scale", "yes"),
    ("growth_rule", "every"), ("growth_rule", None), ("growth_rule", 1), ("growth_rule", "EVERY_WINDOW"),
    ("static_scale", 0), ("static_scale", -2.0), ("static_scale", math.inf), ("static_scale", "128"),
    ("static_scale", True),
    ("growth_factor", 1), ("growth_factor", 0.5), ("growth_factor", math.inf), ("growth_factor", True),
    ("backoff_factor", 0), ("backoff_factor", 1), ("backoff_factor", 1.5), ("backoff_factor", "0.5"),
    ("backoff_factor", True),
]


@pytest.mark.parametrize("field,value", LOSS_SCALE_BAD)
def test_each_invalid_loss_scale_value_is_one_problem_on_its_field(field, value):
    problems = problems_of(LossScaleConfig, **{field: value})
    assert [p.path for p in problems] == [field]
    assert problems[0].expected
    assert problems[0].received is value


CONFIG_BAD = [
    ("precision", "fp8"), ("precision", "FP16"), ("precision", None), ("precision", "mixed_float16"),
    ("gradient_clipping", 0), ("gradient_clipping", -1.0), ("gradient_clipping", math.inf),
    ("gradient_clipping", "1.0"), ("gradient_clipping", True),
    ("train_batch_size", 0), ("train_batch_size", -8), ("train_batch_size", 32.0), ("train_batch_size", "32"),
    ("train_batch_size", True),
    ("micro_batch_size", 0), ("micro_batch_size", 4.5), ("micro_batch_size", True),
    ("gradient_accumulation_steps", 0), ("gradient_accumulation_steps", "2"), ("gradient_accumulation_steps", True),
    ("gradient_clipping", 1e39), ("gradient_clipping", 3.5e38), ("train_batch_size", 2**63),
    ("gradient_predivide_factor", 1e-300), ("gradient_predivide_factor", 1e300), ("communication_data_type", []),
    ("strategy", ["mirrored"]), ("precision", {"fp16": True}),
]


@pytest.mark.parametrize("field,value", CONFIG_BAD)
def test_each_invalid_config_value_is_one_problem_on_its_field(field, value):
    problems = problems_of(Config, **{field: value})
    assert [p.path for p in problems] == [field]
    assert problems[0].received is value


@pytest.mark.parametrize("field", ["hysteresis", "dynamic_growth_steps"])
def test_bool_is_not_an_int(field):
    # True == 1 in Python; a JSON `true` for a count is still a mistake.
    assert [p.path for p in problems_of(LossScaleConfig, **{field: True})] == [field]
    assert [p.path for p in problems_of(Config, train_batch_size=True)] == ["train_batch_size"]


def test_relations_between_scales():
    # max below min: both the floor and the initial scale are out of order.
    problems = problems_of(LossScaleConfig, max_scale=0.5)
    assert [p.path for p in problems] == ["min_scale", "initial_scale"]
    assert "max_scale=0.5" in problems[0].expected
    assert [p.path for p in problems_of(LossScaleConfig, min_scale=2.0**16)] == ["initial_scale"]
    # A bad bound is reported once, not again as a broken relation.
    assert [p.path for p in problems_of(LossScaleConfig, max_scale=-1.0)] == ["max_scale"]


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        LossScaleConfig(hysteresis=0, growth_rule="sometimes", backoff_factor=2.0, consecutive_hysteresis="no")
    assert sorted(p.path for p in info.value.problems) == [
        "backoff_factor", "consecutive_hysteresis", "growth_rule", "hysteresis"]
    assert "(4 problems)" in str(info.value)
    assert [p.path for p in problems_of(Config, precision="fp8", train_batch_size=0)] == ["precision", "train_batch_size"]


def test_an_instance_exists_only_if_valid():
    # Validated once, at construction: downstream code checks nothing again.
    with pytest.raises(ConfigError) as info:
        Config(precision="fp8")
    assert str(info.value).startswith("Invalid kmp config (1 problem):")
    assert "'fp32', 'fp16', 'bf16'" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert [p.path for p in problems_of(Config, loss_scale={"hysteresis": 2})] == ["loss_scale"]
    assert [p.path for p in problems_of(Communication, dtype="fp16", bytes_per_pack=-1)] == ["dtype", "bytes_per_pack"]


def test_numpy_scalars_are_numbers_stored_as_python_numbers():
    c = LossScaleConfig(hysteresis=np.int64(2), initial_scale=np.float32(1024.0), dynamic_growth_steps=np.int32(7))
    assert (c.hysteresis, c.initial_scale, c.dynamic_growth_steps) == (2, 1024.0, 7)
    assert (type(c.hysteresis), type(c.initial_scale), type(c.dynamic_growth_steps)) == (int, float, int)
    config = Config(gradient_clipping=np.float64(1.5), train_batch_size=np.int64(32))
    assert (type(config.gradient_clipping), type(config.train_batch_size)) == (float, int)
    assert [p.path for p in problems_of(LossScaleConfig, hysteresis=np.float32(2.0))] == ["hysteresis"]
    assert [p.path for p in problems_of(LossScaleConfig, consecutive_hysteresis=np.bool_(True))] == [
        "consecutive_hysteresis"]


def test_relations_name_the_json_keys_when_read_from_deepspeed():
    with pytest.raises(ConfigError) as info:
        kmp.load_config({"fp16": {"enabled": True, "min_loss_scale": 4.0, "hysteresis": 0}, "kmp": {"max_scale": 2.0}})
    problems = {p.path: p for p in info.value.problems}
    assert set(problems) == {"fp16.min_loss_scale", "fp16.hysteresis", "fp16.initial_scale_power"}
    assert "kmp.max_scale=2.0" in problems["fp16.min_loss_scale"].expected


def test_configs_are_frozen_values():
    c = LossScaleConfig()
    with pytest.raises(AttributeError):
        c.hysteresis = 2
    assert LossScaleConfig(hysteresis=2) == LossScaleConfig(hysteresis=2)
    assert hash(Config()) == hash(Config())


@pytest.mark.parametrize("module", ["config/settings.py", "errors.py", "config/deepspeed.py",
                                    "config/zero_block.py", "scaling/state.py", "values.py"])
def test_pure_modules_import_no_tensorflow_or_keras(module):
    tree = ast.parse((Path(__file__).parent.parent / "kmp" / module).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n.split(".")[0] for n in names} & {"tensorflow", "keras", "tf_keras", "numpy"}
