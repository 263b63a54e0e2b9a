"""kmp.config.deepspeed: sources, DeepSpeed defaults, the key table, errors, round trips, batch sizes."""

import dataclasses
import json
import warnings

import types

import pytest

from kmp.config.settings import Config, LossScaleConfig
from kmp.config.deepspeed import (
    DEEPSPEED_KEYS,
    DEEPSPEED_LOSS_SCALE,
    load_config,
    resolve_batch_sizes,
    to_deepspeed,
)
from kmp.errors import ConfigError

FULL = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "consecutive_hysteresis": True,
        "min_loss_scale": 0.5,
    },
    "kmp": {"growth_rule": "every_window", "max_scale": 2.0**20, "raise_at_min_scale": False},
}


def _load_quietly(source):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these sources hold no ignored keys
        return load_config(source)


def _problems(source, **kwargs):
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return info.value


# --- sources -------------------------------------------------------------------


def test_dict_path_and_json_string_give_equal_configs(tmp_path):
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps(FULL, indent=2))
    from_dict = _load_quietly(FULL)
    assert _load_quietly(file) == from_dict
    assert _load_quietly(str(file)) == from_dict
    assert _load_quietly(json.dumps(FULL)) == from_dict
    assert _load_quietly("  \n" + json.dumps(FULL)) == from_dict
    assert from_dict == Config(
        precision="fp16",
        gradient_clipping=1.0,
        train_batch_size=64,
        micro_batch_size=8,
        gradient_accumulation_steps=4,
        loss_scale=LossScaleConfig(
            initial_scale=4096.0, dynamic_growth_steps=500, hysteresis=3, consecutive_hysteresis=True,
            min_scale=0.5, max_scale=2.0**20, raise_at_min_scale=False, growth_rule="every_window",
        ),
    )


def test_the_callers_dict_is_not_changed():
    source = json.loads(json.dumps(FULL))
    _load_quietly(source)
    assert source == FULL


def test_missing_file(tmp_path):
    error = _problems(tmp_path / "nope.json")
    assert [p.path for p in error.problems] == ["path"]
    assert "nope.json" in str(error) and "an existing JSON file" in str(error)
    assert error.__cause__ is None and error.__suppress_context__


def test_unreadable_file(tmp_path):
    error = _problems(tmp_path)  # a directory
    assert "a readable UTF-8 JSON file" in str(error)
    (tmp_path / "latin1.json").write_bytes(b'{"fp16": {"enabled": true}} \xff')
    assert "a readable UTF-8 JSON file" in str(_problems(tmp_path / "latin1.json"))


def test_json_syntax_error_names_line_and_column(tmp_path):
    text = '{\n  "fp16": {\n    "enabled": true,\n  }\n}\n'
    error = _problems(text)
    assert len(error.problems) == 1
    assert "line 4, column 3" in str(error)
    assert "Expecting property name enclosed in double quotes" in str(error)
    assert error.__cause__ is None and error.__suppress_context__  # no json traceback

    file = tmp_path / "bad.json"
    file.write_text('{"fp16": {"enabled": True}}')  # Python's True, not JSON's true
    error = _problems(file)
    assert "bad.json" in str(error) and "line 1, column 22" in str(error)


def test_duplicate_keys_are_rejected_as_deepspeed_does():
    error = _problems('{"fp16": {"hysteresis": 2, "hysteresis": 4}}')
    assert [p.path for p in error.problems] == ["hysteresis"]


@pytest.mark.parametrize("source", [42, None, ["fp16"]])
def test_other_source_types_are_rejected(source):
    assert [p.path for p in _problems(source).problems] == ["source"]


def test_top_level_must_be_an_object(tmp_path):
    file = tmp_path / "list.json"
    file.write_text("[1, 2]")
    assert [p.path for p in _problems(file).problems] == ["(top level)"]


# --- defaults ------------------------------------------------------------------


def test_a_bare_fp16_block_gets_deepspeeds_defaults():
    config = _load_quietly({"fp16": {"enabled": True}})
    assert config.precision == "fp16"
    s = config.loss_scale
    # The spec's Defaults table, right column, written out (not read back from the module).
    assert s.initial_scale == 2.0**16
    assert s.dynamic_growth_steps == 1000
    assert s.hysteresis == 2
    assert s.consecutive_hysteresis is False
    assert s.min_scale == 1.0
    assert s.raise_at_min_scale is True
    assert s.growth_rule == "after_window"
    assert s.max_scale == 2.0**24
    assert s.static_scale is None
    assert s == DEEPSPEED_LOSS_SCALE
    assert config.gradient_clipping is None
    assert LossScaleConfig().hysteresis == 1  # Python-constructed defaults are untouched


