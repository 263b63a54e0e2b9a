"""What an overflow tells the user: one log line, and the floor error.

    on an overflow step (inside the training step, as TensorFlow ops):
        log:   "gradient overflow, step skipped." + what the scale did
               (hysteresis absorbed it / reduced from -> to / stays at the floor)
        stuck at the floor with raise_at_min_scale: kmp.LossScaleError (eager),
               or an assert carrying the same message (graph)

Nothing is printed on clean steps. Inside XLA neither prints nor asserts
compile; there `kmp.callbacks.LossScaleMonitor` raises after the step.
"""

from __future__ import annotations

import sys

import tensorflow as tf

from kmp import loss_scale, seams
from kmp.config import LossScaleConfig
from kmp.errors import LossScaleError


def in_xla() -> bool:
    return seams.get("in_xla_context")(tf.compat.v1.get_default_graph())


def raise_if_stuck(config: LossScaleConfig, stuck, scale) -> None:
    """Raise kmp.LossScaleError when the step overflowed at the floor (see loss_scale.adjust)."""
    if not config.raise_at_min_scale or not config.dynamic:
        return
    if tf.executing_eagerly():
        if bool(stuck):
            raise LossScaleError(loss_scale.floor_message(float(scale), config))
    elif not in_xla():
        tf.debugging.Assert(tf.logical_not(stuck), [loss_scale.floor_message(config.min_scale, config)])


def log_overflow(config: LossScaleConfig, finite, old: loss_scale.LossScaleState, new: loss_scale.LossScaleState):
    """One line on stderr when the step overflowed (not inside XLA: tf.print does not compile)."""
    if in_xla():
        return

    def line(*parts):
        def emit():
            tf.print("kmp: gradient overflow, step skipped.", *parts, output_stream=sys.stderr)
        return emit

    if not config.dynamic:
        report = line("Static loss scale", old.scale)
    else:
        def report():
            tf.cond(
                old.hysteresis_left > 1,
                line("Loss scale stays", old.scale, "(hysteresis absorbed it;", new.hysteresis_left, "left)"),
                lambda: tf.cond(
                    new.scale < old.scale,
                    line("Attempted loss scale:", old.scale, ", reducing to", new.scale),
                    line("Loss scale stays at its minimum", old.scale),
                ),
            )
    tf.cond(finite, lambda: None, report)
