"""Momentum that follows a schedule, for DeepSpeed's OneCycle `cycle_momentum`.

DeepSpeed's OneCycle sets `param_group["betas"][0]` (Adam family) or
`param_group["momentum"]` (SGD) before each step. Keras's optimizers read
`beta_1` / `momentum` as constants, so kmp builds a subclass per class whose
update reads the value of the step being applied:

    beta_1 = momentum_schedule(iterations)    # a float32 tensor, this update's value
    Keras's update_step(gradient, variable, learning_rate)

`iterations` counts applied updates, as the learning-rate schedule's step
does, so a skipped (overflow) step advances neither, as DeepSpeed's engine
does not step its scheduler then. Keras's SGD decides on momentum with a
Python `if`, so its update is written here op for op with the scheduled
value. The classes are module attributes: a saved model loads them by name.
"""

from __future__ import annotations

import keras
from keras import ops

# Keras class -> the attribute DeepSpeed's momentum cycling drives.
ATTRIBUTES = {"Adam": "beta_1", "AdamW": "beta_1", "Lamb": "beta_1", "Lion": "beta_1", "SGD": "momentum"}


def _cycled(base: type) -> type:
    attribute = ATTRIBUTES[base.__name__]

    class Cycled(base):
        def __init__(self, *args, momentum_schedule=None, **kwargs):
            super().__init__(*args, **kwargs)
            if isinstance(momentum_schedule, dict):
                momentum_schedule = keras.optimizers.schedules.deserialize(momentum_schedule)
            if momentum_schedule is None:
                raise ValueError(f"{type(self).__name__} needs a momentum_schedule. Received: momentum_schedule=None.")
            self.momentum_schedule = momentum_schedule

        def update_step(self, gradient, variable, learning_rate):
            value = ops.cast(self.momentum_schedule(self.iterations), variable.dtype)
            if base is keras.optimizers.SGD:
                return _sgd_step(self, gradient, variable, learning_rate, value)
            fixed = getattr(self, attribute)
            setattr(self, attribute, value)
            try:
                return super().update_step(gradient, variable, learning_rate)
            finally:
                setattr(self, attribute, fixed)

        def get_config(self):
            config = super().get_config()
            config["momentum_schedule"] = keras.optimizers.schedules.serialize(self.momentum_schedule)
            return config

    Cycled.__name__ = Cycled.__qualname__ = f"MomentumCycled{base.__name__}"
    Cycled.__module__ = __name__
    return keras.saving.register_keras_serializable(package="kmp")(Cycled)


def _sgd_step(optimizer, gradient, variable, learning_rate, momentum):
    """keras.optimizers.SGD.update_step with momentum != 0, momentum a tensor."""
    learning_rate = ops.cast(learning_rate, variable.dtype)
    gradient = ops.cast(gradient, variable.dtype)
    m = optimizer.momentums[optimizer._get_variable_index(variable)]
    optimizer.assign(m, ops.subtract(ops.multiply(m, momentum), ops.multiply(gradient, learning_rate)))
    if optimizer.nesterov:
        optimizer.assign_add(variable, ops.subtract(ops.multiply(m, momentum), ops.multiply(gradient, learning_rate)))
    else:
        optimizer.assign_add(variable, m)


MomentumCycledAdam = _cycled(keras.optimizers.Adam)
MomentumCycledAdamW = _cycled(keras.optimizers.AdamW)
MomentumCycledLamb = _cycled(keras.optimizers.Lamb)
MomentumCycledLion = _cycled(keras.optimizers.Lion)
MomentumCycledSGD = _cycled(keras.optimizers.SGD)
CYCLED = {"Adam": MomentumCycledAdam, "AdamW": MomentumCycledAdamW, "Lamb": MomentumCycledLamb,
          "Lion": MomentumCycledLion, "SGD": MomentumCycledSGD}


def with_momentum_schedule(optimizer: keras.optimizers.Optimizer, schedule) -> keras.optimizers.Optimizer | None:
    """A copy of the (unbuilt) `optimizer` whose beta_1 / momentum follows `schedule`; None if it has neither.

    SGD must have momentum != 0 when built (Keras creates its momentum slots
    only then): OneCycle's momenta are, so the copy starts at the schedule's
    first value.
    """
    cls = CYCLED.get(type(optimizer).__name__)
    if cls is None or type(optimizer) is not getattr(keras.optimizers, type(optimizer).__name__):
        return None
    config = optimizer.get_config()
    if cls is MomentumCycledSGD:
        config["momentum"] = float(keras.ops.convert_to_numpy(schedule(0)))
    return cls.from_config({**config, "momentum_schedule": keras.optimizers.schedules.serialize(schedule)})
