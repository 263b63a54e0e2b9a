"""kmp.schedules.formulas and kmp.schedules.keras against DeepSpeed's own schedulers.

The goldens (tests/data/deepspeed_lr_goldens.json, see tests/data/README.md)
were recorded by running DeepSpeed's lr_schedules.py on a torch optimizer,
stepped as DeepSpeed's engine steps it: `rows[i]` is the lr (and betas or
momentum) in the param group when the optimizer steps, and `k` the number of
updates applied before it.
"""

import ast
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmp
from kmp.errors import ConfigError
from kmp.schedules.keras import DeepSpeedLearningRate, DeepSpeedMomentum, build_schedule
from kmp.schedules.formulas import ONE_CYCLE_BETA_2, PARAMETERS, REQUIRED, SCHEDULERS, Schedule, parse_scheduler

ROOT = Path(__file__).parent.parent
GOLDENS = json.loads((ROOT / "tests" / "data" / "deepspeed_lr_goldens.json").read_text())
CASES = GOLDENS["cases"]
# Some goldens decay for fewer steps than they warm up, on purpose; the warning is tested on its own.
pytestmark = pytest.mark.filterwarnings("ignore:Warmup(Decay|Cosine)LR. total_num_steps:UserWarning")
IDS = [c["name"] for c in CASES]
FLOAT32_TOLERANCE = 2.0**-21  # a few float32 ulps of the schedule's peak value


def float32_close(value, case):
    """`value` as a float32 computation gives it: a few ulps of itself and of the schedule's peak."""
    peak = max(abs(r["lr"]) for r in case["rows"])
    return pytest.approx(value, rel=FLOAT32_TOLERANCE, abs=FLOAT32_TOLERANCE * peak)


def schedule_of(case) -> Schedule:
    optimizer = case["optimizer"]
    beta_1 = optimizer["betas"][0] if "betas" in optimizer else None
    return parse_scheduler({"type": case["type"], "params": case["params"]}, base_lr=optimizer["lr"],
                           base_momentum=beta_1 if case["type"] == "OneCycle" else None)


def test_goldens_name_their_source():
    source = GOLDENS["source"]
    assert source["repository"] == "github.com/deepspeedai/DeepSpeed"
    assert len(source["commit"]) == 40 and source["path"] == "deepspeed/runtime/lr_schedules.py"
    assert {c["type"] for c in CASES} == set(SCHEDULERS)
    assert sum(len(c["rows"]) for c in CASES) > 900


