"""Fuzzing every public way of configuring kmp with malformed settings (issue 10).

Fuzzed with hypothesis, derandomized (every run draws the same cases):
`kmp.load_config` (a dict, JSON text, a JSON file), `kmp.LossScaleConfig`,
`kmp.Config`, `kmp.Communication`, `kmp.resolve_batch_sizes`,
`kmp.resolve_precision` (with `kmp.Hardware`),
`kmp.callbacks.GradientAccumulationScheduler`,
`kmp.distribute.resolve_strategy` (malformed TF_CONFIG; its builders are
replaced, so no cluster is ever built), `kmp.wrap` and
`kmp.LossScaleOptimizer`. Values: wrong types, NaN, +-inf, 0, negatives, ints
past int64, floats past or below float32's range, numpy scalars, misspelled
keys, blocks of the wrong type, duplicate keys, invalid JSON, "auto".

A case passes when it ends in exactly one of:
- a `kmp.ConfigError` whose every problem has a non-blank key path, named in
  the message;
- acceptance, with every accepted value inside its domain as checked by this
  file's own oracle (written here, not imported from kmp): scales finite, > 0
  and normal float32s; factors on the right side of 1 in float32 too; counts
  ints in [1, 2**63-1]; booleans real bools; names among the allowed choices;
  numbers stored as plain Python int/float; and the stored values the ones
  given.
Any other exception (TypeError, OverflowError, a bare ValueError, a
TensorFlow error, ...) fails the case.

1,880 generated cases in all (the max_examples below), about 15 s here. Each
test also replays, as @example, the cases that found defects in kmp. Two
defects of kmp/scaling/optimizer.py it found are regression tests at the end of the file.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import re
from collections.abc import Hashable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kmp
from kmp.config.auto import auto_paths
from kmp.config.deepspeed import _IGNORED  # the DeepSpeed keys kmp reads past: data, not a check
from kmp.distribute import strategy as strategy_module

pytestmark = [
    pytest.mark.filterwarnings("ignore:kmp does not act on these keys:UserWarning"),
    pytest.mark.filterwarnings("ignore:precision=.* is a legacy spelling:UserWarning"),
    pytest.mark.filterwarnings("ignore:The config asks for:UserWarning"),
]


def fuzz(max_examples: int):
    return settings(
        max_examples=max_examples, derandomize=True, database=None, deadline=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


# --- The oracle: domains, written independently of kmp.values ------------------------------------

F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38  # the smallest normal float32
I64_MAX = 2**63 - 1
PREDIVIDE = (2.0**-20, 2.0**20)


def f32(x) -> float:
    """`x` as float32 holds it (call only with |x| <= F32_MAX)."""
    return float(np.float32(x))


def plain_number(v) -> bool:
    return type(v) in (int, float)


def scale_ok(v) -> bool:
    """A finite number > 0 that float32 holds as a normal number."""
    return plain_number(v) and 0 < v <= F32_MAX and F32_TINY <= f32(v) <= F32_MAX


def count_ok(v, low=1) -> bool:
    return type(v) is int and low <= v <= I64_MAX


def growth_ok(v) -> bool:
    return plain_number(v) and 1 < v <= F32_MAX and f32(v) > 1


def backoff_ok(v) -> bool:
    return plain_number(v) and 0 < v < 1 and 0 < f32(v) < 1


def predivide_ok(v) -> bool:
    return plain_number(v) and PREDIVIDE[0] <= v <= PREDIVIDE[1]


def expect(ok: bool, what: str, value) -> None:
    assert ok, f"silently accepted {what}={value!r}"


def check_loss_scale(c) -> None:
    assert type(c) is kmp.LossScaleConfig
    for name in ("initial_scale", "min_scale", "max_scale"):
        expect(scale_ok(getattr(c, name)), name, getattr(c, name))
    expect(c.min_scale <= c.initial_scale <= c.max_scale, "min <= initial <= max",
           (c.min_scale, c.initial_scale, c.max_scale))
    expect(c.static_scale is None or scale_ok(c.static_scale), "static_scale", c.static_scale)
    expect(count_ok(c.dynamic_growth_steps), "dynamic_growth_steps", c.dynamic_growth_steps)
    expect(count_ok(c.hysteresis), "hysteresis", c.hysteresis)
    for name in ("consecutive_hysteresis", "raise_at_min_scale"):
        expect(type(getattr(c, name)) is bool, name, getattr(c, name))
    expect(type(c.growth_rule) is str and c.growth_rule in ("every_window", "after_window"),
           "growth_rule", c.growth_rule)
    expect(growth_ok(c.growth_factor), "growth_factor", c.growth_factor)
    expect(backoff_ok(c.backoff_factor), "backoff_factor", c.backoff_factor)


def check_communication(c) -> None:
    assert type(c) is kmp.Communication
    expect(type(c.dtype) is str and c.dtype in ("float32", "float16", "bfloat16"), "dtype", c.dtype)
    expect(count_ok(c.bytes_per_pack, 0), "bytes_per_pack", c.bytes_per_pack)
    expect(c.predivide_factor is None or predivide_ok(c.predivide_factor), "predivide_factor", c.predivide_factor)


def check_config(c) -> None:
    assert type(c) is kmp.Config
    choices = {"precision": ("fp32", "fp16", "bf16"),
               "strategy": ("auto", "default", "mirrored", "multi_worker_mirrored", "tpu"),
               "communication_data_type": ("float32", "float16", "bfloat16")}
    for name, allowed in choices.items():
        expect(type(getattr(c, name)) is str and getattr(c, name) in allowed, name, getattr(c, name))
    check_loss_scale(c.loss_scale)
    expect(c.gradient_clipping is None or scale_ok(c.gradient_clipping), "gradient_clipping", c.gradient_clipping)
    for name in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"):
        expect(getattr(c, name) is None or count_ok(getattr(c, name)), name, getattr(c, name))
    expect(c.prescale_gradients in (None, True, False) and type(c.prescale_gradients) in (type(None), bool),
           "prescale_gradients", c.prescale_gradients)
    expect(c.gradient_predivide_factor is None or predivide_ok(c.gradient_predivide_factor),
           "gradient_predivide_factor", c.gradient_predivide_factor)
    expect(count_ok(c.allreduce_bytes_per_pack, 0), "allreduce_bytes_per_pack", c.allreduce_bytes_per_pack)
    check_communication(c.communication())


def same(stored, given) -> bool:
    """`stored` is `given` as a plain Python value (numpy scalars unwrapped)."""
    if isinstance(given, np.generic):
        given = given.item()
    if isinstance(given, Fraction):
        given = float(given)
    return type(stored) in (int, float, bool, str, type(None)) and stored == given


def ends_well(call, oracle) -> str:
    """One case: a ConfigError with key paths, or an accepted result the oracle passes."""
    try:
        result = call()
    except kmp.ConfigError as error:
        message = str(error)
        assert error.problems, "a ConfigError listing no problem"
        for p in error.problems:
            assert isinstance(p.path, str) and p.path.strip(), f"a problem without a key path: {p!r}"
            assert p.path in message, f"the message does not name {p.path!r}: {message}"
        return "error"
    oracle(result)
    return "accepted"


# --- Values ---------------------------------------------------------------------------------------

SPECIAL = [
    0, 1, -1, 2, 0.0, -0.0, 0.5, 1.0, 2.0, -2.5, math.nan, -math.nan, math.inf, -math.inf,
    2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, 10**400, -(10**400),
    1e39, 3.5e38, F32_MAX, 3.4028235e38, 1e-300, 1e-45, 1e-40, F32_TINY, 5e-324, 1e300,
    1.0000000001, 0.99999999999, 2.0**-21, 2.0**21, 2.0**24, 2.0**-20,
]
NUMPY = [
    np.int64(2), np.int64(-3), np.int32(7), np.int8(0), np.uint64(2**64 - 1), np.int64(2**63 - 1),
    np.float32(0.5), np.float32(1024), np.float32(np.inf), np.float32(np.nan), np.float64(1e39),
    np.float64(2.0), np.float16(2), np.longdouble(0.5), np.longdouble(1e39), np.bool_(True), np.bool_(False),
]
OTHER = [
    None, True, False, "", " ", "auto", "Auto", "1", "2.0", "true", "nan", "inf", "fp16", [], [1], [1, 2], {},
    {"a": 1}, (1, 2), np.array([1, 2]), np.zeros(0), np.array(3), Fraction(1, 3), Fraction(10**400, 3),
    Decimal("1.5"), Decimal("nan"), 1 + 2j, b"1", object(),
]
WRONG = st.one_of(
    st.sampled_from(SPECIAL), st.sampled_from(NUMPY), st.sampled_from(OTHER),
    st.integers(), st.floats(), st.text(max_size=6),
)


EDGE = st.sampled_from(SPECIAL)
FAULTS = st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3])  # how many settings one case gets wrong

# The values at the edges of each kind of setting: few, so that each is drawn often.
KIND_EDGES = {
    "scale": st.sampled_from([0, 0.0, -1.0, math.nan, math.inf, -math.inf, 1e39, 3.5e38, 3.4028235e38, 1e-300, 1e-45,
                              1e-40, 10**400, 2**128, np.float32(np.inf), np.float64(1e39), True, "1.0"]),
    "count": st.sampled_from([0, -1, 2**63, 2**64, 10**400, 1.0, 2.5, True, np.int64(0), np.uint64(2**64 - 1),
                              np.float32(2), math.inf, math.nan, "2", None]),
    "factor": st.sampled_from([1, 1.0, 1.0000000001, 0.99999999999, 1 + 2**-30, 1 - 2**-30, 0, 1e-46, 1e-300,
                               math.inf, math.nan, 1e39, -0.5, 2, 0.5, "2"]),
    "bool": st.sampled_from([0, 1, "true", "false", np.bool_(True), None, 1.0]),
    "choice": st.sampled_from(["", "auto", "Auto", "EVERY_WINDOW", "fp8", "float16 ", None, 1, ["fp16"]]),
    "range": st.sampled_from([2.0**-21, 2.0**21, 0, -1, math.inf, math.nan, 1e-300, 1e300, True]),
    "communication": st.sampled_from([5, "float16", {"dtype": "fp8"}, {"bytez": 1}, {"predivide_factor": 1e-300},
                                      {"": 1}, {"bytes_per_pack": -1}]),
}
KIND_OF = {
    **dict.fromkeys(["initial_scale", "min_scale", "max_scale", "static_scale", "gradient_clipping",
                     "fp16.loss_scale", "fp16.min_loss_scale", "kmp.max_scale"], "scale"),
    **dict.fromkeys(["dynamic_growth_steps", "hysteresis", "train_batch_size", "micro_batch_size",
                     "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "fp16.loss_scale_window",
                     "fp16.hysteresis", "fp16.initial_scale_power", "bytes_per_pack", "allreduce_bytes_per_pack",
                     "kmp.allreduce_bytes_per_pack"], "count"),
    **dict.fromkeys(["growth_factor", "backoff_factor", "kmp.growth_factor", "kmp.backoff_factor"], "factor"),
    **dict.fromkeys(["consecutive_hysteresis", "raise_at_min_scale", "prescale_gradients", "fp16.enabled",
                     "bf16.enabled", "fp16.consecutive_hysteresis", "kmp.raise_at_min_scale", "log_overflows",
                     "fused"], "bool"),
    **dict.fromkeys(["growth_rule", "precision", "strategy", "communication_data_type", "dtype", "kmp.growth_rule",
                     "kmp.strategy"], "choice"),
    **dict.fromkeys(["gradient_predivide_factor", "predivide_factor"], "range"),
    "communication": "communication",
}


def edges(name: str) -> st.SearchStrategy:
    """Edge values for the setting `name` (a field name or a DeepSpeed key path)."""
    return KIND_EDGES[KIND_OF[name]] if name in KIND_OF else EDGE


COUNT = st.one_of(st.integers(1, 8), st.sampled_from([1000, 2000, I64_MAX, np.int64(4)]))
SCALE = st.one_of(st.sampled_from([1.0, 2.0, 1024, 2.0**15, 2.0**24, np.float32(256)]), st.floats(1.0, 2.0**24))
BOOL = st.booleans()


def misspelled(names: list[str], reserved=()) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(names), st.text(max_size=6)).filter(lambda n: n not in reserved)


@st.composite
def faulty(draw, good: dict[str, st.SearchStrategy], wrong_names: list[str] | None, reserved=()):
    """Valid settings (some of `good`'s names, each a valid value), then FAULTS faults: a
    value replaced by anything or by a number at an edge, or an unknown name added
    (not when `wrong_names` is None). One fault alone is the common case, so that it
    is not hidden behind another."""
    fields = {name: draw(good[name]) for name in draw(st.lists(st.sampled_from(sorted(good)), unique=True))}
    for _ in range(draw(FAULTS)):
        fault = draw(st.sampled_from(["wrong", "edge", "edge"] + (["name"] if wrong_names is not None else [])))
        if fault == "name":
            fields[draw(misspelled(wrong_names, reserved))] = draw(WRONG)
        else:
            name = draw(st.sampled_from(sorted(good)))
            fields[name] = draw(WRONG if fault == "wrong" else edges(name))
    return fields


# --- kmp.LossScaleConfig, kmp.Config, kmp.Communication -------------------------------------------

LOSS_SCALE_FIELDS = {
    "initial_scale": SCALE, "dynamic_growth_steps": COUNT, "hysteresis": COUNT, "consecutive_hysteresis": BOOL,
    "min_scale": st.sampled_from([1.0, 1, 0.5, 2.0**-10, F32_TINY]),
    "max_scale": st.sampled_from([2.0**24, 2.0**30, F32_MAX]),
    "raise_at_min_scale": BOOL, "growth_rule": st.sampled_from(["every_window", "after_window"]),
    "static_scale": st.one_of(st.none(), SCALE), "growth_factor": st.sampled_from([2.0, 1.5, 4, 1.001]),
    "backoff_factor": st.sampled_from([0.5, 0.25, 0.999, np.float32(0.5)]),
}
LOSS_SCALE_KWARGS = faulty(
    LOSS_SCALE_FIELDS, ["hysterisis", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "self", "dynamic"])


# Beside the generated cases, each test runs the cases that found kmp defects (regressions).
@fuzz(250)
@example({"hysterisis": 2})  # was a TypeError
@example({"self": 1})
@example({"min_scale": -(10**400)})  # was an OverflowError
@example({"max_scale": Fraction(10**400, 3)})
@example({"backoff_factor": 0.99999999999})  # 1.0 in float32: was accepted
@example({"growth_factor": 1.0000000001})
@example({"initial_scale": Fraction(1024, 1), "hysteresis": np.int64(2)})  # was stored as a Fraction
@given(LOSS_SCALE_KWARGS)
def test_loss_scale_config(fields):
    def oracle(c):
        check_loss_scale(c)
        for name, value in fields.items():
            expect(same(getattr(c, name), value), name, value)

    ends_well(lambda: kmp.LossScaleConfig(**fields), oracle)


VALID_LOSS_SCALES = st.sampled_from([
    kmp.LossScaleConfig(), kmp.LossScaleConfig(static_scale=128.0),
    kmp.LossScaleConfig(hysteresis=2, growth_rule="after_window", initial_scale=2.0**16),
])
CONFIG_FIELDS = {
    "precision": st.sampled_from(["fp32", "fp16", "bf16"]), "loss_scale": VALID_LOSS_SCALES,
    "gradient_clipping": st.one_of(st.none(), st.sampled_from([1.0, 0.5, 5])), "train_batch_size": COUNT,
    "micro_batch_size": COUNT, "gradient_accumulation_steps": COUNT,
    "strategy": st.sampled_from(["auto", "default", "mirrored", "multi_worker_mirrored", "tpu"]),
    "communication_data_type": st.sampled_from(["float32", "float16", "bfloat16"]),
    "prescale_gradients": st.one_of(st.none(), BOOL),
    "gradient_predivide_factor": st.sampled_from([None, 1.0, 8, 2.0**20]),
    "allreduce_bytes_per_pack": st.one_of(st.integers(0, 2**30), st.just(I64_MAX)),
}
CONFIG_KWARGS = faulty(CONFIG_FIELDS, ["train_micro_batch_size_per_gpu", "fp16", "clipping", "loss_scales", "precison"])


@fuzz(150)
@example({"precison": "fp16"})
@example({"": 1})
@given(CONFIG_KWARGS)
def test_config(fields):
    def oracle(c):
        check_config(c)
        for name, value in fields.items():
            expect(c.loss_scale is value if name == "loss_scale" else same(getattr(c, name), value), name, value)

    ends_well(lambda: kmp.Config(**fields), oracle)


COMMUNICATION_FIELDS = {
    "dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
    "bytes_per_pack": st.one_of(st.integers(0, 2**30), st.just(I64_MAX)),
    "predivide_factor": st.sampled_from([None, 1.0, 4, 2.0**-20, 2.0**20]),
}
COMMUNICATION_KWARGS = faulty(
    COMMUNICATION_FIELDS, ["data_type", "communication_data_type", "bytes_per_packs", "gradient_predivide_factor"])


@fuzz(80)
@example({"data_type": "float16"})
@given(COMMUNICATION_KWARGS)
def test_communication(fields):
    def oracle(c):
        check_communication(c)
        for name, value in fields.items():
            expect(same(getattr(c, name), value), name, value)

    ends_well(lambda: kmp.Communication(**fields), oracle)


# --- kmp.load_config: DeepSpeed-style dicts, JSON text, JSON files --------------------------------

DS_KEYS = {
    "": {
        "train_batch_size": COUNT, "train_micro_batch_size_per_gpu": COUNT, "gradient_accumulation_steps": COUNT,
        "gradient_clipping": st.sampled_from([0, 0.0, 1.0, 5]),
        "communication_data_type": st.sampled_from(["fp32", "fp16", "bf16"]), "prescale_gradients": BOOL,
        "gradient_predivide_factor": st.sampled_from([1.0, 2, 8.0]),
    },
    "fp16": {
        "enabled": BOOL, "loss_scale": st.sampled_from([0, 0.0, 128.0, 1]), "initial_scale_power": st.integers(0, 24),
        "loss_scale_window": COUNT, "hysteresis": COUNT, "consecutive_hysteresis": BOOL,
        "min_loss_scale": st.sampled_from([1, 1.0, 0.5, 2.0**-10]),
    },
    "bf16": {"enabled": BOOL},
    "kmp": {
        "growth_rule": st.sampled_from(["every_window", "after_window"]),
        "max_scale": st.sampled_from([2.0**24, 2.0**32]),
        "raise_at_min_scale": BOOL, "growth_factor": st.sampled_from([2.0, 1.5, 3]),
        "backoff_factor": st.sampled_from([0.5, 0.25]),
        "strategy": st.sampled_from(["auto", "default", "mirrored", "multi_worker_mirrored", "tpu"]),
        "allreduce_bytes_per_pack": st.one_of(st.integers(0, 2**30), st.just(I64_MAX)),
    },
}
DS_MISSPELLED = {
    "": ["train_batch_sise", "gradient_clip", "hysteresis", "fp16.hysteresis", "loss_scale", "FP16", "bf_16",
         "zero_optimisation", "zero_optimization", "optimizer", "steps_per_print", "wall_clock_breakdown", ""],
    "fp16": ["hysterisis", "initial_scale", "loss_scale_windows", "min_scale", "auto_cast", "enable", ""],
    "bf16": ["enable", "immediate_grad_update", "loss_scale"],
    "kmp": ["growthrule", "max_loss_scale", "strategies", "hysteresis", " "],
}


@st.composite
def deepspeed_dicts(draw):
    """A valid DeepSpeed-style config, then FAULTS faults: a value, an unknown key, a block of the wrong type,
    bfloat16 (bf16's old name) beside bf16, fp16 and bf16 both enabled."""
    config = {}
    for level in ("", "fp16", "bf16", "kmp"):
        keys = draw(st.lists(st.sampled_from(sorted(DS_KEYS[level])), unique=True, max_size=4 if level else 3))
        if level and not keys and draw(st.booleans()):
            continue
        block = {key: draw(DS_KEYS[level][key]) for key in keys}
        if level == "bf16" and block.get("enabled") is True and config.get("fp16", {}).get("enabled") is True:
            block["enabled"] = False  # one precision; both enabled is a fault below
        (config.setdefault(level, {}) if level else config).update(block)
    if "bf16" in config and draw(st.integers(0, 3)) == 0:
        config["bfloat16"] = config.pop("bf16")
    for _ in range(draw(FAULTS)):
        level = draw(st.sampled_from(["", "", "fp16", "fp16", "bf16", "kmp"]))
        block = config if not level else config.setdefault(
            "bfloat16" if level == "bf16" and "bfloat16" in config else level, {})
        if not isinstance(block, dict):
            continue
        fault = draw(st.sampled_from(["wrong", "edge", "edge", "name", "name", "block", "old_name", "both"]))
        if fault == "name":
            block[draw(misspelled(DS_MISSPELLED[level]))] = draw(WRONG)
        elif fault == "block" and level:
            config["bfloat16" if level == "bf16" and "bfloat16" in config else level] = draw(WRONG)
        elif fault == "old_name":
            config["bfloat16" if "bf16" in config else "bf16"] = {"enabled": draw(BOOL)}
        elif fault == "both":
            config["fp16"] = {**(config["fp16"] if isinstance(config.get("fp16"), dict) else {}), "enabled": True}
            config["bf16"] = {"enabled": True}
        else:
            key = draw(st.sampled_from(sorted(DS_KEYS[level])))
            block[key] = draw(WRONG if fault == "wrong" else edges(f"{level}.{key}" if level else key))
    if draw(st.integers(0, 9)) == 0:  # keys DeepSpeed reads and kmp ignores: a warning, not an error
        config[draw(st.sampled_from(["zero_optimization", "optimizer", "steps_per_print"]))] = {"stage": 2}
    return config


DS_DICTS = deepspeed_dicts()

INT_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis", "kmp.allreduce_bytes_per_pack"}
BOOL_KEYS = {"prescale_gradients", "fp16.enabled", "fp16.consecutive_hysteresis", "bf16.enabled",
             "kmp.raise_at_min_scale"}
CHOICE_KEYS = {"communication_data_type": ("fp32", "fp16", "bf16"), "kmp.growth_rule": ("every_window", "after_window"),
               "kmp.strategy": ("auto", "default", "mirrored", "multi_worker_mirrored", "tpu")}


def check_loaded(raw, config) -> None:
    """An accepted DeepSpeed config: every key known, every value as given, the Config in its domains."""
    check_config(config)
    assert isinstance(raw, dict), f"accepted a top level that is not an object: {raw!r}"
    assert not ("bf16" in raw and "bfloat16" in raw), "accepted both bf16 and bfloat16"
    levels = {"": raw}
    for block in ("fp16", "bf16", "kmp"):
        name = "bfloat16" if block == "bf16" and "bfloat16" in raw else block
        if name in raw:
            expect(isinstance(raw[name], dict), name, raw[name])
            levels[block] = raw[name]
    given = {}
    for level, values in levels.items():
        for key, value in values.items():
            known = key in DS_KEYS[level] or key in _IGNORED.get(level, []) or (
                not level and key in ("fp16", "bf16", "bfloat16", "kmp", "optimizer", "scheduler",
                                      "zero_optimization"))
            expect(known, f"the unknown key {level}.{key}", value)
            if key in DS_KEYS[level]:
                given[f"{level}.{key}" if level else key] = value
    for path, value in given.items():
        if path in INT_KEYS:
            expect(isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)), path, value)
        if path in BOOL_KEYS:
            expect(type(value) is bool, path, value)
        if path in CHOICE_KEYS:  # DeepSpeed lower-cases communication_data_type
            spelled = value.lower() if path == "communication_data_type" and type(value) is str else value
            expect(type(value) is str and spelled in CHOICE_KEYS[path], path, value)
    ls = config.loss_scale
    stored = {
        "train_batch_size": config.train_batch_size, "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "prescale_gradients": config.prescale_gradients, "gradient_predivide_factor": config.gradient_predivide_factor,
        "fp16.loss_scale_window": ls.dynamic_growth_steps, "fp16.hysteresis": ls.hysteresis,
        "fp16.consecutive_hysteresis": ls.consecutive_hysteresis, "fp16.min_loss_scale": ls.min_scale,
        "kmp.growth_rule": ls.growth_rule, "kmp.max_scale": ls.max_scale,
        "kmp.raise_at_min_scale": ls.raise_at_min_scale, "kmp.growth_factor": ls.growth_factor,
        "kmp.backoff_factor": ls.backoff_factor, "kmp.strategy": config.strategy,
        "kmp.allreduce_bytes_per_pack": config.allreduce_bytes_per_pack,
    }
    for path, value in given.items():
        if path in stored:
            expect(same(stored[path], value), path, value)
    for path, field in (("gradient_clipping", config.gradient_clipping), ("fp16.loss_scale", ls.static_scale)):
        if path in given:
            value = given[path]
            expect(field is None if value == 0 else same(field, value), path, value)
    if "fp16.initial_scale_power" in given:
        expect(ls.initial_scale == 2.0 ** given["fp16.initial_scale_power"], "fp16.initial_scale_power",
               given["fp16.initial_scale_power"])
    if "communication_data_type" in given:
        names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
        expect(config.communication_data_type == names[given["communication_data_type"].lower()],
               "communication_data_type", given["communication_data_type"])
    fp16, bf16 = given.get("fp16.enabled") is True, given.get("bf16.enabled") is True
    expect(not (fp16 and bf16), "fp16.enabled and bf16.enabled", True)
    expect(config.precision == ("fp16" if fp16 else "bf16" if bf16 else "fp32"), "precision", config.precision)


