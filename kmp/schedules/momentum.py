"""Momentum that follows a schedule, for DeepSpeed's OneCycle `cycle_momentum`.

DeepSpeed's OneCycle sets `param_group["betas"] = (momentum, 0.99)` before
each step, for optimizers that have betas; for others (SGD, Adagrad) it
disables momentum cycling with a warning (kmp.wrap says the same).
Keras's optimizers read `beta_1` as a constant (a callable fails in Keras
3.15), so kmp builds a subclass per class whose update reads the value of
the step being applied:

    beta_1 = momentum_schedule(iterations)    # a float32 tensor, this update's value
    Keras's update_step(gradient, variable, learning_rate)

and whose beta_2 is 0.99, as OneCycle sets it. `iterations` counts applied
updates, as the learning-rate schedule's step does, so a skipped (overflow)
step advances neither, as DeepSpeed's engine does not step its scheduler
then. kmp.engine.fused leaves subclasses to Keras's update (exact types only). The
classes are module attributes: a saved model loads them by name.
"""

from __future__ import annotations

import keras
from keras import ops

from kmp.schedules.formulas import ONE_CYCLE_BETA_2


def _cycled(base: type) -> type:
    class Cycled(base):
        def __init__(self, *args, momentum_schedule=None, **kwargs):
            super().__init__(*args, **kwargs)
            if isinstance(momentum_schedule, dict):
                momentum_schedule = keras.optimizers.schedules.deserialize(momentum_schedule)
            if momentum_schedule is None:
                raise ValueError(f"{type(self).__name__} needs a momentum_schedule. Received: momentum_schedule=None.")
            self.momentum_schedule = momentum_schedule

        def update_step(self, gradient, variable, learning_rate):
            fixed = self.beta_1
            self.beta_1 = ops.cast(self.momentum_schedule(self.iterations), variable.dtype)
            try:
                return super().update_step(gradient, variable, learning_rate)
            finally:
                self.beta_1 = fixed

        def get_config(self):
            config = super().get_config()
            config["momentum_schedule"] = keras.optimizers.schedules.serialize(self.momentum_schedule)
            return config

    Cycled.__name__ = Cycled.__qualname__ = f"MomentumCycled{base.__name__}"
    Cycled.__module__ = __name__
    return keras.saving.register_keras_serializable(package="kmp")(Cycled)


MomentumCycledAdam = _cycled(keras.optimizers.Adam)
MomentumCycledAdamW = _cycled(keras.optimizers.AdamW)
MomentumCycledLamb = _cycled(keras.optimizers.Lamb)
MomentumCycledLion = _cycled(keras.optimizers.Lion)
CYCLED = {"Adam": MomentumCycledAdam, "AdamW": MomentumCycledAdamW, "Lamb": MomentumCycledLamb,
          "Lion": MomentumCycledLion}


def with_momentum_schedule(optimizer: keras.optimizers.Optimizer, schedule) -> keras.optimizers.Optimizer | None:
    """A copy of `optimizer` whose beta_1 follows `schedule` and beta_2 is 0.99; None if it has no betas."""
    cls = CYCLED.get(type(optimizer).__name__)
    if cls is None or type(optimizer) is not getattr(keras.optimizers, type(optimizer).__name__):
        return None
    config = {**optimizer.get_config(), "beta_2": ONE_CYCLE_BETA_2}
    return cls.from_config({**config, "momentum_schedule": keras.optimizers.schedules.serialize(schedule)})