def test_an_empty_config_is_fp32():
    assert _load_quietly({}) == Config(loss_scale=DEEPSPEED_LOSS_SCALE)


# --- the key table -------------------------------------------------------------

# (JSON given, Config field path, value expected there)
MAPPING = [
    ({"fp16": {"enabled": True}}, "precision", "fp16"),
    ({"fp16": {"enabled": False}}, "precision", "fp32"),
    ({"bf16": {"enabled": True}}, "precision", "bf16"),
    ({"bfloat16": {"enabled": True}}, "precision", "bf16"),
    ({"bf16": {"enabled": False}}, "precision", "fp32"),
    ({"fp16": {"loss_scale": 1024}}, "loss_scale.static_scale", 1024.0),
    ({"fp16": {"loss_scale": 0}}, "loss_scale.static_scale", None),
    ({"fp16": {"initial_scale_power": 10}}, "loss_scale.initial_scale", 1024.0),
    ({"fp16": {"initial_scale_power": 0}}, "loss_scale.initial_scale", 1.0),
    ({"fp16": {"loss_scale_window": 500}}, "loss_scale.dynamic_growth_steps", 500),
    ({"fp16": {"hysteresis": 4}}, "loss_scale.hysteresis", 4),
    ({"fp16": {"consecutive_hysteresis": True}}, "loss_scale.consecutive_hysteresis", True),
    ({"fp16": {"min_loss_scale": 0.25}}, "loss_scale.min_scale", 0.25),
    ({"gradient_clipping": 1.5}, "gradient_clipping", 1.5),
    ({"gradient_clipping": 0.0}, "gradient_clipping", None),
    ({"train_batch_size": 32}, "train_batch_size", 32),
    ({"train_micro_batch_size_per_gpu": 4}, "micro_batch_size", 4),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps", 8),
    ({"kmp": {"growth_rule": "every_window"}}, "loss_scale.growth_rule", "every_window"),
    ({"kmp": {"max_scale": 2**20}}, "loss_scale.max_scale", 2.0**20),
    ({"kmp": {"raise_at_min_scale": False}}, "loss_scale.raise_at_min_scale", False),
    ({"kmp": {"growth_factor": 4}}, "loss_scale.growth_factor", 4.0),
    ({"kmp": {"backoff_factor": 0.25}}, "loss_scale.backoff_factor", 0.25),
    ({"kmp": {"overflow": "replay"}}, "loss_scale.overflow", "replay"),
    ({"kmp": {"strategy": "mirrored"}}, "strategy", "mirrored"),
    ({"communication_data_type": "bf16"}, "communication_data_type", "bfloat16"),
    ({"communication_data_type": "fp16"}, "communication_data_type", "float16"),
    ({"prescale_gradients": False}, "prescale_gradients", False),
    ({"gradient_predivide_factor": 4}, "gradient_predivide_factor", 4.0),
    ({"kmp": {"allreduce_bytes_per_pack": 2**20}}, "allreduce_bytes_per_pack", 2**20),
    ({"wall_clock_breakdown": True}, "wall_clock_breakdown", True),
    ({"steps_per_print": 50}, "steps_per_print", 50),
]


def _field(config, path):
    for name in path.split("."):
        config = getattr(config, name)
    return config


@pytest.mark.parametrize("given,field,expected", MAPPING)
def test_each_key_fills_its_field(given, field, expected):
    config = _load_quietly(given)
    assert _field(config, field) == expected
    assert type(_field(config, field)) is type(expected)
    # ...and nothing else moves away from the DeepSpeed defaults.
    baseline = Config(loss_scale=DEEPSPEED_LOSS_SCALE)
    top, _, leaf = field.rpartition(".")
    if top:
        baseline = dataclasses.replace(baseline, loss_scale=dataclasses.replace(baseline.loss_scale, **{leaf: expected}))
    else:
        baseline = dataclasses.replace(baseline, **{leaf: expected})
    assert config == baseline