def test_defaults_are_deepspeeds_constructor_signatures():
    # Recorded with inspect.signature on DeepSpeed's classes: the config's params are their keyword arguments.
    ours = {kind: {k: "REQUIRED" if v is REQUIRED else v for k, v in p.items()} for kind, p in PARAMETERS.items()}
    assert ours == GOLDENS["signatures"]
    assert set(SCHEDULERS) == set(GOLDENS["signatures"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_python_formulas_are_deepspeeds(case):
    schedule = schedule_of(case)
    for row in case["rows"]:
        # Measured: every value is bit-identical; the tolerance allows another libm's last bit.
        assert math.isclose(schedule.lr_at(row["k"]), row["lr"], rel_tol=1e-15), row


@pytest.mark.parametrize("case", [c for c in CASES if c["type"] == "OneCycle"], ids=lambda c: c["name"])
def test_one_cycle_momentum_is_deepspeeds(case):
    schedule = schedule_of(case)
    optimizer = case["optimizer"]
    for row in case["rows"]:
        if "betas" not in optimizer or not case["params"].get("cycle_momentum", True):
            # DeepSpeed leaves an SGD momentum (no `betas`) and a cycle_momentum=false optimizer alone.
            own = optimizer.get("momentum", optimizer.get("betas", [None])[0])
            assert row.get("momentum", row.get("beta_1")) == own
            continue
        assert math.isclose(schedule.momentum_at(row["k"]), row["beta_1"], rel_tol=1e-15), row
        # beta_2 is 0.99 from the first update on (from the second when resuming).
        resumed_first = row["k"] == 0 and schedule.last_batch_iteration != -1
        assert row["beta_2"] == (optimizer["betas"][1] if resumed_first else ONE_CYCLE_BETA_2)
    if "betas" not in optimizer:
        assert case["deepspeed_warnings"] == [
            "cycle_momentum is disabled because optimizer SGD does not support momentum, "
            "no betas attribute in defaults"]


@pytest.mark.parametrize("case", [c for c in CASES if "total_num_steps" in c["params"]], ids=lambda c: c["name"])
def test_a_decay_shorter_than_warmup_is_warned_where_deepspeed_warns(case):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule_of(case)
    ours = [str(w.message) for w in caught]
    theirs = [w for w in case.get("deepspeed_warnings") or [] if w.startswith("total_num_steps")]
    assert len(ours) == len(theirs), ours
    if theirs:  # both values, what the lr then does, and the fix
        total, warmup = case["params"]["total_num_steps"], case["params"]["warmup_num_steps"]
        assert f"total_num_steps ({total}) is less than warmup_num_steps ({warmup})" in ours[0]
        assert "then drops straight to" in ours[0] and "Set total_num_steps" in ours[0]


def test_a_decay_shorter_than_warmup_is_warned_once_whoever_reads_the_block():
    block = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 100}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        parse_scheduler(block)
        build_schedule(block, base_lr=0.1)
        kmp.load_config({"scheduler": block})
    assert [str(w.message).split(":")[0] for w in caught] == ["WarmupDecayLR"]
    assert "drops straight to warmup_min_lr (0)" in str(caught[0].message)


def test_a_one_cycle_whose_min_lr_is_above_its_max_lr_is_said_once_whoever_reads_the_block():
    """DeepSpeed accepts it and runs the cycle upside down; so does kmp, and says so."""
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-2, "cycle_max_lr": 1e-4}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        kmp.load_config(config)
        schedule = parse_scheduler(config["scheduler"], base_lr=1e-3)
        build_schedule(config["scheduler"], base_lr=1e-3)
    assert [str(w.message) for w in caught] == [
        "OneCycle: cycle_min_lr (0.01) is above cycle_max_lr (0.0001), which DeepSpeed accepts too: the lr falls from "
        "0.01 to 0.0001 over the cycle's first half and rises back, then stays at (or decays from) 0.01. Swap the two "
        "for a cycle that rises to cycle_max_lr."]
    first = schedule.settings["cycle_first_step_size"]
    assert schedule.lr_at(0) > schedule.lr_at(first - 1) < schedule.lr_at(2 * first - 1)  # as the note says
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the usual order: nothing to say
        parse_scheduler({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}})


def test_momentum_is_none_unless_one_cycle_cycles_it():
    for case in CASES:
        schedule = schedule_of(case)
        cycles = case["type"] == "OneCycle" and case["params"].get("cycle_momentum", True)
        assert schedule.cycles_momentum == cycles
        assert (schedule.momentum_at(3) is None) == (not cycles)


@pytest.mark.parametrize("case", [c for c in CASES if "overflow" in c["rows"][0]], ids=lambda c: c["name"])
def test_overflow_steps_do_not_advance_deepspeeds_schedule(case):
    # Engine trace: an overflow step leaves the scheduler where it was, so the
    # lr of the k-th applied update is lr_at(k), however many steps overflowed.
    schedule = schedule_of(case)
    applied = 0
    for row in case["rows"]:
        assert row["k"] == applied
        assert math.isclose(schedule.lr_at(applied), row["lr"], rel_tol=1e-15)
        applied += not row["overflow"]
    assert sum(r["overflow"] for r in case["rows"]) == 4


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_keras_schedules_are_deepspeeds_in_float32(jit_compile):
    for case in CASES:
        optimizer = case["optimizer"]
        lr, momentum = build_schedule({"type": case["type"], "params": case["params"]}, base_lr=optimizer["lr"],
                                      base_momentum=optimizer.get("betas", [None])[0] if case["type"] == "OneCycle"
                                      else None)
        steps = tf.constant([r["k"] for r in case["rows"]], tf.int64)
        compute = tf.function(lambda k: lr(k), jit_compile=jit_compile)
        got = compute(steps).numpy()
        assert got.dtype == np.float32
        want = np.array([r["lr"] for r in case["rows"]])
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE * scale,
                                   err_msg=case["name"])
        if momentum is not None and "beta_1" in case["rows"][0]:
            got = tf.function(lambda k: momentum(k), jit_compile=jit_compile)(steps).numpy()
            want = [r["beta_1"] for r in case["rows"]]
            np.testing.assert_allclose(got, want, rtol=FLOAT32_TOLERANCE, err_msg=case["name"])


