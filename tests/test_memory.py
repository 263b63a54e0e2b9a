"""kmp.memory_estimate against the bytes kmp and Keras allocate (kmp.measured_bytes); its arithmetic; `kmp memory`.

The model-mode cases train a real compiled model for a few steps (so the
optimizer, the metrics and, when on, the flat-buffer engine are built), then
compare the estimate with the variables' bytes on every replica device, byte
for byte: stages 0 and 1, 32-bit states (8-bit states: tests/test_eight_bit.py
checks their allocation).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import kmp
from kmp.engine import engine
from kmp.memory import estimate as memory
from kmp.engine import zero
from kmp.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:precision 'mixed_float16' on CPU")

# The test model: Dense(8 -> 16), BatchNormalization(16), Dropout, Dense(16 -> 3).
PARAMETERS = 8 * 16 + 16 + 2 * 16 + 16 * 3 + 3  # 227 trainable
NON_TRAINABLE = 2 * 16 * 4 + 2 * 8  # BatchNorm's moving mean and variance (float32), Dropout's int64 seed state


def _trained_model(strategy, precision, optimizer, accumulation, flat_buffers, stage=0):
    keras.utils.set_random_seed(0)
    with kmp.precision_scope(precision), strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16)(inputs)
        hidden = keras.layers.Dropout(0.1)(keras.layers.BatchNormalization()(hidden))
        model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(3)(hidden)))
        extra = {} if accumulation is None else {"gradient_accumulation_steps": accumulation}
        extra.update({"zero_stage": stage} if stage else {})
        model.compile(optimizer=kmp.wrap(optimizer(), **extra), loss="mse", metrics=["mae"])
    if flat_buffers is not None:
        kmp.prepare(model, flat_buffers=flat_buffers)
    before = kmp.memory_estimate(model)
    rng = np.random.default_rng(0)
    model.fit(rng.random((16, 8), "float32"), rng.random((16, 3), "float32"), batch_size=4, verbose=0)
    return model, before


# (replicas, precision, optimizer, gradient_accumulation_steps, flat_buffers, ZeRO stage): None = no kmp.prepare
# / no accumulation.
CASES = [
    pytest.param(1, "float32", lambda: keras.optimizers.SGD(0.01, momentum=0.9), None, None, 0, id="1-fp32-sgd-plain"),
    pytest.param(1, "mixed_float16", lambda: keras.optimizers.Adam(1e-3), 2, True, 0, id="1-fp16-adam-acc-flat"),
    pytest.param(2, "mixed_float16", lambda: keras.optimizers.AdamW(1e-3), None, True, 0, id="2-fp16-adamw-flat"),
    pytest.param(2, "float32", lambda: keras.optimizers.Adam(1e-3), 2, False, 0, id="2-fp32-adam-acc"),
    pytest.param(1, "mixed_float16", lambda: keras.optimizers.Lamb(1e-3), None, True, 0, id="1-fp16-lamb-flat"),
    pytest.param(2, "mixed_float16", lambda: keras.optimizers.AdamW(1e-3), None, True, 1, id="2-fp16-adamw-flat-zero1"),
    pytest.param(2, "float32", lambda: keras.optimizers.SGD(0.01, momentum=0.9), 2, True, 1,
                 id="2-fp32-sgd-acc-flat-zero1"),
]


@pytest.mark.parametrize("replicas, precision, optimizer, accumulation, flat_buffers, stage", CASES)
def test_the_estimate_is_what_each_replica_allocates(replicas, precision, optimizer, accumulation, flat_buffers,
                                                     stage, request):
    import tensorflow as tf

    strategy = request.getfixturevalue("two_replicas") if replicas == 2 else tf.distribute.get_strategy()
    model, before = _trained_model(strategy, precision, optimizer, accumulation, flat_buffers, stage)
    # Two logical CPUs (replicas of one process) hold the flat buffers in shards at any stage (kmp.engine.buffers),
    # and Keras's copy of the slots once in host memory (kmp.engine.zero).
    in_shards = replicas == 2 and bool(flat_buffers)
    assert engine.engine_of(model) is None or engine.engine_of(model).buffers.layout.sharded == in_shards
    assert engine.engine_of(model) is None or engine.engine_of(model).buffers.layout.slots_on_host == in_shards
    assert (engine.engine_of(model) is not None) == bool(flat_buffers)  # the path the case names ran
    estimate = kmp.memory_estimate(model)
    measured = kmp.measured_bytes(model)
    assert len(measured) == replicas
    for device, allocated in measured.items():
        expected = estimate.in_variables()
        # Replica 0's device is the host here: it holds Keras's copy at stage 1 too.
        if device == zero.host(model.distribute_strategy):
            expected = dataclasses.replace(expected, optimizer_state=expected.optimizer_state + estimate.host)
        assert allocated == expected, device
    # By hand: float32 masters only (mixed precision keeps no 16-bit copy), the slots, the sums, the buffers.
    slots = {"sgd_momentum": 1, "adam": 2, "adamw": 2, "lamb": 2}[estimate.optimizer]
    # The flat buffers pad 227 parameters to whole units of 16 elements: 240 (kmp.engine.buffers, ALIGN).
    flat = -(-PARAMETERS // 16) * 16
    segment_ids = 4 * flat if estimate.optimizer == "lamb" else 0  # kmp.engine.buffers's per-element ids
    sums = 4 * PARAMETERS if accumulation else 0
    assert (estimate.parameters, estimate.replicas, estimate.precision) == (PARAMETERS, replicas, precision)
    assert estimate.weights == 4 * PARAMETERS + NON_TRAINABLE
    assert estimate.gradients == 4 * PARAMETERS
    shard = -(-flat // 32) * 16 if in_shards else flat  # 128 of 240: two shards of whole units
    # With the buffers in shards Keras's copy of the slots is held once in host memory, on no replica's device
    # (kmp.engine.zero).
    held = 4 * slots * PARAMETERS
    state, host = (0, held) if in_shards else (held, 0)
    assert (estimate.stage, estimate.optimizer_state, estimate.accumulators) == (stage, state, sums)
    assert estimate.host == host
    # The flat sums add up the flat gradient, zero padded to whole shards when sharded (256 here).
    flat_sums = (4 * 2 * shard if in_shards else 4 * flat) if accumulation else 0
    assert estimate.flat_copies == (4 * shard + 4 * slots * shard + flat_sums + segment_ids if flat_buffers else 0)
    # Before the first fit, from kmp.prepare's setting: the same, but the metrics' totals (built by fit).
    assert dataclasses.replace(before, scalars=0) == dataclasses.replace(estimate, scalars=0)
    assert estimate.scalars - before.scalars == 2 * 4  # mae's total and count (the loss tracker's exist before)
    # Asked of this model: stage 1 on eight replicas shards the flat slots (when the buffers are on).
    sharded = kmp.memory_estimate(model, stage=1, replicas=8)
    eighth = -(-flat // 128) * 16 if flat_buffers and estimate.optimizer != "lamb" else flat
    one_process = replicas == 2  # the two logical CPUs: the flat weights in shards too
    flat_sums = (4 * 8 * eighth if eighth < flat else 4 * flat) if accumulation else 0
    assert sharded.flat_copies == (4 * (eighth if one_process else flat) + 4 * slots * eighth + flat_sums
                                   + segment_ids if flat_buffers else 0)



def test_a_model_with_keras_own_loss_scale_optimizer_and_a_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9)  # no learning-rate variable
    with kmp.precision_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(schedule)), loss="mse")
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    estimate = kmp.memory_estimate(model)
    assert kmp.measured_bytes(model)[next(iter(kmp.measured_bytes(model)))] == estimate.in_variables()
    assert estimate.scalars == 8 + 24 + 8  # Adam's iterations; Keras's loss-scale scalars; the loss tracker


# --- parameter counts: DeepSpeed-style bytes per parameter, by hand ----------------------------------------

P = 125_000_000


def test_adam_in_mixed_precision_is_16_bytes_per_parameter_as_4_4_8():
    e = kmp.memory_estimate(P)
    # DeepSpeed's estimate (stage_1_and_2.py's comment) counts 2 + 2 + 4 + 4 + 8 bytes per parameter on one
    # GPU: 16-bit weights and gradients, float32 gradients, masters and Adam's moments. kmp's is 4 + 4 + 8:
    # the float32 weights are the masters, and the gradient is float32 only.
    assert (e.weights, e.gradients, e.optimizer_state) == (4 * P, 4 * P, 8 * P)
    assert (e.accumulators, e.flat_copies) == (0, 0)
    assert e.scalars == 12 + 24 + 32  # Keras's optimizer, Keras's loss-scale and kmp's loss-scale scalars
    assert e.total == 16 * P + 68
    assert (e.optimizer, e.precision, e.replicas, e.stage, e.states) == ("adam", "mixed_float16", 1, 0, "32bit")


@pytest.mark.parametrize("replicas", [1, 2, 8])
def test_stage_1_divides_the_flat_slot_copies(replicas):
    n = 1001  # not divisible: the flat buffers hold 1008 (whole units of 16), a shard ceil(1008 / 16N) units
    flat = 1008
    shard = -(-flat // (16 * replicas)) * 16
    zero = kmp.memory_estimate(n, replicas=replicas, flat_buffers=True)
    one = kmp.memory_estimate(n, replicas=replicas, stage=1, flat_buffers=True)
    # The flat slots the step updates are sharded; Keras's slot variables (the observable copy) stay
    # whole, held once in host memory at stage 1 instead of on every replica (kmp.engine.zero).
    assert zero.optimizer_state == 8 * n and zero.host == 0
    assert (one.optimizer_state, one.host) == ((0, 8 * n) if replicas > 1 else (8 * n, 0))
    assert zero.flat_copies == 4 * flat + 8 * flat and one.flat_copies == 4 * flat + 8 * shard  # the weights stay whole
    # Without the buffers, and with Lamb, nothing is sharded (kmp says so when it trains).
    assert kmp.memory_estimate(n, replicas=replicas, stage=1) == dataclasses.replace(
        kmp.memory_estimate(n, replicas=replicas), stage=1)
    lamb = kmp.memory_estimate(n, optimizer="lamb", replicas=replicas, stage=1, flat_buffers=True)
    assert lamb.flat_copies == 4 * flat + 8 * flat + 4 * flat
    assert (one.weights, one.gradients) == (zero.weights, zero.gradients) == (4 * n, 4 * n)


def test_8bit_states_are_a_byte_per_moment_and_a_scale_per_block():
    blocks = -(-P // 256)
    e = kmp.memory_estimate(P, states="8bit")
    assert e.optimizer_state == 2 * (P + 4 * blocks)
    # Keras's copy stays whole at stage 1, once in host memory; the flat buffers' codes and scales are
    # sharded by whole blocks, and their weights padded to whole blocks (a count is one tensor here).
    one = kmp.memory_estimate(P, states="8bit", stage=1, replicas=8, flat_buffers=True)
    assert (one.optimizer_state, one.host) == (0, 2 * (P + 4 * blocks))
    assert one.flat_copies == 4 * 256 * blocks + 2 * -(-blocks // 8) * (256 + 4)
    assert kmp.memory_estimate(P, states="8bit", stage=1, replicas=8).flat_copies == 0
    assert kmp.memory_estimate(P, optimizer="adamw", states="8bit", block_size=2048).optimizer_state == (
        2 * (P + 4 * -(-P // 2048)))


def test_accumulation_optimizers_and_precisions():
    e = kmp.memory_estimate(P, gradient_accumulation_steps=4, flat_buffers=True)
    assert (e.accumulators, e.flat_copies, e.scalars) == (4 * P, 4 * P + 8 * P + 4 * P, 68 + 20)
    plain = kmp.memory_estimate(P, optimizer="sgd", precision="float32")  # kmp.wrap returns SGD itself
    assert (plain.optimizer_state, plain.scalars, plain.total) == (0, 12, 8 * P + 12)
    assert kmp.memory_estimate(P, optimizer="sgd_momentum", precision="bf16").optimizer_state == 4 * P
    assert kmp.memory_estimate(P, optimizer="lion", replicas=2).scalars == 68  # kmp's optimizer for replicas
    half = kmp.memory_estimate(P, precision="bfloat16")  # bfloat16 variables: 2 bytes, and so are the slots
    assert (half.weights, half.gradients, half.optimizer_state) == (2 * P, 2 * P, 4 * P)
    assert kmp.memory_estimate(P, precision="16-mixed").precision == "mixed_float16"  # kmp.resolve_precision's
    assert kmp.memory_estimate(P, optimizer=keras.optimizers.Adam(amsgrad=True)).optimizer_state == 12 * P
    assert kmp.memory_estimate(P, optimizer=keras.optimizers.RMSprop(momentum=0.9, centered=True)).optimizer_state == (
        12 * P)


@pytest.mark.parametrize("text, count", [("125M", 125_000_000), ("1.3B", 1_300_000_000), ("7e9", 7_000_000_000),
                                         ("350k", 350_000), ("2G", 2_000_000_000), ("1_000", 1000), (" 42 ", 42),
                                         ("0.5K", 500), ("1T", 10**12)])
def test_parameter_counts_are_read_as_written(text, count):
    assert memory.parse_count(text) == count
    assert kmp.memory_estimate(text).parameters == count


ERRORS = [
    ({"stage": 2}, "stage: expected 0 or 1 (ZeRO stages 2 and 3 are out of kmp's scope). Received: stage=2"),
    ({"stage": True}, "Received: stage=True"),
    ({"states": "4bit"}, "states: expected one of '32bit', '8bit'. Received: states='4bit'. Did you mean '8bit'?"),
    ({"optimizer": "sgd", "states": "8bit"}, "8-bit states are for adam and adamw"),
    ({"optimizer": "adamm"}, "Did you mean 'adam'?"),
    ({"optimizer": keras.optimizers.Adafactor()}, "Received: optimizer='Adafactor'"),
    ({"optimizer": "rmsprop", "flat_buffers": True}, "kmp.engine.buffers updates sgd"),
    ({"precision": "float16", "flat_buffers": True}, "the buffers hold float32"),
    ({"precision": "fp8"}, "Received: precision='fp8'"),
    ({"replicas": 0}, "replicas: expected an integer >= 1. Received: replicas=0"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: expected an integer >= 1"),
    ({"flat_buffers": "yes"}, "flat_buffers: expected true or false"),
]


@pytest.mark.parametrize("arguments, message", ERRORS)
def test_bad_settings_are_config_errors(arguments, message):
    with pytest.raises(kmp.ConfigError) as raised:
        kmp.memory_estimate(P, **arguments)
    assert message in str(raised.value)


@pytest.mark.parametrize("given", ["12X", "0", "-5", "2.5", "", [3], True, 10**30])
def test_bad_parameter_counts_are_config_errors(given):
    with pytest.raises(kmp.ConfigError, match="parameters"):
        kmp.memory_estimate(given)


def test_a_model_must_be_compiled():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(kmp.ConfigError, match="a built, compiled keras.Model, or a parameter count"):
        kmp.memory_estimate(model)


# --- the table and the command ---------------------------------------------------------------------------


def test_the_table_says_shared_settings_once_and_one_row_per_setting():
    rows = memory.estimates(P, replicas=[1, 8], stage=[0, 1])
    text = memory.table(rows)
    lines = text.splitlines()
    assert lines[2] == "Model with 125M parameters; adam, mixed_float16, 32bit, accumulation=1, flat_buffers=off."
    assert [line.split(" | ")[-1] for line in lines[4:]] == [
        "replicas=1, stage=0", "replicas=1, stage=1", "replicas=8, stage=0", "replicas=8, stage=1"]
    assert lines[7].split(" | ")[0].strip() == "1.86 GiB"  # 4P + 4P + 8P + 68 bytes: no buffers, nothing sharded
    assert str(rows[3]).splitlines()[-1].split() == ["total", "1.86", "GiB"]


def test_kmp_memory_prints_the_table_and_json(capsys):
    assert main(["memory", "--params", "125M", "--replicas", "1,2,8", "--stage", "0,1", "--states", "32bit,8bit"]) == 0
    printed = capsys.readouterr().out
    rows = memory.estimates(P, replicas=[1, 2, 8], stage=[0, 1], states=["32bit", "8bit"])
    assert printed == memory.table(rows) + "\n"
    assert main(["memory", "--params", "1.3B", "--optimizer", "adam,sgd", "--flat-buffers", "off,on",
                 "--accumulation", "1,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8 and rows[-1]["optimizer"] == "sgd" and rows[-1]["flat_buffers"] is True
    assert rows[-1]["total"] == kmp.memory_estimate(1_300_000_000, optimizer="sgd", flat_buffers=True,
                                                    gradient_accumulation_steps=4).total


def test_kmp_memory_refuses_bad_input(capsys):
    assert main(["memory", "--params", "1M", "--stage", "2"]) == 2
    assert "stage: expected 0 or 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["memory", "--params", "1M", "--replicas", "a,2"])
    assert "expected a comma-separated list of integers; got 'a,2'" in capsys.readouterr().err


def test_kmp_memory_imports_no_tensorflow():
    code = ("import sys\nfrom kmp.cli.main import main\nmain(['memory', '--params', '7e9', '--replicas', '8'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_docs_table_is_what_kmp_computes():
    """docs/memory.md's table for 125M parameters with Adam: each cell as memory_estimate gives it."""
    text = (ROOT / "docs" / "memory.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| (1|2|8) \| (0|1) \|", line)]
    assert len(rows) == 3 * 2 * 2
    for row in rows:
        replicas, stage, states, state, per_variable, flat, status = [c.strip() for c in row.strip("|").split("|")]
        settings = dict(replicas=int(replicas), stage=int(stage), states=states.strip("`"))
        e = kmp.memory_estimate(P, **settings)
        assert (state, per_variable) == (memory._size(e.optimizer_state), memory._size(e.total)), row
        assert flat == memory._size(kmp.memory_estimate(P, flat_buffers=True, **settings).total), row
        assert status == "tested", row