def test_every_table_row_is_covered_by_the_mapping_cases():
    covered = set()
    for given, _, _ in MAPPING:
        for key, value in given.items():
            key = "bf16" if key == "bfloat16" else key
            covered |= {f"{key}.{leaf}" for leaf in value} if isinstance(value, dict) else {key}
    assert {row.key for row in DEEPSPEED_KEYS} == covered


def test_static_scale():
    config = _load_quietly({"fp16": {"enabled": True, "loss_scale": 128}})
    assert config.loss_scale.static_scale == 128.0
    assert not config.loss_scale.dynamic


def test_bf16():
    config = _load_quietly({"bf16": {"enabled": True}, "gradient_clipping": 1.0})
    assert config == Config(precision="bf16", gradient_clipping=1.0, loss_scale=DEEPSPEED_LOSS_SCALE)


def test_fp16_and_bf16_both_on_is_an_error_on_both_keys():
    error = _problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert [p.path for p in error.problems] == ["fp16.enabled", "bf16.enabled"]
    error = _problems({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert [p.path for p in error.problems] == ["fp16.enabled", "bfloat16.enabled"]


def test_bf16_and_its_old_name_together_is_an_error():
    error = _problems({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert [p.path for p in error.problems] == ["bfloat16"]


# --- problems, all at once -----------------------------------------------------


def test_all_problems_are_reported_in_one_error():
    error = _problems({"gradient_cliping": 1.0, **{
        "fp16": {"enabled": "yes", "hysteresis": "2", "hysterisis": 2, "loss_scale_window": 0},
        "bf16": True,
        "gradient_cliping": 1.0,
        "train_batch_size": "auto",
        "kmp": {"growth_rule": "sometimes", "max_scal": 1e6},
    }}, strict=True)
    paths = [p.path for p in error.problems]
    assert sorted(paths) == sorted([
        "fp16.enabled", "fp16.hysteresis", "fp16.hysterisis", "fp16.loss_scale_window",
        "bf16", "gradient_cliping", "train_batch_size", "kmp.growth_rule", "kmp.max_scal",
    ])
    assert f"({len(paths)} problems)" in str(error)
    by_path = {p.path: p for p in error.problems}
    assert by_path["fp16.enabled"].received == "yes"
    assert by_path["fp16.enabled"].expected == "true or false"
    assert by_path["fp16.hysteresis"].received == "2"
    assert by_path["fp16.hysteresis"].expected == "an integer"
    assert by_path["fp16.loss_scale_window"].expected == "an integer >= 1"
    assert "'every_window', 'after_window'" in by_path["kmp.growth_rule"].expected
    assert "Hugging Face" in by_path["train_batch_size"].fix


@pytest.mark.parametrize("given,path,hint", [
    ({"fp16": {"hysterisis": 2}}, "fp16.hysterisis", "Did you mean 'hysteresis'?"),
    ({"fp16": {"loss_scale_windows": 2}}, "fp16.loss_scale_windows", "Did you mean 'loss_scale_window'?"),
    ({"fp16": {"enable": True}}, "fp16.enable", "Did you mean 'enabled'?"),
    ({"bf16": {"enabeld": True}}, "bf16.enabeld", "Did you mean 'enabled'?"),
    ({"bfloat16": {"enabeld": True}}, "bfloat16.enabeld", "Did you mean 'enabled'?"),
    ({"kmp": {"growth_rul": "every_window"}}, "kmp.growth_rul", "Did you mean 'growth_rule'?"),
    ({"gradient_cliping": 1.0}, "gradient_cliping", "Did you mean 'gradient_clipping'?"),
    ({"zero_optimisation": {}}, "zero_optimisation", "Did you mean 'zero_optimization'?"),
    ({"hysterisis": 2}, "hysterisis", "Did you mean 'fp16.hysteresis'?"),
    ({"hysteresis": 2}, "hysteresis", 'Keys nest by block: write {"fp16": {"hysteresis": ...}}.'),
    ({"growth_rule": "every_window"}, "growth_rule", 'Keys nest by block: write {"kmp": {"growth_rule": ...}}.'),
    ({"fp16.enabled": True}, "fp16.enabled", 'Keys nest by block: write {"fp16": {"enabled": ...}}.'),
    ({"enabled": True}, "enabled", 'Keys nest by block: write {"fp16": {"enabled": ...}} or {"bf16": {"enabled": ...}}.'),
    ({"fp16": {"xyz": 1}}, "fp16.xyz", "fp16 accepts: "),
    ({"xyz": 1}, "xyz", "Check its spelling"),
])
def test_unknown_keys_get_a_did_you_mean(given, path, hint):
    error = _problems(given, strict=True)
    assert [p.path for p in error.problems] == [path]
    assert error.problems[0].fix.startswith(hint)
    if next(iter(given)) in ("fp16", "bf16", "bfloat16", "kmp"):  # inside a block: an error even without strict, as DeepSpeed's block models refuse it
        assert _problems(given).problems == error.problems


@pytest.mark.parametrize("given,path,hint", [
    ({"gradient_cliping": 1.0}, "gradient_cliping", "Did you mean 'gradient_clipping'?"),
    ({"hysteresis": 2}, "hysteresis", 'Keys nest by block'),
    ({"cuda_visible_devices": "0,1"}, "cuda_visible_devices", ""),
])
def test_unknown_top_level_keys_are_one_warning_and_the_file_loads(given, path, hint):
    # DeepSpeed reads top-level keys one by one and ignores the rest (its own
    # tests ship cuda_visible_devices); the warning names them with a hint.
    with pytest.warns(UserWarning) as record:
        config = load_config({**given, "xyz": 1, "fp16": {"enabled": True}})
    assert config.precision == "fp16"
    assert len(record) == 1
    message = str(record[0].message)
    assert f"{path}" in message and "xyz" in message and hint in message and "strict=True" in message


def test_blocks_that_are_not_objects():
    error = _problems({"fp16": True, "kmp": [1], "bf16": None})
    assert [p.path for p in error.problems] == ["fp16", "bf16", "kmp"]
    assert all(p.expected == "a JSON object {...}" for p in error.problems)


@pytest.mark.parametrize("given,path,received", [
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis", 0),
    ({"fp16": {"hysteresis": 2.0}}, "fp16.hysteresis", 2.0),
    ({"fp16": {"hysteresis": True}}, "fp16.hysteresis", True),
    ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window", 0),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale", -1),
    ({"fp16": {"initial_scale_power": -1}}, "fp16.initial_scale_power", -1),
    ({"fp16": {"initial_scale_power": 1.5}}, "fp16.initial_scale_power", 1.5),
    ({"fp16": {"initial_scale_power": 128}}, "fp16.initial_scale_power", 128),
    ({"fp16": {"initial_scale_power": 5000}}, "fp16.initial_scale_power", 5000),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", 0),
    ({"fp16": {"consecutive_hysteresis": "false"}}, "fp16.consecutive_hysteresis", "false"),
    ({"gradient_clipping": -1.0}, "gradient_clipping", -1.0),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu", 0),
    ({"gradient_accumulation_steps": "4"}, "gradient_accumulation_steps", "4"),
    ({"kmp": {"backoff_factor": 2}}, "kmp.backoff_factor", 2),
    ({"kmp": {"raise_at_min_scale": 1}}, "kmp.raise_at_min_scale", 1),
])
def test_problems_name_the_json_key_and_the_value_as_written(given, path, received):
    error = _problems(given)
    assert [p.path for p in error.problems] == [path]
    assert error.problems[0].received == received
    assert type(error.problems[0].received) is type(received)


def test_initial_scale_problems_explain_the_power():
    # kmp's ceiling is its own (DeepSpeed's scaler has none): a file that asks
    # for more raises it; an explicit kmp.max_scale below is a problem.
    config = load_config({"fp16": {"initial_scale_power": 30}})
    assert config.loss_scale.initial_scale == config.loss_scale.max_scale == 2.0**30
    assert load_config({"fp16": {"initial_scale_power": 32, "loss_scale": 128}}).loss_scale.static_scale == 128
    problem = _problems({"fp16": {"initial_scale_power": 30}, "kmp": {"max_scale": 2.0**24}}).problems[0]
    assert "kmp.max_scale=16777216.0" in problem.expected
    assert "2**30" in problem.fix
    # A default pushed out of range by another key is shown as DeepSpeed writes it.
    problem = _problems({"kmp": {"max_scale": 1000}}).problems[0]
    assert (problem.path, problem.received) == ("fp16.initial_scale_power", 16)
    assert "DeepSpeed's default" in problem.fix


def test_nan_is_not_a_number_here():
    error = _problems('{"fp16": {"min_loss_scale": NaN, "loss_scale": Infinity}}')
    assert sorted(p.path for p in error.problems) == ["fp16.loss_scale", "fp16.min_loss_scale"]


# --- known keys kmp ignores ----------------------------------------------------


def test_known_deepspeed_keys_kmp_ignores_give_one_warning():
    source = {
        "memory_breakdown": False,
        "tensorboard": {"enabled": False},
        "fp16": {"enabled": True, "auto_cast": False, "fp16_master_weights_and_grads": False},
        "bf16": {"immediate_grad_update": True},
    }
    with pytest.warns(UserWarning) as record:
        config = load_config(source)
    assert len(record) == 1
    message = str(record[0].message)
    for path in ["memory_breakdown", "tensorboard",
                 "fp16.auto_cast", "fp16.fp16_master_weights_and_grads", "bf16.immediate_grad_update"]:
        assert path in message
    assert record[0].filename == __file__  # points at the caller, not into kmp
    assert config.precision == "fp16"


@pytest.mark.parametrize("given,factor", [
    ({}, None),  # kmp's order: gradients already averaged through the loss
    ({"prescale_gradients": True}, None),
    ({"prescale_gradients": True, "gradient_predivide_factor": 8}, None),  # DeepSpeed ignores it then
    ({"prescale_gradients": False}, 1.0),  # DeepSpeed: sum raw gradients, divide by N after
    ({"gradient_predivide_factor": 8}, 8.0),
])
def test_communication_follows_deepspeeds_scaling_keys(given, factor):
    communication = _load_quietly({**given, "communication_data_type": "fp16"}).communication()
    assert communication.predivide_factor == factor
    assert communication.dtype == "float16" and communication.bytes_per_pack == 0


def test_no_warning_when_nothing_is_ignored():
    _load_quietly(FULL)


# --- round trip ----------------------------------------------------------------

ROUND_TRIP = [
    Config(),
    Config(loss_scale=DEEPSPEED_LOSS_SCALE),
    Config(precision="fp16", loss_scale=LossScaleConfig(static_scale=128.0)),
    Config(precision="bf16", gradient_clipping=0.5, train_batch_size=256, micro_batch_size=16),
    Config(communication_data_type="float16", prescale_gradients=False, gradient_predivide_factor=2.0,
           allreduce_bytes_per_pack=4096),
    Config(precision="fp16", gradient_accumulation_steps=4, micro_batch_size=2, loss_scale=LossScaleConfig(
        initial_scale=1.0, dynamic_growth_steps=7, hysteresis=5, consecutive_hysteresis=True, min_scale=0.125,
        max_scale=2.0**30, raise_at_min_scale=False, growth_rule="after_window", growth_factor=4.0,
        backoff_factor=0.25,
    )),
]


@pytest.mark.parametrize("config", ROUND_TRIP)
def test_round_trip(config):
    data = to_deepspeed(config)
    assert _load_quietly(data) == config
    assert _load_quietly(json.dumps(data)) == config
    # Every field, compared one by one (jmp's lesson: a dropped field resets silently).
    back = _load_quietly(data)
    assert dataclasses.asdict(back) == dataclasses.asdict(config)


def test_to_deepspeed_writes_deepspeeds_own_keys():
    data = to_deepspeed(Config(precision="fp16", train_batch_size=32, loss_scale=DEEPSPEED_LOSS_SCALE))
    assert data["train_batch_size"] == 32
    assert "train_micro_batch_size_per_gpu" not in data  # left for DeepSpeed to infer
    assert data["gradient_clipping"] == 0
    assert data["fp16"] == {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1.0,
    }
    assert data["bf16"] == {"enabled": False}
    assert data["kmp"]["growth_rule"] == "after_window"


def test_to_deepspeed_rejects_what_deepspeed_cannot_hold():
    with pytest.raises(ConfigError) as info:
        to_deepspeed(Config(loss_scale=LossScaleConfig(initial_scale=1000.0)))
    assert [p.path for p in info.value.problems] == ["loss_scale.initial_scale"]
    with pytest.raises(ConfigError) as info:
        to_deepspeed(Config(precision="fp8"))
    assert [p.path for p in info.value.problems] == ["precision"]


# --- batch sizes ---------------------------------------------------------------


@pytest.mark.parametrize("train,micro,gas,world,expected", [
    (32, 4, 8, 1, (32, 4, 8)),  # all given
    (64, 4, 8, 2, (64, 4, 8)),  # all given, two replicas
    (32, 4, None, 1, (32, 4, 8)),  # gas = train // micro // world
    (32, 4, None, 2, (32, 4, 4)),
    (32, None, 8, 2, (32, 2, 8)),  # micro = train // world // gas
    (None, 4, 8, 2, (64, 4, 8)),  # train = micro * gas * world
    (32, None, None, 4, (32, 8, 1)),  # only train: gas 1
    (None, 4, None, 4, (16, 4, 1)),  # only micro: gas 1
])
def test_batch_sizes_are_inferred_as_deepspeed_does(train, micro, gas, world, expected):
    config = Config(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=gas)
    result = resolve_batch_sizes(config, world)
    assert result == expected
    assert all(type(v) is int for v in result)


def test_batch_sizes_from_a_loaded_file():
    config = _load_quietly({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})
    assert resolve_batch_sizes(config, 2) == (64, 8, 4)


@pytest.mark.parametrize("train,micro,gas,world,deepspeed_says,fixes", [
    (32, 4, 4, 1, "32 != 4 * 4 * 1",
     ["train_batch_size=16", "gradient_accumulation_steps=8", "train_micro_batch_size_per_gpu=8"]),
    (10, 2, None, 3, "10 != 2 * 1 * 3", ["train_batch_size=6"]),  # gas inferred 10 // 2 // 3 = 1
    (4, 8, None, 1, "4 != 8 * 0 * 1", ["train_batch_size=8"]),  # gas inferred 0
    (3, None, None, 4, "3 != 0 * 1 * 4", ["train_batch_size=4"]),  # micro inferred 0
])
def test_inconsistent_batch_sizes_use_deepspeeds_wording_and_say_the_fix(
        train, micro, gas, world, deepspeed_says, fixes):
    config = Config(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=gas)
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(config, world)
    message = str(info.value)
    assert ("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
            f"* gradient_acc_step * world_size {deepspeed_says}") in message
    for fix in fixes:
        assert fix in message
    assert ("inferred" in message) == (gas is None or micro is None)


@pytest.mark.parametrize("gas", [None, 4])
def test_neither_train_nor_micro_batch_size(gas):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(Config(gradient_accumulation_steps=gas), 1)
    assert "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided" in str(info.value)


@pytest.mark.parametrize("world", [0, -1, 1.5, True, "2"])
def test_world_size_must_be_a_positive_int(world):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(Config(train_batch_size=8), world)
    assert [p.path for p in info.value.problems] == ["world_size"]


def test_non_positive_batch_values_are_reported_by_their_deepspeed_key():
    # A kmp.Config cannot hold these (it is validated when made); any object
    # with the three fields can be given, and is checked the same way.
    with pytest.raises(ConfigError):
        Config(train_batch_size=0)
    config = types.SimpleNamespace(train_batch_size=0, micro_batch_size=-1, gradient_accumulation_steps=0)
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(config, 0)
    assert [p.path for p in info.value.problems] == [
        "world_size", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]


@pytest.mark.parametrize("raw, path", [
    ({"communication_data_type": []}, "communication_data_type"),       # unhashable: not a bare TypeError
    ({"communication_data_type": {"fp16": 1}}, "communication_data_type"),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}, "kmp": {"max_scale": 1e300}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "hysteresis": 2**63}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "loss_scale_window": 2**70}}, "fp16.loss_scale_window"),
    ({"gradient_clipping": 3.5e38}, "gradient_clipping"),
    ({"gradient_predivide_factor": 1e-300}, "gradient_predivide_factor"),
    ({"gradient_predivide_factor": 1e300}, "gradient_predivide_factor"),
])
def test_values_float32_or_int64_cannot_hold_are_errors_with_their_key(raw, path):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert path in [p.path for p in info.value.problems]


