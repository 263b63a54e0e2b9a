"""The pure loss-scale state machine against golden sequences.

Each case lists the flags (C = clean, O = overflow) and the expected
(scale, hysteresis_left, good_steps) after every step, worked out by hand
from ../shared/spec/loss-scaling.md.
"""

import dataclasses
import inspect
import random

import numpy as np
import pytest
import tensorflow as tf

from kmp.config.settings import LossScaleConfig
from kmp.scaling.gradients import typed_where
from kmp.scaling.optimizer import LossScaleOptimizer
from kmp.scaling.state import adjust, floor_message, initial_state, run

C, O = True, False

GOLDEN = {
    # The spec's own examples.
    "spec_every_window": (
        dict(initial_scale=256, dynamic_growth_steps=2),
        [O, O, C, C, C, O],
        [(128, 1, 0), (64, 1, 0), (64, 1, 1), (128, 1, 2), (128, 1, 3), (64, 1, 0)],
    ),
    "spec_after_window": (
        dict(initial_scale=256, dynamic_growth_steps=2, growth_rule="after_window"),
        [O, O, C, C, C, O],
        [(128, 1, 0), (64, 1, 0), (64, 1, 1), (64, 1, 2), (128, 1, 3), (64, 1, 0)],
    ),
    "spec_hysteresis": (
        dict(initial_scale=65536, dynamic_growth_steps=2, hysteresis=2),
        [O, C, C, C, O, O],
        [(65536, 1, 0), (65536, 1, 1), (131072, 2, 2), (131072, 2, 3), (131072, 1, 0), (65536, 1, 0)],
    ),
    # Growth is not reset by a growth: good_steps keeps counting; ceiling holds.
    "every_window_to_ceiling": (
        dict(initial_scale=8, dynamic_growth_steps=3, max_scale=32),
        [C, C, C, C, C, C, O, C, C, C, C, C, C],
        [(8, 1, 1), (8, 1, 2), (16, 1, 3), (16, 1, 4), (16, 1, 5), (32, 1, 6), (16, 1, 0),
         (16, 1, 1), (16, 1, 2), (32, 1, 3), (32, 1, 4), (32, 1, 5), (32, 1, 6)],
    ),
    "after_window_first_growth_late": (
        dict(initial_scale=8, dynamic_growth_steps=3, growth_rule="after_window"),
        [C, C, C, C, C, C, C],
        [(8, 1, 1), (8, 1, 2), (8, 1, 3), (16, 1, 4), (16, 1, 5), (16, 1, 6), (32, 1, 7)],
    ),
    # Not consecutive: an unabsorbed overflow does not refill; only growth does.
    "hysteresis_refilled_at_growth_only": (
        dict(initial_scale=64, dynamic_growth_steps=2, hysteresis=3),
        [O, O, C, O, C, C, O],
        [(64, 2, 0), (64, 1, 0), (64, 1, 1), (32, 1, 0), (32, 1, 1), (64, 3, 2), (64, 2, 0)],
    ),
    # Consecutive: every clean step refills.
    "consecutive_hysteresis": (
        dict(initial_scale=64, dynamic_growth_steps=2, hysteresis=3, consecutive_hysteresis=True),
        [O, O, C, O, O, O, C, C],
        [(64, 2, 0), (64, 1, 0), (64, 3, 1), (64, 2, 0), (64, 1, 0), (32, 1, 0), (32, 3, 1), (64, 3, 2)],
    ),
    # The floor clamps a backoff that would cross it.
    "floor_clamps": (
        dict(initial_scale=3, min_scale=1, raise_at_min_scale=False),
        [O, O, O, C],
        [(1.5, 1, 0), (1, 1, 0), (1, 1, 0), (1, 1, 1)],
    ),
    "custom_factors": (
        dict(initial_scale=64, dynamic_growth_steps=1, growth_factor=4, backoff_factor=0.25, max_scale=512),
        [O, C, C, C],
        [(16, 1, 0), (64, 1, 1), (256, 1, 2), (512, 1, 3)],
    ),
    "static_never_moves": (
        dict(static_scale=128, dynamic_growth_steps=1),
        [O, C, C, O],
        [(128, 1, 0)] * 4,
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_sequence(name):
    settings, flags, expected = GOLDEN[name]
    config = LossScaleConfig(**settings)
    got = [(s.scale, s.hysteresis_left, s.good_steps) for s in run(config, flags)]
    assert got == expected


def test_spec_raise_example():
    config = LossScaleConfig(initial_scale=16, dynamic_growth_steps=2, min_scale=1)
    state, scales, stuck_flags = initial_state(config), [], []
    for _ in range(5):
        state, stuck = adjust(config, state, O)
        scales.append(state.scale)
        stuck_flags.append(stuck)
    assert scales == [8, 4, 2, 1, 1]
    assert stuck_flags == [False, False, False, False, True]


def test_hysteresis_absorbs_at_the_floor_before_raising():
    config = LossScaleConfig(initial_scale=1, min_scale=1, hysteresis=2)
    state = initial_state(config)
    state, stuck = adjust(config, state, O)
    assert (state.scale, state.hysteresis_left, stuck) == (1, 1, False)
    state, stuck = adjust(config, state, O)
    assert stuck


def test_no_raise_when_disabled():
    config = LossScaleConfig(initial_scale=1, min_scale=1, raise_at_min_scale=False)
    state, stuck = adjust(config, initial_state(config), O)
    assert not stuck and state.scale == 1


@pytest.mark.parametrize("rule", ["every_window", "after_window"])
def test_random_sequences_stay_within_bounds(rule):
    rng = random.Random(1234)
    config = LossScaleConfig(
        initial_scale=2.0**10, dynamic_growth_steps=3, hysteresis=2, min_scale=0.5,
        max_scale=2.0**12, raise_at_min_scale=False, growth_rule=rule,
    )
    flags = [rng.random() < 0.7 for _ in range(2000)]
    states = run(config, flags)
    assert all(0.5 <= s.scale <= 2.0**12 for s in states)
    assert all(1 <= s.hysteresis_left <= 2 for s in states)
    # Every overflow resets the clean-step count.
    assert all(s.good_steps == 0 for s, f in zip(states, flags) if not f)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("rule", ["every_window", "after_window"])
def test_tensorflow_xla_path_equals_python_path(rule, consecutive):
    """The optimizer runs `adjust` on tensors under XLA; it must match exactly."""
    config = LossScaleConfig(
        initial_scale=2.0**6, dynamic_growth_steps=2, hysteresis=3, min_scale=1.0,
        max_scale=2.0**8, raise_at_min_scale=False, growth_rule=rule,
        consecutive_hysteresis=consecutive,
    )
    rng = random.Random(7)
    flags = [rng.random() < 0.6 for _ in range(60)]

    @tf.function(jit_compile=True)
    def step(scale, left, good, finite):
        state, stuck = adjust(config, (scale, left, good), finite, where=typed_where)
        return (*state, stuck)

    state = initial_state(config)
    scale = tf.constant(state.scale, tf.float32)
    left = tf.constant(state.hysteresis_left, tf.int64)
    good = tf.constant(0, tf.int64)
    expected = run(config, flags)
    for finite, want in zip(flags, expected):
        scale, left, good, _ = step(scale, left, good, tf.constant(finite))
        assert (float(scale), int(left), int(good)) == (want.scale, want.hysteresis_left, want.good_steps)


def test_floor_message_names_the_scale_and_the_remedies():
    message = floor_message(1.0, LossScaleConfig())
    for needle in ("1 = min_scale", "bfloat16", "hysteresis", "consecutive_hysteresis", "static_scale",
                   "raise_at_min_scale=False"):
        assert needle in message


def test_typed_where_keeps_the_tensor_dtype():
    out = typed_where(tf.constant(True), 3, tf.constant(np.int64(5)))
    assert out.dtype == tf.int64 and int(out) == 3


def test_optimizer_keyword_defaults_are_the_configs():
    """LossScaleOptimizer's loss-scale keywords default to LossScaleConfig's fields, every one of them."""
    parameters = inspect.signature(LossScaleOptimizer.__init__).parameters
    fields = {f.name: f.default for f in dataclasses.fields(LossScaleConfig)}
    assert fields.keys() <= parameters.keys()
    assert {name: parameters[name].default for name in fields} == fields
