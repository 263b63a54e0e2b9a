"""Tests for kmp.precision: every spelling, "auto", hardware checks, scopes."""

import logging
import warnings
from typing import get_args

import keras
import numpy as np
import pytest

import kmp

from kmp.config.settings import Config
from kmp.errors import ConfigError
from kmp.precision import (
    Hardware,
    LegacyPrecision,
    LightningPrecision,
    PolicyName,
    Precision,
    ShortPrecision,
    check_hardware,
    float32_output,
    precision_scope,
    resolve_precision,
    set_precision,
)

CPU = Hardware("cpu")
TPU = Hardware("tpu")
PASCAL = Hardware("gpu", (6, 1))
VOLTA = Hardware("gpu", (7, 0))
TURING = Hardware("gpu", (7, 5))
AMPERE = Hardware("gpu", (8, 0))
HOPPER = Hardware("gpu", (9, 0))
UNKNOWN_GPU = Hardware("gpu", None)

# Every accepted non-legacy spelling -> canonical Keras policy name.
SPELLINGS = {
    "float32": "float32",
    "mixed_float16": "mixed_float16",
    "mixed_bfloat16": "mixed_bfloat16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "32-true": "float32",
    "16-mixed": "mixed_float16",
    "bf16-mixed": "mixed_bfloat16",
    "16-true": "float16",
    "bf16-true": "bfloat16",
    "64-true": "float64",
    "fp32": "float32",
    "fp16": "mixed_float16",
}
# Legacy spelling -> (new spelling named in the warning, canonical name).
LEGACY = {
    16: ("16-mixed", "mixed_float16"),
    "16": ("16-mixed", "mixed_float16"),
    "bf16": ("bf16-mixed", "mixed_bfloat16"),
    32: ("32-true", "float32"),
    "32": ("32-true", "float32"),
    64: ("64-true", "float64"),
    "64": ("64-true", "float64"),
}


def test_tables_cover_exactly_the_literal_types():
    """The Literal types are the single source; the tables here must match them."""
    literals = get_args(PolicyName) + get_args(LightningPrecision) + get_args(ShortPrecision)
    assert set(SPELLINGS) == set(literals)
    assert set(LEGACY) == set(get_args(LegacyPrecision))