def test_keras_schedule_takes_any_integer_step_and_matches_eager():
    case = next(c for c in CASES if c["name"] == "OneCycle stairs in both halves")
    lr, momentum = build_schedule({"type": case["type"], "params": case["params"]}, base_lr=0.002)
    for row in case["rows"][:10]:
        k = row["k"]
        values = {float(lr(step)) for step in (k, tf.constant(k, tf.int64), tf.constant(k, tf.int32),
                                               tf.Variable(k, dtype=tf.int64), np.int64(k))}
        assert values == {float(np.float32(lr(k)))}
        assert abs(float(lr(k)) - row["lr"]) <= FLOAT32_TOLERANCE * 0.01
        assert float(momentum(tf.constant(k, tf.int64))) == pytest.approx(row["beta_1"], rel=FLOAT32_TOLERANCE)


def test_serialization_round_trip():
    block = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5,
                                            "decay_step_size": 2, "decay_lr_rate": 0.1, "last_batch_iteration": 3}}
    lr, momentum = build_schedule(block, base_lr=3e-4, base_momentum=0.9)
    for schedule in (lr, momentum):
        config = schedule.get_config()
        assert config == {"scheduler": block, "base_lr": 3e-4, "base_momentum": 0.9}
        assert json.loads(json.dumps(config)) == config
        again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
        assert type(again) is type(schedule) and again.schedule == schedule.schedule
        assert [float(again(k)) for k in range(12)] == [float(schedule(k)) for k in range(12)]
    assert keras.saving.get_registered_name(DeepSpeedLearningRate) == "kmp>DeepSpeedLearningRate"
    # Through an optimizer's config, as a .keras file stores it.
    optimizer = keras.optimizers.Adam(learning_rate=lr)
    config = optimizer.get_config()
    assert config["learning_rate"]["registered_name"] == "kmp>DeepSpeedLearningRate"
    saved = json.loads(json.dumps(config["learning_rate"]))
    restored = keras.optimizers.Adam.from_config(config)  # (replaces config's dict by the schedule)
    assert restored.get_config()["learning_rate"] == saved
    assert float(restored.learning_rate) == float(lr(0)) == float(np.float32(3e-4))  # resuming: base_lr first
    assert parse_scheduler(lr.schedule.block(), base_lr=3e-4, base_momentum=0.9) == lr.schedule