NOT_A_CONFIG = st.sampled_from([None, 3, 2.5, [], [{"fp16": {}}], ("fp16",), b'{"fp16": {}}', object(), True])


@fuzz(300)
@example({"": 1})  # a problem without a path
@example({"fp16": {"initial_scale_power": np.int64(2)}})  # was a TypeError from math.ldexp (CI, 2026-11-24)
@example({"kmp": {"max_scale": np.array([])}})  # was a ValueError from `value == "auto"`
@example({"fp16": {"hysteresis": 10**400}, "gradient_clipping": 10**400})  # was an OverflowError
@given(st.one_of(DS_DICTS, DS_DICTS, DS_DICTS, NOT_A_CONFIG))
def test_load_config_dict(raw):
    # strict: an unknown top-level key is an error too (by default a warning, as DeepSpeed ignores them).
    ends_well(lambda: kmp.load_config(raw, strict=True), lambda config: check_loaded(raw, config))


def strict_json(text: str):
    """The oracle's own reading of JSON text: one key per object, numbers within the digit limit."""
    def pairs(items):
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"accepted duplicate keys: {keys}"
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


def jsonable(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return float(o) if isinstance(o, np.floating) else o.item()
    return str(o)


LITERALS = [
    "1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" + "0" * 5000,
    "9223372036854775808", "9223372036854775807", "1e-400", "3.5e38", "1e39", "true", "null", '"auto"', '"2"',
    "[]", "{}", "0", "-0", "1.0", "2",
]
LITERAL_PATHS = [
    "train_batch_size", "gradient_clipping", "gradient_predivide_factor", "fp16.hysteresis", "fp16.loss_scale",
    "fp16.initial_scale_power", "fp16.min_loss_scale", "fp16.loss_scale_window", "kmp.max_scale",
    "kmp.growth_factor", "kmp.allreduce_bytes_per_pack", "bf16.enabled",
]
BROKEN_JSON = [
    "{", "}", "[", "{'fp16': {}}", '{"fp16": {"enabled": true,}}', '{"a": 1} // comment', '{"a": 1 /* c */}',
    "[" * 100_000, "{" + '"a": {' * 50_000, '{"fp16": {"enabled": True}}', '{"train_batch_size": 0x10}',
    "\ufeff{}", '{"a": 1}}', "[1, 2, 3]", "[]", '{"fp16": {"enabled": "\\ud800"}}', '{"\\u0000": 1}', "{}",
    '{"": 1}', '{"fp16": {"": 2}}', '{" ": 1}', '{"fp16": {"hysteresis": 2, "hysteresis": 2}}',
    '{"train_batch_size": 8, "train_batch_size": 8}', '{"": 1, "": 2}', "  \n {\"bf16\": {\"enabled\": true}}",
    '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', '{"fp16": null}', '{"kmp": []}', "{}" * 2,
    '{"train_batch_size": 1' + "0" * 5000 + "}", '{"fp16": {"hysteresis": -' + "9" * 4400 + "}}",
]


@st.composite
def json_texts(draw):
    if draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(st.sampled_from(BROKEN_JSON), st.text(max_size=20).map(lambda s: "{" + s)))
    d = draw(DS_DICTS)
    text = json.dumps(d, default=jsonable)
    edit = draw(st.sampled_from(["none", "none", "literal", "literal", "duplicate", "truncate"]))
    if edit == "literal":
        block, _, leaf = draw(st.sampled_from(LITERAL_PATHS)).rpartition(".")
        literal = draw(st.sampled_from(LITERALS))
        member = f'"{leaf}": {literal}' if not block else f'"{block}": {{"{leaf}": {literal}}}'
        text = "{" + member + ("}" if text == "{}" else ", " + text[1:])  # may repeat a key: also an error
    elif edit == "duplicate" and d:
        key = draw(st.sampled_from(sorted(d)))
        text = "{" + json.dumps(key) + ": " + json.dumps(d[key], default=jsonable) + ", " + text[1:]
    elif edit == "truncate":
        text = text[: draw(st.integers(0, len(text) - 1))]
    return text