def test_json_text_that_is_not_an_object_is_not_taken_for_a_path():
    with pytest.raises(ConfigError, match=r"\(top level\): expected a JSON object"):
        load_config("[1, 2, 3]")


@pytest.mark.parametrize("spelled", ["FP16", "Fp16", "fp16"])
def test_communication_data_type_is_case_insensitive_as_deepspeed_lower_cases_it(spelled):
    assert load_config({"communication_data_type": spelled}).communication_data_type == "float16"


def test_zero_optimization_stages_load_with_what_kmp_does_instead():
    assert load_config({"zero_optimization": {"stage": 0}}).zero_stage == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stage 1 is what kmp does: nothing to say
        assert load_config({"zero_optimization": {"stage": 1}}).zero_stage == 1
        assert load_config({"zero_optimization": True}).zero_stage == 1  # DeepSpeed's legacy boolean form
    for stage in (2, 3):
        with pytest.warns(UserWarning, match=f"zero_optimization.stage is {stage}") as record:
            assert load_config({"zero_optimization": {"stage": stage}}).zero_stage == stage
        assert "kmp uses stage 1" in str(record[0].message)
    with pytest.warns(UserWarning, match="kmp does not offload"):
        load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert _problems({"zero_optimization": {"stage": 4}}).problems[0].path == "zero_optimization.stage"