@pytest.mark.parametrize("spelling, expected", sorted(SPELLINGS.items()))
def test_every_spelling_resolves_without_warning(spelling, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = resolve_precision(spelling)
    assert p == Precision(expected)
    assert str(p) == expected
    assert caught == []


@pytest.mark.parametrize("spelling", sorted(LEGACY, key=repr))
def test_legacy_spellings_warn_with_the_new_spelling(spelling):
    new, expected = LEGACY[spelling]
    with pytest.warns(UserWarning, match=f"legacy spelling; use precision='{new}'"):
        p = resolve_precision(spelling)
    assert str(p) == expected


@pytest.mark.parametrize("name", get_args(PolicyName))
def test_round_trip_through_str_and_keras_policy(name):
    p = Precision(name)
    assert resolve_precision(str(p)) == p
    assert resolve_precision(p.policy()) == p
    assert resolve_precision(keras.DTypePolicy(name)) == p
    assert resolve_precision(p) is p


@pytest.mark.parametrize(
    "name, compute, variable, mixed, scaling",
    [
        ("float32", "float32", "float32", False, False),
        ("mixed_float16", "float16", "float32", True, True),
        ("mixed_bfloat16", "bfloat16", "float32", True, False),
        ("float16", "float16", "float16", False, True),
        ("bfloat16", "bfloat16", "bfloat16", False, False),
        ("float64", "float64", "float64", False, False),
    ],
)
def test_precision_properties_match_keras(name, compute, variable, mixed, scaling):
    p = Precision(name)
    assert (p.compute_dtype, p.variable_dtype, p.is_mixed, p.needs_loss_scaling) == (
        compute, variable, mixed, scaling,
    )
    policy = p.policy()
    assert isinstance(policy, keras.DTypePolicy)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (name, compute, variable)


def test_precision_is_frozen_and_validates_its_name():
    with pytest.raises(AttributeError):
        Precision("float32").name = "float16"
    with pytest.raises(ConfigError, match="Did you mean 'mixed_float16'"):
        Precision("mixed_float61")


@pytest.mark.parametrize(
    "value, hint",
    [
        ("mixed_float61", "Did you mean 'mixed_float16'?"),
        ("bf16_mixed", "Did you mean 'bf16-mixed'?"),
        ("FP16", "Did you mean 'fp16'?"),
        ("flaot32", "Did you mean 'float32'?"),
        ("BF16", "Did you mean 'bf16-mixed'?"),
        ("Bf16", "Did you mean 'bf16-mixed'?"),
        ("bf-16", "Did you mean 'bf16-mixed'?"),
        ("mixed_bf16", "Did you mean 'mixed_bfloat16'?"),
        ("Mixed-BFloat16", "Did you mean 'mixed_bfloat16'?"),
        ("FLAOT32", "Did you mean 'float32'?"),
    ],
)
def test_misspellings_raise_config_error_with_hint(value, hint):
    with pytest.raises(ConfigError) as info:
        resolve_precision(value)
    message = str(info.value)
    assert hint in message
    assert f"Received: precision={value!r}" in message
    # The accepted spellings are listed, from the Literal types.
    for spelling in ("'mixed_bfloat16'", "'16-mixed'", "'fp16'", "'auto'", "legacy 16, 32, 64"):
        assert spelling in message


@pytest.mark.parametrize("value", ["BF16", "bf-16", "bf_16", "BFLOAT-16", "bf16mixed", "bf61", "bfloat61", "mixed_bf16",
                                   "FP16", "fp-16", "Float-16", "float61", "fp61", "16mixed", "mixed-fp16"])
def test_a_hint_never_names_the_other_16_bit_format(value):
    """bfloat16's spellings have a b, float16's none; a hint keeps to the format asked for (or is left out)."""
    # Config's own names (fp16, bf16) and Precision's (the Keras policies) are hinted alike.
    for make in (resolve_precision, lambda v: Config(precision=v), Precision):
        with pytest.raises(ConfigError) as info:
            make(value)
        hint = str(info.value).partition("Did you mean")[2].partition("?")[0]
        assert ("b" in hint) == ("b" in value.lower()) or not hint, hint


@pytest.mark.parametrize("value", [8, 16.0, True, None, "int8", ["fp16"], keras.DTypePolicy("int32")])
def test_other_inputs_raise_config_error(value):
    with pytest.raises(ConfigError, match="expected one of 'float32'"):
        resolve_precision(value)


@pytest.mark.parametrize("short, expected", [("fp32", "float32"), ("fp16", "mixed_float16"), ("bf16", "mixed_bfloat16")])
def test_kmp_config_precision(short, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_precision(Config(precision=short)) == Precision(expected)
    assert caught == []  # Config's own "bf16" is not a legacy spelling


def test_invalid_kmp_config_precision_names_the_field():
    # A Config is validated when made, so resolve_precision never sees a bad one.
    with pytest.raises(ConfigError, match=r"Received: precision='fp8'"):
        resolve_precision(Config(precision="fp8"))


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, "float32"),
        ({"train_batch_size": 32}, "float32"),
        ({"fp16": {"enabled": True, "loss_scale": 0}}, "mixed_float16"),
        ({"fp16": {"enabled": False}}, "float32"),
        ({"fp16": {"loss_scale": 0}}, "float32"),  # DeepSpeed: no "enabled" means off
        ({"bf16": {"enabled": True}}, "mixed_bfloat16"),
        ({"bfloat16": {"enabled": True}}, "mixed_bfloat16"),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "mixed_bfloat16"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "mixed_float16"),
    ],
)
def test_deepspeed_dicts(config, expected):
    assert resolve_precision(config) == Precision(expected)


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
def test_deepspeed_both_enabled_names_both_key_paths(bf16_key):
    config = {"fp16": {"enabled": True}, bf16_key: {"enabled": True}}
    with pytest.raises(ConfigError) as info:
        resolve_precision(config)
    message = str(info.value)
    assert "Invalid DeepSpeed config" in message
    assert "fp16.enabled" in message and f"{bf16_key}.enabled" in message
    # One reader: the same problems as kmp.load_config reports for the file.
    with pytest.raises(ConfigError) as loaded:
        kmp.load_config(config)
    assert loaded.value.problems == info.value.problems


def test_deepspeed_bf16_and_its_old_name_together_are_refused_by_every_entry_point():
    config = {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}
    for read in (resolve_precision, kmp.load_config):
        with pytest.raises(ConfigError, match="bfloat16: expected no bfloat16 block next to bf16"):
            read(config)


def test_deepspeed_bad_values_are_all_reported():
    with pytest.raises(ConfigError) as info:
        resolve_precision({"fp16": {"enabled": "auto"}, "bf16": True})
    assert sorted((p.path, str(p.received)) for p in info.value.problems) == [("bf16", "True"), ("fp16.enabled", "auto")]


