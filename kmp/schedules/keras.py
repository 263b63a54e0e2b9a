"""DeepSpeed's schedulers as Keras schedules: `build_schedule(block, base_lr=...)`.

    lr, momentum = build_schedule(config["scheduler"], base_lr=1e-3)
    optimizer = keras.optimizers.Adam(learning_rate=lr)  # momentum: OneCycle's beta_1, or None

The optimizer calls `lr(iterations)`, and `iterations` is the number of
updates applied so far, which is the k of `kmp.schedules.formulas.Schedule.lr_at(k)`:
the same formulas (written once, in kmp.schedules.formulas) evaluated with keras.ops in
float32, like Keras's own schedules. Works with an int64 step, in tf.function,
under XLA and in a replica context.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import keras
from keras import ops

from kmp.errors import Problem, check
from kmp.schedules.formulas import Schedule, parse_scheduler


def _float32(x):
    # Python constants as float32 tensors, whatever keras.config.floatx() is.
    return ops.cast(x, "float32")


class KerasMath:
    """The formulas' namespace for float32 tensors (kmp.schedules.formulas.PythonMath's twin)."""

    pi = math.pi
    floor = staticmethod(ops.floor)
    log = staticmethod(ops.log)
    cos = staticmethod(ops.cos)
    minimum = staticmethod(lambda a, b: ops.minimum(_float32(a), _float32(b)))
    maximum = staticmethod(lambda a, b: ops.maximum(_float32(a), _float32(b)))
    mod = staticmethod(ops.mod)
    equal = staticmethod(ops.equal)

    @staticmethod
    def where(condition, if_true, if_false):
        # Both branches are computed; the one not taken may hold log(0) = -inf,
        # which where() drops (only the values matter: no gradient flows here).
        return ops.where(condition, _float32(if_true()), _float32(if_false()))

    @staticmethod
    def step(k):
        return ops.cast(k, "float32")


class _DeepSpeedSchedule(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, scheduler: Mapping[str, Any] | Schedule, base_lr=None, base_momentum=None):
        if isinstance(scheduler, Schedule):
            if base_lr is not None or base_momentum is not None:
                raise TypeError("base_lr and base_momentum are part of a Schedule already; pass them with a block.")
            self.schedule = scheduler
        else:
            self.schedule = parse_scheduler(scheduler, base_lr=base_lr, base_momentum=base_momentum)

    def get_config(self):
        return {"scheduler": self.schedule.block(), "base_lr": self.schedule.base_lr,
                "base_momentum": self.schedule.base_momentum}

    def __repr__(self):
        return f"{type(self).__name__}({self.get_config()})"


@keras.saving.register_keras_serializable(package="kmp")
class DeepSpeedLearningRate(_DeepSpeedSchedule):
    """The lr DeepSpeed's scheduler gives the update applied after `step` others.

    Args:
        scheduler: a DeepSpeed scheduler block {"type": ..., "params": {...}},
            or a `kmp.schedules.formulas.Schedule`.
        base_lr: the optimizer's own lr (see `Schedule`).
        base_momentum: the optimizer's beta_1 (see `Schedule`).
    """

    def __call__(self, step):
        with keras.name_scope("DeepSpeedLearningRate"):
            return self.schedule.lr_at(step, KerasMath)


@keras.saving.register_keras_serializable(package="kmp")
class DeepSpeedMomentum(_DeepSpeedSchedule):
    """OneCycle's momentum (Adam's beta_1) for the update applied after `step` others.

    DeepSpeed cycles the first of an optimizer's `betas` only (an SGD
    momentum stays as it is), and sets the second to 0.99
    (`kmp.schedules.formulas.ONE_CYCLE_BETA_2`) while it does.
    """

    def __init__(self, scheduler, base_lr=None, base_momentum=None):
        super().__init__(scheduler, base_lr, base_momentum)
        if not self.schedule.cycles_momentum:
            check([Problem("scheduler", "OneCycle with cycle_momentum true (the only schedule of a momentum)",
                           self.schedule.block())], "DeepSpeedMomentum arguments")

    def __call__(self, step):
        with keras.name_scope("DeepSpeedMomentum"):
            return self.schedule.momentum_at(step, KerasMath)


def build_schedule(block: Mapping[str, Any], *, base_lr: float | None,
                   base_momentum: float | None = None) -> tuple[DeepSpeedLearningRate, DeepSpeedMomentum | None]:
    """(learning-rate schedule, momentum schedule or None) for a DeepSpeed `scheduler` block.

    `base_lr` is the optimizer's lr (None if unknown: a ConfigError says when
    the block needs it); `base_momentum` its beta_1, needed only by OneCycle
    resuming at a `last_batch_iteration`. The momentum schedule is not None
    for OneCycle with cycle_momentum (DeepSpeed's default).
    """
    schedule = parse_scheduler(block, base_lr=base_lr, base_momentum=base_momentum)
    return DeepSpeedLearningRate(schedule), DeepSpeedMomentum(schedule) if schedule.cycles_momentum else None