def test_model_file_round_trip(tmp_path):
    lr, _ = build_schedule({"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}},
                           base_lr=0.01)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=3, batch_size=2, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert int(loaded.optimizer.iterations.numpy()) == 6
    assert float(loaded.optimizer.learning_rate) == float(lr(6)) == pytest.approx(lr.schedule.lr_at(6), rel=1e-6)


def _train_through_overflows(case, flags, strategy=None, jit_compile=True, micro_batches=1):
    """Engine steps of a float16 model under kmp.wrap; the applied lr of each step, read off the weight.

    With `micro_batches` > 1, each engine step is a window of that many
    micro-batches and the overflowing batch is the window's first.
    """
    lr, _ = build_schedule({"type": case["type"], "params": case["params"]}, base_lr=case["optimizer"]["lr"])
    scope = strategy.scope() if strategy else kmp.precision_scope("mixed_float16")
    with scope, kmp.precision_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        # A small initial scale: the float16 gradient of the kernel is the scale itself.
        config = {"fp16": {"enabled": True, "initial_scale_power": 4}}
        accumulation = {"gradient_accumulation_steps": micro_batches} if micro_batches > 1 else {}
        optimizer = kmp.wrap(keras.optimizers.SGD(learning_rate=lr), config, **accumulation)
        # A per-sample loss equal to the prediction: the kernel's gradient is the mean input.
        model.compile(optimizer=optimizer, loss=lambda y, p: ops.cast(p, "float32"), jit_compile=jit_compile)
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    kernel = model.layers[0].kernel
    used, iterations = [], []
    for overflow in flags:
        # From 0 with a gradient of exactly 1 (unscaled), the new weight is -lr exactly.
        kernel.assign(np.zeros((1, 1), np.float32))
        for micro_batch in range(micro_batches):
            x = np.array([[np.inf], [1.0]] if overflow and micro_batch == 0 else [[1.0], [1.0]], np.float32)
            model.train_on_batch(x, np.zeros((2, 1), np.float32))
            if micro_batch < micro_batches - 1:
                assert float(kernel.numpy()[0, 0]) == 0.0  # the window is open: nothing applied
        used.append(-float(kernel.numpy()[0, 0]))
        iterations.append(int(optimizer.iterations.numpy()))
    return lr, used, iterations, int(optimizer.skipped_steps.numpy())


@pytest.mark.filterwarnings("ignore:precision 'mixed_float16' on CPU")
@pytest.mark.parametrize("name, micro_batches", [("Trace: WarmupDecayLR linear with overflow steps", 1),
                                                 ("Trace: WarmupCosineLR log with overflow steps", 1),
                                                 ("Trace: WarmupDecayLR linear with overflow steps", 3)])
def test_wrapped_optimizer_uses_deepspeeds_lr_per_applied_step(name, micro_batches):
    case = next(c for c in CASES if c["name"] == name)
    flags = [r["overflow"] for r in case["rows"]]
    lr, used, iterations, skipped = _train_through_overflows(case, flags, micro_batches=micro_batches)
    assert skipped == sum(flags)
    for row, value, after in zip(case["rows"], used, iterations):
        if row["overflow"]:
            assert value == 0.0 and after == row["k"]  # nothing applied, the count did not move
        else:
            assert after == row["k"] + 1
            # The schedule's float32 value, computed inside the XLA-compiled step.
            assert value == float32_close(row["lr"], case)


@pytest.mark.filterwarnings("ignore:precision 'mixed_float16' on CPU")
def test_wrapped_optimizer_under_mirrored_strategy(two_replicas):
    case = next(c for c in CASES if c["name"] == "Trace: WarmupDecayLR linear with overflow steps")
    rows = case["rows"][:8]
    # Batch of 2: the inf goes to one replica only; both skip, as the all-reduced gradient is not finite.
    lr, used, iterations, skipped = _train_through_overflows(case, [r["overflow"] for r in rows], two_replicas,
                                                             jit_compile=False)
    assert skipped == sum(r["overflow"] for r in rows)
    for row, value in zip(rows, used):
        assert value == (0.0 if row["overflow"] else float32_close(row["lr"], case))


def problems(block, **bases):
    with pytest.raises(ConfigError) as error:
        parse_scheduler(block, **bases)
    return {p.path: p for p in error.value.problems}, str(error.value)


BAD_PARAMS = [
    ("WarmupLR", "warmup_num_steps", 0), ("WarmupLR", "warmup_num_steps", 10.0), ("WarmupLR", "warmup_num_steps", "10"),
    ("WarmupLR", "warmup_num_steps", True), ("WarmupLR", "warmup_type", "cosine"), ("WarmupLR", "warmup_type", None),
    ("WarmupLR", "warmup_min_lr", -1e-3), ("WarmupLR", "warmup_min_lr", math.nan),
    ("WarmupLR", "warmup_max_lr", "1e-3"),
    ("WarmupLR", "warmup_max_lr", 1e39), ("WarmupLR", "last_batch_iteration", -2),
    ("WarmupLR", "last_batch_iteration", 1.5),
    ("WarmupDecayLR", "total_num_steps", -1), ("WarmupDecayLR", "total_num_steps", 1e4),
    ("WarmupCosineLR", "cos_min_ratio", -0.1), ("WarmupCosineLR", "warmup_min_ratio", math.inf),
    ("OneCycle", "cycle_first_step_size", 0), ("OneCycle", "cycle_second_step_size", -1),
    ("OneCycle", "cycle_first_stair_count", 2.0), ("OneCycle", "cycle_second_stair_count", -2),
    ("OneCycle", "decay_step_size", -1), ("OneCycle", "decay_lr_rate", -0.5), ("OneCycle", "cycle_momentum", "yes"),
    ("OneCycle", "cycle_min_mom", 1.5), ("OneCycle", "cycle_max_mom", -0.1), ("OneCycle", "decay_mom_rate", None),
    ("OneCycle", "cycle_max_lr", [1e-3, 2e-3]),
    ("LRRangeTest", "lr_range_test_step_size", 0), ("LRRangeTest", "lr_range_test_staircase", 1),
    ("LRRangeTest", "lr_range_test_step_rate", -1.0), ("LRRangeTest", "lr_range_test_min_lr", [1e-3]),
]

REQUIRED_PARAMS = {"WarmupDecayLR": {"total_num_steps": 100}, "WarmupCosineLR": {"total_num_steps": 100},
                   "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}


@pytest.mark.parametrize("kind, name, value", BAD_PARAMS)
def test_each_bad_parameter_is_one_problem_at_its_key_path(kind, name, value):
    params = {**REQUIRED_PARAMS.get(kind, {}), name: value}
    found, text = problems({"type": kind, "params": params}, base_lr=1e-3)
    assert list(found) == [f"scheduler.params.{name}"]
    assert found[f"scheduler.params.{name}"].received is value
    if isinstance(value, list):
        assert "per-param-group lists are not supported" in text


def test_every_problem_is_reported_at_once():
    block = {"type": "OneCycle", "params": {"cycle_min_lr": -1, "decay_step_siz": 5, "cycle_momentum": 1,
                                            "warmup_num_steps": 10}, "parms": {}}
    found, text = problems(block)
    assert set(found) == {"scheduler.params.cycle_min_lr", "scheduler.params.decay_step_siz",
                          "scheduler.params.cycle_momentum", "scheduler.params.warmup_num_steps",
                          "scheduler.params.cycle_max_lr", "scheduler.parms"}
    assert "Did you mean 'decay_step_size'?" in text and "Did you mean 'params'?" in text
    assert "It is a parameter of WarmupLR, WarmupDecayLR, WarmupCosineLR." in text
    assert "DeepSpeed's OneCycle has no default for it" in text
    assert text.startswith("Invalid DeepSpeed scheduler block (6 problems)")


@pytest.mark.parametrize("block, path, says", [
    ({"type": "WarmupLr", "params": {}}, "scheduler.type", "Did you mean 'WarmupLR'?"),
    ({"type": "warmupcosinelr", "params": {}}, "scheduler.type", "Did you mean 'WarmupCosineLR'?"),
    ({"type": "StepLR", "params": {}}, "scheduler.type",
     "one of 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle', 'LRRangeTest'"),
    ({"params": {}}, "scheduler.type", "Received: scheduler.type=nothing (the key is missing)"),
    ({"type": "LRRangeTest"}, "scheduler.params", '"params": {} takes every default'),
    ({"type": "LRRangeTest", "params": [1]}, "scheduler.params", "an object of the scheduler's parameters"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 5}}, "scheduler.params.warmup_num_step",
     "Did you mean 'warmup_num_steps'?"),
    ({"type": "OneCycle", "params": {**REQUIRED_PARAMS["OneCycle"], "post_cycle_decay_step_size": 5}},
     "scheduler.params.post_cycle_decay_step_size", "Did you mean 'decay_step_size'?"),
    ("WarmupLR", "scheduler", 'expected an object {"type": ..., "params": {...}}'),
])
def test_bad_blocks(block, path, says):
    found, text = problems(block)
    assert list(found) == [path] and says in text