@fuzz(250)
@example('{"gradient_clipping": 1' + "0" * 400 + "}")  # was an OverflowError
@example('{"kmp": {"max_scale": 1' + "0" * 5000 + "}}")  # was a ValueError (Python's digit limit)
@example("[" * 100_000)  # was a RecursionError
@example('{"": 1, "": 2}')
@given(json_texts())
def test_load_config_json_text(text):
    ends_well(lambda: kmp.load_config(text, strict=True), lambda config: check_loaded(strict_json(text), config))


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_configs")


_file_numbers = itertools.count()


@fuzz(100)
@example(text="{}", how="nul")  # was a ValueError
@given(text=json_texts(), how=st.sampled_from(["str", "path", "path", "bytes", "missing", "directory", "nul"]))
def test_load_config_file(json_dir, text, how):
    path = json_dir / f"config{next(_file_numbers)}.json"
    data = text.encode("utf-8", "surrogatepass")
    if how == "bytes":  # not UTF-8
        data = b"\xff\xfe" + data
    path.write_bytes(data)
    source = {"str": str(path), "path": path, "bytes": path, "missing": json_dir / "missing.json",
              "directory": json_dir, "nul": str(path) + "\0.json"}[how]

    def oracle(config):
        assert how in ("str", "path"), f"accepted {source!r}"
        check_loaded(strict_json(Path(source).read_bytes().decode("utf-8")), config)

    ends_well(lambda: kmp.load_config(source, strict=True), oracle)


