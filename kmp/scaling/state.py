"""The dynamic loss-scale state machine (docs/loss-scaling.md), and what can be
concluded from its states about being stuck at the floor.

Pure: no optimizer code and no TensorFlow import. `adjust` is written with a
`where(cond, a, b)` select instead of Python branches on values, so the same
function runs on Python numbers (tests, in microseconds) and on TensorFlow
tensors inside a compiled training step (`where=tf.where`).

    H = hysteresis, W = window
    on overflow:                          # any non-finite gradient anywhere
        good_steps = 0
        if hysteresis_left > 1:           # absorbed: the scale stays
            hysteresis_left -= 1
        elif scale <= min_scale and raise_at_min_scale:
            stuck                         # the caller raises LossScaleError
        else:
            scale = max(scale * backoff, min_scale)   # hysteresis not refilled
    on a clean step:
        if consecutive_hysteresis: hysteresis_left = H
        good_steps += 1
        if grows(good_steps):             # rule "every_window" or "after_window"
            if not consecutive_hysteresis: hysteresis_left = H
            scale = min(scale * growth, max_scale)

A static scale (`static_scale` set) never changes; overflowing steps are still
skipped by the optimizer, so non-finite values never reach the weights.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import math

from kmp.config.settings import LossScaleConfig
from kmp.values import float32


class LossScaleState(NamedTuple):
    scale: Any
    hysteresis_left: Any
    good_steps: Any


def _py_where(cond: Any, a: Any, b: Any) -> Any:
    return a if cond else b


def initial_state(config: LossScaleConfig) -> LossScaleState:
    scale = config.initial_scale if config.dynamic else config.static_scale
    return LossScaleState(float(scale), config.hysteresis, 0)


def grows(config: LossScaleConfig, good_steps: Any) -> Any:
    """Whether a clean step that brings the count to `good_steps` grows the scale."""
    window = config.dynamic_growth_steps
    if config.growth_rule == "every_window":
        # PyTorch, Keras 3, tf_keras, DeepSpeed <= 0.17.0.
        return good_steps % window == 0
    # DeepSpeed >= 0.17.1: the first growth comes one step after the window.
    return (good_steps > 1) & ((good_steps - 1) % window == 0)


def adjust(
    config: LossScaleConfig,
    state: LossScaleState,
    finite: Any,
    where: Callable[[Any, Any, Any], Any] = _py_where,
) -> tuple[LossScaleState, Any]:
    """The state after one step, and whether that step is stuck at the floor.

    `where` must accept Python numbers beside tensors (see
    `kmp.scaling.gradients.typed_where`). `finite` is the step's overflow verdict, already agreed by every replica
    and micro-batch. `stuck` is true when the step overflowed at the minimum
    scale with `raise_at_min_scale` on; the state then keeps its scale.
    """
    if not config.dynamic:
        return state, where(finite, False, False)
    scale, left, good = state
    hysteresis = config.hysteresis
    overflow = where(finite, False, True)
    absorbed = overflow & (left > 1)
    shrink = overflow & where(absorbed, False, True)
    at_floor = scale <= config.min_scale
    stuck = shrink & at_floor & config.raise_at_min_scale

    good = where(finite, good + 1, 0)
    grow = finite & grows(config, good)
    if config.consecutive_hysteresis:
        left = where(finite, hysteresis, left)
    else:
        left = where(grow, hysteresis, left)
    left = where(absorbed, left - 1, left)

    backed_off = scale * config.backoff_factor
    backed_off = where(backed_off < config.min_scale, config.min_scale, backed_off)
    grown = scale * config.growth_factor
    grown = where(grown > config.max_scale, config.max_scale, grown)
    scale = where(shrink, backed_off, where(grow, grown, scale))
    return LossScaleState(scale, left, good), stuck


def run(config: LossScaleConfig, flags: list[bool]) -> list[LossScaleState]:
    """The states after each step of a finite/overflow sequence (for docs and tests).

    Raises nothing: a stuck step is reported by `adjust`, and here the scale
    simply stays at the floor.
    """
    state = initial_state(config)
    states = []
    for finite in flags:
        state, _ = adjust(config, state, finite)
        states.append(state)
    return states


def floor_message(scale: float, config: LossScaleConfig) -> str:
    """The error text when gradients overflow at the minimum scale."""
    return (
        f"kmp: gradients overflowed with the loss scale already at its minimum "
        f"({scale:g} = min_scale). Training cannot make progress: every step "
        "is skipped. Remedies: train in bfloat16 (precision='mixed_bfloat16', "
        "no loss scaling needed); raise `hysteresis` or set "
        "`consecutive_hysteresis=True` to tolerate sporadic overflows; use a "
        "static scale (`static_scale=...`, DeepSpeed `fp16.loss_scale`); lower "
        "`min_scale`; or set `raise_at_min_scale=False` to keep skipping "
        "steps. Persistent overflows at scale 1 usually mean the model itself "
        "produces inf/nan (check the learning rate and the inputs)."
    )


# --- The floor, seen from outside the step -------------------------------
# Where the step cannot raise (XLA), kmp.scaling.floor compares the state
# before and after an execution of several steps instead.


class WindowState(NamedTuple):
    """The optimizer state the floor check compares, as Python numbers."""

    scale: float
    hysteresis_left: int
    good_steps: int
    overflows: int
    iterations: int  # applied steps: a skipped step does not advance it (spec)


def steps_clear_of_floor(config: LossScaleConfig, scale: float, hysteresis_left: int) -> int:
    """How many steps from this state certainly cannot be stuck at the floor.

    A stuck step needs `hysteresis_left <= 1` and `scale <= min_scale` before
    it. Each overflow uses up one hysteresis (when more than one is left) or
    backs the scale off once, and clean steps only raise both, so at least this
    many overflows come first. float32 arithmetic, as in the optimizer.

    Counting stops at `_MAX_BACKOFFS`: a smaller margin is still true (it only
    makes the monitor read the state sooner), and a backoff factor near 1
    would otherwise take a hundred million iterations here.
    """
    floor = float32(config.min_scale)
    scale = float32(scale)
    backoffs = 0
    while math.isfinite(scale) and scale > floor and backoffs < _MAX_BACKOFFS:
        scale = max(float32(scale * float32(config.backoff_factor)), floor)
        backoffs += 1
    return max(int(hysteresis_left) - 1, 0) + backoffs


_MAX_BACKOFFS = 10_000


def stuck_in_window(config: LossScaleConfig, before: WindowState, after: WindowState) -> bool:
    """Whether the steps between two states certainly overflowed at the floor.

    "Stuck" as in `adjust`: an overflow not absorbed by
    hysteresis, with the scale already at `min_scale`. False when unsure (see
    kmp.callbacks' docstring).
    """
    if not (config.dynamic and config.raise_at_min_scale):
        return False
    overflows = after.overflows - before.overflows
    clean = after.iterations - before.iterations
    at_floor = float32(before.scale) <= float32(config.min_scale) and before.hysteresis_left <= 1
    if overflows <= 0 or not at_floor:
        return False
    if after.good_steps == clean:
        # Every clean step came after the last overflow: the first step overflowed.
        return True
    return not _could_lift(config, before.good_steps, clean)


def _could_lift(config: LossScaleConfig, good_steps: int, clean: int) -> bool:
    """Whether `clean` clean steps, in any order with overflows, could raise the
    scale or refill hysteresis above 1. Clean steps before the first overflow
    count on from `good_steps`, those after an overflow from 0."""
    if config.consecutive_hysteresis and config.hysteresis > 1:
        return clean > 0
    return any(
        grows(config, good_steps + n) or grows(config, n) for n in range(1, clean + 1)
    )