@pytest.mark.parametrize(
    "hardware, expected",
    [
        (TPU, "mixed_bfloat16"),
        (HOPPER, "mixed_bfloat16"),
        (AMPERE, "mixed_bfloat16"),
        (TURING, "mixed_float16"),
        (VOLTA, "mixed_float16"),
        (PASCAL, "float32"),
        (UNKNOWN_GPU, "float32"),
        (CPU, "float32"),
    ],
)
def test_auto_per_hardware_logs_why(hardware, expected, caplog):
    with caplog.at_level(logging.INFO, logger="kmp.precision"):
        assert resolve_precision("auto", hardware=hardware) == Precision(expected)
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert f"precision='auto' -> {expected}: " in record.getMessage()


def test_auto_on_cpu_says_why_and_does_not_warn(caplog):
    with caplog.at_level(logging.INFO, logger="kmp.precision"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_precision("auto", hardware=CPU)
    assert "CPU only: no fast float16 math" in caplog.text
    assert caught == []


def test_detect_on_this_cpu_machine():
    assert Hardware.detect() == CPU
    assert resolve_precision("auto") == Precision("float32")


def test_detect_reads_tensorflow_devices(monkeypatch):
    import tensorflow as tf

    gpus = ["GPU:0", "GPU:1"]
    details = {"GPU:0": {"compute_capability": (9, 0)}, "GPU:1": {"compute_capability": (7, 5)}}
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: [])
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: gpus if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "get_device_details", lambda d: details[d])
    assert Hardware.detect() == Hardware("gpu", (7, 5))  # the slowest GPU decides
    details["GPU:1"] = {}  # e.g. a ROCm GPU reports no compute capability
    assert Hardware.detect() == UNKNOWN_GPU
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: ["TPU:0"] if kind == "TPU" else [])
    assert Hardware.detect() == TPU


def test_hardware_validates_and_normalizes():
    assert Hardware("gpu", [8, 0]) == AMPERE
    with pytest.raises(ConfigError, match="Hardware.kind"):
        Hardware("GPU")