# --- kmp.resolve_batch_sizes --------------------------------------------------------------------

@st.composite
def batch_sizes(draw):
    """(fields, world size, whether to pass a kmp.Config): consistent sizes, some left out, then FAULTS faults."""
    micro = draw(st.one_of(st.integers(1, 64), st.integers(1, 64), st.sampled_from([2**31, 2**40, 2**62, I64_MAX])))
    gas, world = draw(st.integers(1, 8)), draw(st.one_of(st.integers(1, 16), st.just(np.int64(2))))
    values = [micro * gas * int(world), micro, gas]
    values = [None if draw(st.booleans()) else v for v in values]
    for _ in range(draw(FAULTS)):
        where = draw(st.integers(0, 3))
        bad = draw(st.one_of(st.integers(1, 64), edges("train_batch_size"), WRONG, st.just(2**63)))
        if where == 3:
            world = bad
        else:
            values[where] = bad
    fields = dict(zip(("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"), values))
    return fields, world, draw(st.integers(0, 3)) > 0


@fuzz(150)
@example(({"train_batch_size": None, "micro_batch_size": I64_MAX, "gradient_accumulation_steps": 2}, 1, True))
@example(({"train_batch_size": None, "micro_batch_size": I64_MAX, "gradient_accumulation_steps": None},
          np.int64(2), True))  # wrapped around to -2
