"""The dynamic loss-scale state machine of ../shared/spec/loss-scaling.md.

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

from kmp.config import LossScaleConfig


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
    `kmp.optimizer.typed_where`). `finite` is the step's overflow verdict, already agreed by every replica
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