def test_the_zero_block_is_checked_as_deepspeeds_block_model_checks_it():
    """Its keys and value types are DeepSpeedZeroConfig's (kmp.config.zero_block): every problem named at once."""
    error = _problems({"zero_optimization": {"stage": 1, "reduce_bucket_sizee": 5, "overlap_comm": "yes",
                                             "reduce_bucket_size": -5}})
    assert {p.path: (p.expected, p.fix) for p in error.problems} == {
        "zero_optimization.reduce_bucket_sizee": ("a key of zero_optimization that kmp or DeepSpeed knows",
                                                  "Did you mean 'reduce_bucket_size'?"),
        "zero_optimization.overlap_comm": ("true, false or null", ""),
        "zero_optimization.reduce_bucket_size": ("an integer >= 0", ""),
    }
    error = _problems({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 1.5, "leaf_module": [],
                                             "offload_optimizer": {"devise": "cpu", "ratio": 2}}})
    assert {p.path for p in error.problems} == {
        "zero_optimization.offload_optimizer.devise", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.leaf_module", "zero_optimization.offload_optimizer.ratio"}
    assert "Did you mean 'device'?" in str(error)


def test_deepspeeds_zero_keys_load_and_those_kmp_does_not_act_on_are_named_in_one_warning():
    # Integers written as JSON floats (5e8), null where DeepSpeed declares Optional, "auto" (left out, as
    # DeepSpeed's models leave it), a stage 3 key by its field name, and a disabled offload: all DeepSpeed's.
    block = {"stage": 1, "overlap_comm": None, "reduce_bucket_size": 5e8, "stage3_max_live_parameters": "auto",
             "prefetch_bucket_size": 0, "offload_optimizer": {"device": "none", "pin_memory": True}, "cpu_offload": False}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert load_config({"zero_optimization": block}).zero_stage == 1
    assert [str(r.message) for r in record] == [
        "kmp does not act on these keys of the DeepSpeed config, and ignores them: zero_optimization.overlap_comm, "
        "zero_optimization.reduce_bucket_size, zero_optimization.stage3_max_live_parameters, "
        "zero_optimization.prefetch_bucket_size. Keep them if DeepSpeed reads the same file; remove them to silence "
        "this warning."]


def test_an_activation_checkpointing_block_turns_it_on_and_names_the_keys_not_honoured():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False,
                                                           "number_checkpoints": 4, "profle": True}})
    assert config.activation_checkpointing
    said = [str(w.message) for w in caught]
    honoured_not = [s for s in said if "does not honour these keys of activation_checkpointing" in s]
    assert len(honoured_not) == 1 and "partition_activations=true" in honoured_not[0]
    assert "number_checkpoints=4" in honoured_not[0] and "cpu_checkpointing" not in honoured_not[0]
    assert any("activation_checkpointing.profle (Did you mean 'profile'?)" in s for s in said)
    assert load_config(to_deepspeed(config)).activation_checkpointing
    assert not load_config({}).activation_checkpointing
    with pytest.raises(ConfigError, match="activation_checkpointing.profle: expected a key"):
        load_config({"activation_checkpointing": {"profle": True}}, strict=True)
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointing: expected true or false"):
        load_config({"activation_checkpointing": {"cpu_checkpointing": "yes"}})
    with pytest.raises(ConfigError, match="activation_checkpointing: expected a JSON object"):
        load_config({"activation_checkpointing": True})