@example(({"train_batch_size": 2**64, "micro_batch_size": None, "gradient_accumulation_steps": None},
          np.int32(7), False))  # was an OverflowError
@given(batch_sizes())
def test_resolve_batch_sizes(case):
    fields, world, as_config = case

    def call():
        # Any object with the three fields is read (tests/test_deepspeed.py): a kmp.Config, or one holding anything.
        config = kmp.Config(**fields) if as_config else SimpleNamespace(**fields)
        return kmp.resolve_batch_sizes(config, world)

    def oracle(result):
        train, micro, gas = result
        for name, value in zip(fields, result):
            expect(count_ok(value), name, value)
            expect(fields[name] is None or same(value, fields[name]), name, fields[name])
        expect(count_ok(world) or (isinstance(world, np.integer) and count_ok(int(world))), "world_size", world)
        expect(train == micro * gas * int(world), "train == micro * gas * world", (train, micro, gas, world))
        expect(fields["train_batch_size"] is not None or fields["micro_batch_size"] is not None, "no batch size", None)

    ends_well(call, oracle)


# --- kmp.resolve_precision, kmp.Hardware --------------------------------------------------------

PRECISION_STRINGS = {
    "float32": "float32", "mixed_float16": "mixed_float16", "mixed_bfloat16": "mixed_bfloat16",
    "float16": "float16", "bfloat16": "bfloat16", "float64": "float64", "32-true": "float32",
    "16-mixed": "mixed_float16", "bf16-mixed": "mixed_bfloat16", "16-true": "float16", "bf16-true": "bfloat16",
    "64-true": "float64", "fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16",
    "16": "mixed_float16", "32": "float32", "64": "float64",
}
PRECISION_INTS = {16: "mixed_float16", 32: "float32", 64: "float64"}
POLICY_NAMES = ["float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "float64"]
PRECISION_VALUES = st.one_of(
    st.sampled_from(sorted(PRECISION_STRINGS) + [16, 32, 64, "auto"]), st.just("auto"),
    st.sampled_from(["FP16", "float8", "mixed_float", "16-Mixed", "bf16_mixed", "half", 8, 16.0, 32.0, np.int64(16)]),
    st.sampled_from(POLICY_NAMES).map(keras.DTypePolicy), st.sampled_from(POLICY_NAMES).map(kmp.Precision),
    st.sampled_from(["fp32", "fp16", "bf16"]).map(lambda p: kmp.Config(precision=p)),
    DS_DICTS, WRONG,
)
GPU_CAPABILITY = st.one_of(
    st.none(), st.tuples(st.integers(0, 12), st.integers(0, 9)), st.tuples(st.integers(0, 12), st.integers(0, 9)),
    st.sampled_from([[8, 0], (7, 5), (np.int64(8), np.int64(0))]),
    st.sampled_from([80, "8.0", "80", (8,), (8, 0, 1), ("8", "0"), (8.0, 0.0), (True, 0), (-1, 0), (8, None), [], {}]),
    WRONG,
)


def auto_precision(kind, capability) -> str:
    if kind == "tpu":
        return "mixed_bfloat16"
    if kind != "gpu" or capability is None:
        return "float32"
    return "mixed_bfloat16" if capability >= (8, 0) else "mixed_float16" if capability >= (7, 0) else "float32"


@fuzz(150)
@example(value="auto", hardware=("gpu", 80))  # was a TypeError
@example(value="auto", hardware=("gpu", (8,)))  # was accepted
@example(value="auto", hardware=("gpu", ("8", "0")))
@example(value="fp16", hardware="gpu")  # was accepted
@example(value="auto", hardware="gpu")  # was an AttributeError
@given(value=PRECISION_VALUES, hardware=st.one_of(
    st.none(), st.none(), st.tuples(st.sampled_from(["cpu", "gpu", "gpu", "tpu"]), GPU_CAPABILITY),
    st.tuples(WRONG, GPU_CAPABILITY), st.sampled_from(["gpu", "cpu", (8, 0), ("gpu", (8, 0), "x")]),
))
def test_resolve_precision(value, hardware):
    def call():
        hw = kmp.Hardware(*hardware) if isinstance(hardware, tuple) and len(hardware) == 2 else hardware
        return hw, kmp.resolve_precision(value, hardware=hw)

    def oracle(result):
        hw, p = result
        assert type(p) is kmp.Precision and p.name in POLICY_NAMES
        if hw is not None:
            expect(type(hw) is kmp.Hardware and hw.kind in ("cpu", "gpu", "tpu"), "hardware", hardware)
            cc = hw.compute_capability
            expect(cc is None or (type(cc) is tuple and len(cc) == 2 and all(count_ok(n, 0) for n in cc)),
                   "compute_capability", cc)
        if isinstance(value, str) and value == "auto":
            expected = auto_precision(hw.kind, hw.compute_capability) if hw is not None else "float32"  # CPU here
        elif isinstance(value, str) and value not in PRECISION_STRINGS and (
                value.lstrip().startswith(("{", "[")) or value.endswith(".json") or os.path.isfile(value)):
            # What load_config takes (JSON text, a path): the config's precision.
            expected = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}[
                kmp.load_config(value).precision]
        elif isinstance(value, str):
            expected = PRECISION_STRINGS.get(value)
        elif type(value) is int:
            expected = PRECISION_INTS.get(value)
        elif isinstance(value, (keras.DTypePolicy, kmp.Precision)):
            expected = value.name
        elif isinstance(value, kmp.Config):
            expected = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}[value.precision]
        elif isinstance(value, dict):  # one reader of DeepSpeed configs: the same verdict as load_config
            expected = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}[
                kmp.load_config(value).precision]
        else:
            expected = None
        expect(p.name == expected, "precision", value)

    ends_well(call, oracle)


