"""kmp.config: defaults, one problem per invalid field, key paths, validated()."""

import ast
import math
from pathlib import Path

import pytest

from kmp.config import Config, LossScaleConfig
from kmp.errors import ConfigError


def test_loss_scale_defaults_are_the_specs_python_column():
    # ../shared/spec/loss-scaling.md, Defaults table, left column (Keras's).
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
    assert c.problems() == []


def test_config_defaults():
    c = Config()
    assert c.precision == "fp32"
    assert c.loss_scale == LossScaleConfig()
    assert c.gradient_clipping is None
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (None, None, None)
    assert c.problems() == []


def test_static_scale_is_not_dynamic():
    assert not LossScaleConfig(static_scale=128.0).dynamic


# Each bad value alone must give exactly one problem, on its own field.
LOSS_SCALE_BAD = [
    ("initial_scale", 0), ("initial_scale", -1.0), ("initial_scale", math.inf), ("initial_scale", math.nan),
    ("initial_scale", "1024"), ("initial_scale", True), ("initial_scale", 0.5), ("initial_scale", 2.0**30),
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
    problems = LossScaleConfig(**{field: value}).problems()
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
]


@pytest.mark.parametrize("field,value", CONFIG_BAD)
def test_each_invalid_config_value_is_one_problem_on_its_field(field, value):
    problems = Config(**{field: value}).problems()
    assert [p.path for p in problems] == [field]
    assert problems[0].received is value


@pytest.mark.parametrize("field", ["hysteresis", "dynamic_growth_steps"])
def test_bool_is_not_an_int(field):
    # True == 1 in Python; a JSON `true` for a count is still a mistake.
    assert [p.path for p in LossScaleConfig(**{field: True}).problems()] == [field]
    assert [p.path for p in Config(train_batch_size=True).problems()] == ["train_batch_size"]


def test_relations_between_scales():
    # max below min: both the floor and the initial scale are out of order.
    problems = LossScaleConfig(max_scale=0.5).problems()
    assert [p.path for p in problems] == ["min_scale", "initial_scale"]
    assert "max_scale=0.5" in problems[0].expected
    assert [p.path for p in LossScaleConfig(min_scale=2.0**16).problems()] == ["initial_scale"]
    # A bad bound is reported once, not again as a broken relation.
    assert [p.path for p in LossScaleConfig(max_scale=-1.0).problems()] == ["max_scale"]


def test_several_problems_are_reported_together():
    c = LossScaleConfig(hysteresis=0, growth_rule="sometimes", backoff_factor=2.0, consecutive_hysteresis="no")
    assert sorted(p.path for p in c.problems()) == [
        "backoff_factor", "consecutive_hysteresis", "growth_rule", "hysteresis"]
    with pytest.raises(ConfigError) as info:
        c.validated()
    assert len(info.value.problems) == 4
    assert "(4 problems)" in str(info.value)

    config = Config(precision="fp8", train_batch_size=0, loss_scale=LossScaleConfig(hysteresis=0))
    assert [p.path for p in config.problems()] == ["precision", "train_batch_size", "loss_scale.hysteresis"]


def test_paths_rename_fields_in_problems_and_messages():
    c = LossScaleConfig(hysteresis=0, dynamic_growth_steps=0)
    problems = c.problems(paths={"hysteresis": "fp16.hysteresis"})
    assert [p.path for p in problems] == ["dynamic_growth_steps", "fp16.hysteresis"]
    assert "Received: fp16.hysteresis=0." in str(problems[1])

    # Relations name the other field by its renamed path too.
    relation = LossScaleConfig(min_scale=4.0, max_scale=2.0).problems(
        paths={"min_scale": "fp16.min_loss_scale", "max_scale": "kmp.max_scale"})
    assert relation[0].path == "fp16.min_loss_scale"
    assert "kmp.max_scale=2.0" in relation[0].expected


def test_config_paths_reach_nested_loss_scale_fields():
    config = Config(micro_batch_size=0, loss_scale=LossScaleConfig(hysteresis=0, min_scale=0))
    paths = {"micro_batch_size": "train_micro_batch_size_per_gpu", "loss_scale.hysteresis": "fp16.hysteresis"}
    assert [p.path for p in config.problems(paths=paths)] == [
        "train_micro_batch_size_per_gpu", "loss_scale.min_scale", "fp16.hysteresis"]


def test_validated_returns_self_or_raises():
    c = LossScaleConfig(hysteresis=3)
    assert c.validated() is c
    config = Config(precision="bf16", train_batch_size=8)
    assert config.validated() is config

    with pytest.raises(ConfigError) as info:
        Config(precision="fp8").validated(source="my settings")
    assert [p.path for p in info.value.problems] == ["precision"]
    assert str(info.value).startswith("Invalid my settings (1 problem):")
    assert "'fp32', 'fp16', 'bf16'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_configs_are_frozen_values():
    c = LossScaleConfig()
    with pytest.raises(AttributeError):
        c.hysteresis = 2
    assert LossScaleConfig(hysteresis=2) == LossScaleConfig(hysteresis=2)
    assert hash(Config()) == hash(Config())


@pytest.mark.parametrize("module", ["config.py", "errors.py", "deepspeed.py", "loss_scale.py"])
def test_pure_modules_import_no_tensorflow_or_keras(module):
    tree = ast.parse((Path(__file__).parent.parent / "kmp" / module).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n.split(".")[0] for n in names} & {"tensorflow", "keras", "tf_keras", "numpy"}