@pytest.mark.parametrize("block, bases, path, says", [
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}, {}, "base_lr", "scales the optimizer's lr"),
    ({"type": "WarmupLR", "params": {}}, {}, "base_lr", "warmup_max_lr is null"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_max_lr": None}}, {}, "base_lr",
     "warmup_max_lr is null"),
    ({"type": "LRRangeTest", "params": {"last_batch_iteration": 4}}, {}, "base_lr", "last_batch_iteration is not -1"),
    ({"type": "OneCycle", "params": {**REQUIRED_PARAMS["OneCycle"], "last_batch_iteration": 4}}, {"base_lr": 1e-3},
     "base_momentum", "betas[0]"),
    ({"type": "LRRangeTest", "params": {}}, {"base_lr": -1.0}, "base_lr", ">= 0"),
    ({"type": "LRRangeTest", "params": {}}, {"base_momentum": 2.0}, "base_momentum", "<= 1"),
])
def test_base_values_are_required_where_deepspeed_reads_the_optimizer(block, bases, path, says):
    found, text = problems(block, **bases)
    assert list(found) == [path] and says in text


def test_base_values_are_optional_where_deepspeed_does_not_read_them():
    assert parse_scheduler({"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}).lr_at(0) == 0.0
    one_cycle = {"type": "OneCycle", "params": {**REQUIRED_PARAMS["OneCycle"], "last_batch_iteration": 4,
                                                "cycle_momentum": False}}
    assert parse_scheduler(one_cycle, base_lr=0.5).lr_at(0) == 0.5


def test_schedule_is_a_validated_value():
    schedule = Schedule("LRRangeTest", {"lr_range_test_step_size": np.int64(5)}, base_lr=np.float32(0.5))
    assert schedule.params == (("lr_range_test_step_size", 5),) and type(schedule.params[0][1]) is int
    assert type(schedule.base_lr) is float
    assert schedule == Schedule("LRRangeTest", (("lr_range_test_step_size", 5),), 0.5)
    assert hash(schedule) == hash(Schedule("LRRangeTest", (("lr_range_test_step_size", 5),), 0.5))
    with pytest.raises(ConfigError, match="scheduler.params.lr_range_test_step_size"):
        Schedule("LRRangeTest", {"lr_range_test_step_size": 0})
    with pytest.raises(ValueError, match="step: expected an integer >= 0"):
        schedule.lr_at(-1)
    with pytest.raises(ValueError, match="step: expected an integer >= 0"):
        schedule.lr_at(1.0)
    with pytest.raises(ConfigError, match="OneCycle with cycle_momentum true"):
        DeepSpeedMomentum({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}})
    with pytest.raises(TypeError):
        DeepSpeedLearningRate(schedule, base_lr=0.1)


def test_milestones_bracket_each_phase():
    decay = parse_scheduler({"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10}})
    # Update k uses DeepSpeed's last_batch_iteration k - 1: warmup ends at 10, the lr is 0 from 30 on.
    assert decay.milestones() == (0, 1, 10, 11, 12, 30, 31, 32)
    assert decay.lr_at(31) == 0.0 < decay.lr_at(30)
    resumed = parse_scheduler({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "last_batch_iteration": 4,
                                                              "warmup_max_lr": 0.1}}, base_lr=0.2)
    assert resumed.milestones() == (0, 1, 5, 6, 7)
    cycle = parse_scheduler({"type": "OneCycle", "params": {**REQUIRED_PARAMS["OneCycle"], "cycle_first_step_size": 4,
                                                            "cycle_second_step_size": 6}})
    assert cycle.milestones() == (0, 1, 3, 4, 5, 10, 11, 12)
    # The peak of the cycle is at the milestone: lr rises to it and falls after it.
    lrs = [cycle.lr_at(k) for k in (3, 4, 5)]
    assert lrs[1] == pytest.approx(1e-3, rel=1e-15) and lrs[0] < lrs[1] > lrs[2]


def test_schedules_module_imports_no_tensorflow_keras_or_numpy():
    tree = ast.parse((ROOT / "kmp" / "schedules" / "formulas.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n.split(".")[0] for n in names} & {"tensorflow", "keras", "tf_keras", "numpy"}
    # And at run time: imported without kmp/__init__.py (which loads TensorFlow), it computes a table.
    script = (
        "import sys, types\n"
        f"package = types.ModuleType('kmp'); package.__path__ = [{str(ROOT / 'kmp')!r}]; sys.modules['kmp'] = package\n"
        "from kmp.schedules.formulas import parse_scheduler\n"
        "s = parse_scheduler({'type': 'WarmupLR', 'params': {'warmup_max_lr': 0.1, 'warmup_num_steps': 4}})\n"
        "print([s.lr_at(k) for k in s.milestones()])\n"
        "assert not {'tensorflow', 'keras', 'numpy'} & set(sys.modules), sorted(sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ""}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[0.0, 0.0, ")