# --- kmp.callbacks.GradientAccumulationScheduler ------------------------------------------------

HASHABLE_WRONG = st.one_of(EDGE, WRONG).filter(lambda v: isinstance(v, Hashable))


@st.composite
def schedules(draw):
    schedule = draw(st.dictionaries(st.integers(0, 10), st.integers(1, 16), min_size=1, max_size=3))
    for _ in range(draw(FAULTS)):
        fault = draw(st.sampled_from(["key_big", "key_small", "key_type", "key", "value_edge", "value"]))
        if fault.startswith("key"):
            epoch = draw({"key_big": st.sampled_from([2**63, 2**64, 10**400, np.uint64(2**64 - 1)]),
                          "key_small": st.sampled_from([-1, -(2**63), np.int64(-1)]),
                          "key_type": st.sampled_from([1.0, True, "0", None, np.float32(1), (0,)]),
                          "key": HASHABLE_WRONG}[fault])
            schedule[epoch] = draw(st.integers(1, 16))
        else:
            schedule[draw(st.sampled_from(sorted(schedule, key=repr)))] = draw(EDGE if fault == "value_edge" else WRONG)
    return schedule


SCHEDULES = st.one_of(schedules(), schedules(), schedules(),
                      st.sampled_from([None, {}, [], [(0, 2)], {0: 2}.items(), "0:2", 4]))


@fuzz(100)
@example(schedule={0: 1, 2**64: 2}, batch_size=None)  # was accepted
@given(schedule=SCHEDULES, batch_size=st.one_of(st.none(), st.integers(1, 512), WRONG))
def test_gradient_accumulation_scheduler(schedule, batch_size):
    def oracle(callback):
        expect(isinstance(schedule, dict) and schedule, "schedule", schedule)
        assert len(callback.schedule) == len(schedule)
        for (epoch, steps), (given_epoch, given_steps) in zip(callback.schedule.items(), sorted(schedule.items())):
            expect(count_ok(epoch, 0) and same(epoch, given_epoch), "epoch", given_epoch)
            expect(count_ok(steps) and same(steps, given_steps), f"schedule[{given_epoch!r}]", given_steps)
        expect(callback.batch_size is None or count_ok(callback.batch_size), "batch_size", batch_size)
        expect(same(callback.batch_size, batch_size), "batch_size", batch_size)

    ends_well(lambda: kmp.callbacks.GradientAccumulationScheduler(schedule, batch_size), oracle)


# --- kmp.distribute.resolve_strategy with malformed TF_CONFIG ------------------------------------

JOBS = st.one_of(st.sampled_from(["chief", "worker", "evaluator", "ps", "Worker", "workers", "", " worker"]),
                 st.text(max_size=4))
GOOD_ADDRESSES = st.lists(st.sampled_from(["host1:2222", "host2:2222", "10.0.0.1:1", "localhost:65535", "[::1]:2222"]),
                          min_size=1, max_size=3, unique=True)
BAD_ADDRESS = st.one_of(
    st.sampled_from(["h:0", "h:65536", "h:", ":1", "h", "h:x", "h:22x", "h:\u00b2", "h:-1", " :1", "h:2222 "]), WRONG)