@pytest.mark.parametrize(
    "precision, hardware, match",
    [
        ("mixed_float16", CPU, r"precision 'mixed_float16' on CPU: .* Use 'float32'"),
        ("float16", CPU, r"precision 'float16' on CPU: .* Use 'float32'"),
        ("mixed_float16", TPU, r"on TPU: .* Use 'mixed_bfloat16'"),
        ("float16", TPU, r"on TPU: .* Use 'bfloat16'"),
        ("mixed_float16", PASCAL, r"compute capability \(6, 1\) has no Tensor Cores.* Use 'float32'"),
        ("mixed_bfloat16", TURING, r"\(7, 5\) has no fast bfloat16.* Use 'mixed_float16'"),
        ("bfloat16", VOLTA, r"\(7, 0\) has no fast bfloat16.* Use 'float16'"),
        ("mixed_bfloat16", PASCAL, r"\(6, 1\) has no fast bfloat16.* Use 'float32'"),
    ],
)
def test_check_hardware_warns_once_with_the_alternative(precision, hardware, match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_hardware(precision, hardware)
    assert len(caught) == 1
    with pytest.warns(UserWarning, match=match):
        check_hardware(precision, hardware)


@pytest.mark.parametrize(
    "precision, hardware",
    [(name, hw) for name in ("float32", "float64") for hw in (CPU, TPU, PASCAL, VOLTA, AMPERE)]
    + [
        ("mixed_bfloat16", TPU),
        ("mixed_bfloat16", AMPERE),
        ("mixed_bfloat16", HOPPER),
        ("mixed_float16", VOLTA),
        ("mixed_float16", AMPERE),
        ("mixed_bfloat16", CPU),  # fast on CPUs with AVX512_BF16/AMX; see docs
        ("mixed_float16", UNKNOWN_GPU),
        ("mixed_bfloat16", UNKNOWN_GPU),
    ],
)
def test_check_hardware_is_silent_for_good_combinations(precision, hardware):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_hardware(precision, hardware)
    assert caught == []


def test_set_precision_sets_the_global_policy_and_checks_hardware():
    with pytest.warns(UserWarning, match="on CPU"):
        p = set_precision("16-mixed", hardware=CPU)
    assert p == Precision("mixed_float16")
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert keras.layers.Dense(2).dtype_policy.compute_dtype == "float16"
    assert set_precision("auto", hardware=AMPERE) == Precision("mixed_bfloat16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_precision_scope_restores_on_exit_and_on_exception():
    keras.config.set_dtype_policy("float64")
    with precision_scope("bf16-mixed") as p:
        assert p == Precision("mixed_bfloat16")
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "float64"
    with pytest.raises(RuntimeError, match="boom"):
        with precision_scope("mixed_bfloat16", hardware=AMPERE):
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float64"


def test_precision_scope_with_invalid_value_changes_nothing():
    before = keras.config.dtype_policy()
    with pytest.raises(ConfigError):
        with precision_scope("mixed_float61"):
            pass  # pragma: no cover
    assert keras.config.dtype_policy() is before


def _model(head):
    inputs = keras.Input((4,))
    logits = keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, head(logits))


def test_float32_output_keeps_outputs_and_loss_in_float32():
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    y = np.array([0, 1, 2, 1, 0])
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    with precision_scope("mixed_float16", hardware=VOLTA):
        plain = _model(lambda t: keras.layers.Activation("softmax")(t))
        fixed = _model(lambda t: float32_output(t, "softmax", name="probs"))
    # Without the helper the output stays float16, so this test can fail.
    assert plain(x).dtype == "float16"
    assert fixed.layers[-2].compute_dtype == "float16"  # the body still runs in float16
    assert fixed.get_layer("probs").dtype_policy.name == "float32"
    probs = fixed(x)
    assert probs.dtype == "float32"
    np.testing.assert_allclose(np.sum(probs, axis=-1), 1.0, rtol=1e-6)
    # Keras 3 losses cast predictions to floatx, so the dtype alone would pass
    # without the helper too; the value test below is the one that can fail.
    assert loss_fn(y, probs).dtype == "float32"


@pytest.mark.parametrize(
    "head, accurate",
    [(lambda t: float32_output(t, "softmax"), True), (lambda t: keras.layers.Activation("softmax")(t), False)],
    ids=["float32_output", "float16_softmax"],
)
def test_float32_output_keeps_softmax_loss_accurate(head, accurate):
    """Cross-entropy of a small probability: a float16 softmax is off by ~2e-4 relative."""
    logits, target = np.array([[6.0, 0.0, -6.0]]), 2
    expected = -(logits[0, target] - np.log(np.exp(logits).sum()))  # float64 reference, 12.0025
    with precision_scope("mixed_float16", hardware=VOLTA):
        inputs = keras.Input((3,))
        # An identity Dense: float16 logits, exactly the values given.
        x = keras.layers.Dense(3, kernel_initializer="identity", bias_initializer="zeros")(inputs)
        model = keras.Model(inputs, head(x))
    loss = float(keras.losses.SparseCategoricalCrossentropy()(np.array([target]), model(logits)))
    assert bool(np.isclose(loss, expected, rtol=1e-6, atol=0)) is accurate


def test_float32_output_default_is_a_cast_only():
    with precision_scope("mixed_bfloat16", hardware=AMPERE):
        logits = keras.layers.Dense(3)(np.ones((2, 4), "float32"))
        out = float32_output(logits)
    assert logits.dtype == "bfloat16"
    assert out.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(keras.ops.cast(logits, "float32")))


def test_set_precision_takes_what_load_config_takes(tmp_path):
    # A path, JSON text, a dict: the fp16/bf16 blocks decide (the README says set_precision takes a config).
    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}}')
    previous = keras.config.dtype_policy()
    try:
        assert kmp.set_precision(str(path)).compute_dtype == "bfloat16"
        assert kmp.set_precision(path).compute_dtype == "bfloat16"  # os.PathLike
        assert kmp.set_precision('{"fp16": {"enabled": true}}').compute_dtype == "float16"
        assert keras.config.dtype_policy().name == "mixed_float16"
        with pytest.raises(kmp.ConfigError, match="an existing JSON file"):
            kmp.set_precision(str(tmp_path / "missing.json"))
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("spelled, dtype", [("bfloat16", "bfloat16"), ("bf16-true", "bfloat16"), ("16-true", "float16")])
def test_set_precision_says_once_what_16_bit_weights_need(spelled, dtype, recwarn):
    kmp.set_precision(spelled, hardware=kmp.Hardware("gpu", (9, 0)))
    said = [str(w.message) for w in recwarn if "keeps the weights themselves" in str(w.message)]
    assert said == [f"precision '{dtype}' keeps the weights themselves in {dtype}. kmp.prepare(model), with kmp.wrap's "
                    f"optimizer, trains them from float32 master weights; any other update (Keras's own) is made in "
                    f"{dtype} and loses the small ones (Keras's Adam does not move them at all). 'mixed_{dtype}' keeps "
                    "float32 weights."]
    kmp.set_precision(f"mixed_{dtype}", hardware=kmp.Hardware("gpu", (9, 0)))
    assert len([w for w in recwarn if "keeps the weights themselves" in str(w.message)]) == 1