def _mutate(draw, config):
    """One fault in a TF_CONFIG, from a flat list so that each kind is drawn often."""
    cluster, task = config.get("cluster"), config.get("task")
    job = draw(st.sampled_from(sorted(cluster))) if isinstance(cluster, dict) and cluster else None
    fault = draw(st.sampled_from([
        "cluster", "cluster_empty", "job_list", "job_list_shape", "address", "address", "new_job", "second",
        "drop_job", "task", "type", "type_wrong", "type_shape", "index", "index_wrong", "drop_in_task",
        "rpc_layer", "drop",
    ]))
    if fault == "cluster" or (job is None and fault in ("job_list", "job_list_shape", "address", "new_job", "second",
                                                          "drop_job")):
        config["cluster"] = draw(WRONG)
    elif fault == "cluster_empty":
        config["cluster"] = {}
    elif fault == "job_list":
        cluster[job] = draw(WRONG)
    elif fault == "job_list_shape":
        cluster[job] = draw(st.sampled_from([[], 5, "a:1", {"0": "a:1"}, None]))
    elif fault == "address":
        if isinstance(cluster[job], list) and cluster[job]:
            cluster[job][draw(st.integers(0, len(cluster[job]) - 1))] = draw(BAD_ADDRESS)
    elif fault == "new_job":
        cluster[draw(JOBS)] = draw(GOOD_ADDRESSES)
    elif fault == "second":  # TensorFlow allows one chief and one evaluator
        cluster[draw(st.sampled_from(["chief", "evaluator"]))] = ["c0:2222", "c1:2222"]
    elif fault == "drop_job":
        del cluster[job]
    elif fault == "task" or not isinstance(task, dict) and fault in ("type", "type_wrong", "type_shape", "index",
                                                                      "index_wrong", "drop_in_task"):
        config["task"] = draw(WRONG)
    elif fault == "type":
        task["type"] = draw(JOBS)
    elif fault == "type_wrong":
        task["type"] = draw(WRONG)
    elif fault == "type_shape":
        task["type"] = draw(st.sampled_from([["worker"], {"worker": 0}, None, 0]))
    elif fault == "index":
        task["index"] = draw(st.integers(-2, 5))
    elif fault == "index_wrong":
        task["index"] = draw(WRONG)
    elif fault == "drop_in_task":
        task.pop(draw(st.sampled_from(["type", "index"])), None)
    elif fault == "rpc_layer":
        config["rpc_layer"] = draw(st.one_of(st.just(""), WRONG))
    else:
        config.pop(draw(st.sampled_from(["cluster", "task"])), None)


@st.composite
def tf_config_dicts(draw):
    """A TF_CONFIG TensorFlow could run, then FAULTS faults."""
    cluster = {"worker": draw(GOOD_ADDRESSES)}
    if draw(st.booleans()):
        cluster["chief"] = ["chief0:2222"]
    if draw(st.integers(0, 3)) == 0:
        cluster["evaluator"] = ["eval0:2222"]
    kind = draw(st.sampled_from(sorted(cluster)))
    config = {"cluster": cluster, "task": {"type": kind, "index": draw(st.integers(0, len(cluster[kind]) - 1))}}
    if draw(st.integers(0, 3)) == 0:
        config["rpc_layer"] = "grpc"
    if draw(st.integers(0, 3)) == 0:
        config["environment"] = "cloud"  # keys TensorFlow or a platform adds are not kmp's to refuse
    for _ in range(draw(FAULTS)):
        _mutate(draw, config)
    return config


TF_CONFIGS = st.one_of(
    tf_config_dicts(), tf_config_dicts(), tf_config_dicts(),
    tf_config_dicts().map(lambda d: json.dumps(d, default=jsonable)),
    st.sampled_from(["", "  ", "{}", "{", "not json", "[1, 2]", "null", "1" + "0" * 5000, "[" * 100_000,
                     '{"cluster": 1}', '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1' +
                     "0" * 5000 + "}}"]),
    WRONG,
)


def address_ok(a) -> bool:
    if type(a) is not str:
        return False
    host, colon, port = a.rpartition(":")
    return bool(colon and host.strip() and re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535)


def tf_config_ok(raw) -> tuple[bool, int]:
    """(whether a TF_CONFIG is one TensorFlow can run, its chief + worker count)."""
    if not isinstance(raw, dict):
        return False, 0
    cluster, task = raw.get("cluster"), raw.get("task")
    ok = isinstance(cluster, dict) and bool(cluster) and isinstance(task, dict)
    ok = ok and all(job in ("chief", "worker", "evaluator") and type(addresses) is list
                    and all(address_ok(a) for a in addresses) for job, addresses in cluster.items())
    ok = ok and len(cluster.get("chief", [])) <= 1 and len(cluster.get("evaluator", [])) <= 1
    ok = ok and type(task.get("type")) is str and task["type"] in cluster
    index = task.get("index") if ok else None
    ok = ok and isinstance(index, (int, np.integer)) and not isinstance(index, bool)
    ok = ok and 0 <= index < len(cluster[task["type"]])
    ok = ok and ("rpc_layer" not in raw or (type(raw["rpc_layer"]) is str and raw["rpc_layer"].strip() != ""))
    return ok, (len(cluster.get("worker", [])) + len(cluster.get("chief", [])) if ok else 0)


def _builder(name):
    return lambda **kwargs: (name, kwargs)


@fuzz(200)
@example(tf_config={"cluster": {"worker": ["a:1"]}, "task": {"type": ["worker"], "index": 0}}, choice=None)
@example(tf_config={"cluster": {"worker": 5}, "task": {"type": "worker", "index": 0}}, choice=None)  # TypeErrors
@example(tf_config='{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1' + "0" * 5000 + "}}",
         choice="auto")  # was a ValueError
@example(tf_config={"cluster": {"worker": ["a:1"], "chief": ["b:1", "c:1"]}, "task": {"type": "worker", "index": 0}},
         choice="multi_worker_mirrored")  # was accepted
@example(tf_config={"cluster": {"worker": ["a:1", "b:x"]}, "task": {"type": "worker", "index": 0}}, choice=None)
@example(tf_config={"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}, "rpc_layer": ""},
         choice=None)
@given(tf_config=TF_CONFIGS, choice=st.one_of(
    st.none(), st.just("auto"), st.just("multi_worker_mirrored"), st.sampled_from(["Auto", "multi_worker", "tpu"]),
    WRONG))
def test_resolve_strategy_tf_config(tf_config, choice):
    builders = {name: _builder(name) for name in ("default", "mirrored", "multi_worker_mirrored", "tpu")}

    def call():
        with mock.patch.dict(strategy_module._BUILDERS, builders):
            return kmp.distribute.resolve_strategy(choice, tf_config=tf_config, tpu=lambda: None, gpus=[])

    def oracle(result):
        name, kwargs = result
        expect(choice in (None, "auto", "multi_worker_mirrored"), "strategy", choice)
        raw = tf_config
        if isinstance(raw, str):
            raw = None if not raw.strip() else strict_json(raw)
        if raw is None or raw == {}:
            expect(name == ("multi_worker_mirrored" if choice == "multi_worker_mirrored" else "default"),
                   "strategy", name)
            return
        ok, workers = tf_config_ok(raw)
        expect(ok, "tf_config", tf_config)
        multi = choice == "multi_worker_mirrored" or workers > 1
        expect(name == ("multi_worker_mirrored" if multi else "default"), "strategy", name)
        if multi:
            assert kwargs["cluster"] == raw

    ends_well(call, oracle)


# --- kmp.wrap and kmp.LossScaleOptimizer (Keras optimizers: fewer cases) -------------------------

OPTIMIZER_ONLY = {
    "log_overflows": BOOL, "fused": BOOL,
    "communication": st.sampled_from([None, {"dtype": "float16"}, {"bytes_per_pack": 2**20}, kmp.Communication(),
                                      {"dtype": "fp8"}, {"bytez": 1}, {"predivide_factor": 1e-300}, 5, "float16"]),
}
OVERRIDES = {
    **{k: v for k, v in LOSS_SCALE_FIELDS.items()}, **OPTIMIZER_ONLY,
    "gradient_clipping": st.one_of(st.none(), st.sampled_from([1.0, 0.5])),
    "gradient_accumulation_steps": st.one_of(st.none(), st.integers(1, 4)),
}


def override_ok(name: str, value) -> bool:
    """The oracle's domain of each wrap/LossScaleOptimizer argument."""
    if isinstance(value, np.generic):
        value = value.item()
    if name in ("initial_scale", "min_scale", "max_scale"):
        return scale_ok(value)
    if name in ("static_scale", "gradient_clipping"):
        return value is None or scale_ok(value)
    if name in ("dynamic_growth_steps", "hysteresis"):
        return count_ok(value)
    if name == "gradient_accumulation_steps":
        return value is None or count_ok(value)
    if name in ("consecutive_hysteresis", "raise_at_min_scale", "log_overflows", "fused"):
        return type(value) is bool
    if name == "growth_rule":
        return type(value) is str and value in ("every_window", "after_window")
    if name == "growth_factor":
        return growth_ok(value)
    if name == "backoff_factor":
        return backoff_ok(value)
    if name == "communication":
        if value is None or isinstance(value, kmp.Communication):
            return True
        return isinstance(value, dict) and set(value) <= {"dtype", "bytes_per_pack", "predivide_factor"} and (
            value.get("dtype", "float32") in ("float32", "float16", "bfloat16")
            and count_ok(value.get("bytes_per_pack", 0), 0)
            and (value.get("predivide_factor") is None or predivide_ok(value["predivide_factor"])))
    return False


def check_optimizer(opt, arguments: dict) -> None:
    for name, value in arguments.items():
        expect(override_ok(name, value), name, value)
    if isinstance(opt, kmp.LossScaleOptimizer):
        check_loss_scale(opt.loss_scale_config)
        expect(opt.gradient_clipping is None or scale_ok(opt.gradient_clipping), "gradient_clipping",
               opt.gradient_clipping)
        steps = None if opt.accumulation is None else opt.accumulation.initial_steps
        expect(steps is None or count_ok(steps), "gradient_accumulation_steps", steps)
        expect(type(opt.fused) is bool and type(opt.log_overflows) is bool, "fused, log_overflows",
               (opt.fused, opt.log_overflows))
        check_communication(opt.communication)
    else:
        assert isinstance(opt, keras.optimizers.Optimizer)
        clip = opt.global_clipnorm
        expect(clip is None or scale_ok(clip), "global_clipnorm", clip)


VALID_CONFIGS = st.sampled_from([
    kmp.Config(), kmp.Config(precision="fp16", gradient_clipping=1.0), kmp.Config(gradient_accumulation_steps=2),
    kmp.Config(train_batch_size=8, micro_batch_size=4), kmp.Config(precision="bf16", gradient_clipping=0.5)])
WRAP_CONFIGS = st.one_of(  # mostly valid, so that the arguments' faults are seen alone
    st.none(), VALID_CONFIGS, VALID_CONFIGS, DS_DICTS,
    st.sampled_from(['{"fp16": {"enabled": true}}', '{"bf16": {"enabled": true}', "missing.json", 5, [], None]),
)
WRAP_PRECISIONS = st.one_of(
    st.none(), st.none(), st.none(), st.sampled_from(["fp16", "mixed_float16", "bf16", "float32", "16-mixed", 16]),
    WRONG)
WRAP_OVERRIDES = faulty(
    OVERRIDES, ["hysterisis", "loss_scale", "clipnorm", "global_clipnorm", "steps", "strategy"],
    reserved=("optimizer", "config", "precision"),  # wrap's own parameters: Python rejects them twice
)


@fuzz(100)
@example(config=None, precision="float32", overrides={"fused": "yes"})  # were accepted
@example(config=None, precision="float32", overrides={"communication": {"dtype": "fp8"}})
@example(config=None, precision=None, overrides={"": 1})
@given(config=WRAP_CONFIGS, precision=WRAP_PRECISIONS, overrides=WRAP_OVERRIDES)
def test_wrap(config, precision, overrides):
    inner = keras.optimizers.SGD()

    def oracle(opt):
        assert inner.global_clipnorm is None, "wrap changed the optimizer it was given"
        if isinstance(config, dict) and not auto_paths(config):  # "auto" is filled by what wrap is given
            check_loaded(config, kmp.load_config(config, strict=True))
        check_optimizer(opt, overrides)

    ends_well(lambda: kmp.wrap(inner, config, precision=precision, strict=True, **overrides), oracle)


LOSS_SCALE_OPTIMIZER_KWARGS = faulty({**OVERRIDES, "loss_scale": st.one_of(st.none(), VALID_LOSS_SCALES)}, None)


@fuzz(50)
@given(LOSS_SCALE_OPTIMIZER_KWARGS)
def test_loss_scale_optimizer(kwargs):
    def oracle(opt):
        given = {k: v for k, v in kwargs.items() if k != "loss_scale"}
        if kwargs.get("loss_scale") is not None:
            expect(type(kwargs["loss_scale"]) is kmp.LossScaleConfig, "loss_scale", kwargs["loss_scale"])
            assert opt.loss_scale_config is kwargs["loss_scale"]
        check_optimizer(opt, given)
        for name, value in given.items():
            if name in LOSS_SCALE_FIELDS and kwargs.get("loss_scale") is None:
                expect(same(getattr(opt.loss_scale_config, name), value), name, value)

    ends_well(lambda: kmp.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs), oracle)


# Two defects of kmp/scaling/optimizer.py the fuzzer found (fixed).
def test_unknown_loss_scale_optimizer_argument():
    ends_well(lambda: kmp.LossScaleOptimizer(keras.optimizers.SGD(), hysterisis=2), check_optimizer_accepted_nothing)


def test_array_beside_a_loss_scale_config():
    ends_well(lambda: kmp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=kmp.LossScaleConfig(),
                                             hysteresis=np.array([1, 2])), check_optimizer_accepted_nothing)


def check_optimizer_accepted_nothing(opt):
    pytest.fail(f"accepted invalid arguments: {opt}")
