"""Gradient accumulation: a window of micro-batches makes one effective step.

    micro-step(grads, weight):                 # this replica's unscaled float32 gradients
        if micro_steps + 1 < steps:            # the window stays open
            sums += grads; weight_sum += weight; micro_steps += 1   # local: no communication
        else:                                  # the window closes
            totals = sums + grads; count = micro_steps + 1
            sums = 0; weight_sum = 0; micro_steps = 0   # cleared whatever happens next
            effective step on totals / count (or / total weight)

The effective step (the all-reduce, the overflow check, the update) is the
optimizer's; this module owns the window and its state. The sums are float32
whatever the variables' dtype, and local to each replica (aggregation
"none"), so a window costs no communication until it closes. An overflow in
any micro-batch makes the totals non-finite: the whole window is skipped.
`steps` is a variable, so `kmp.callbacks.GradientAccumulationScheduler` can
change it between epochs without retracing.

Saving: Keras saves one value per variable, replica 0's. A window left open
in a checkpoint holds each replica's own partial sums, so kmp's optimizer
saves those per replica beside (kmp.engine.replica_state: `.keras`, `.weights.h5`
and `tf.train.Checkpoint`): a resume on the same replicas continues the
window exactly.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kmp.errors import Problem, check


class Accumulation:
    """The state of one optimizer's accumulation windows (its variables, saved with it).

    Attributes, once built: `steps` (micro-batches per window), `micro_steps`
    (added to the open window), `weight_sum` (micro-batch weights of the open
    window), `sums` (one float32 gradient sum per trainable variable).
    """

    def __init__(self, steps: int):
        self.initial_steps = steps  # validated by the optimizer's arguments

    def build(self, optimizer: keras.optimizers.Optimizer, var_list) -> None:
        """Creates the state as `optimizer`'s variables, so checkpoints hold it."""
        if any(optimizer._overwrite_variable_with_gradient(v) for v in var_list):
            check([Problem(
                "gradient_accumulation_steps", "None for models with overwrite_with_gradient variables (float8)",
                self.initial_steps,
            )], "kmp.LossScaleOptimizer arguments")

        def scalar(name, dtype, value):
            return optimizer.add_variable(
                shape=(), dtype=dtype, initializer=keras.initializers.Constant(value), aggregation="none", name=name
            )

        self.steps = scalar("accumulation_steps", "int", self.initial_steps)
        self.micro_steps = scalar("micro_steps", "int", 0)
        self.weight_sum = scalar("accumulated_weight", "float32", 0.0)
        self.sums = [
            optimizer.add_variable(shape=v.shape, dtype="float32", aggregation="none", name="accumulator")
            for v in var_list
        ]

    def local_state(self) -> list:
        """The variables whose value differs between replicas: the sums and the weight sum."""
        return [*self.sums, self.weight_sum]

    def closes(self) -> tf.Tensor:
        """Whether the micro-batch being added closes the window."""
        return self.micro_steps.value + 1 >= self.steps.value

    def add(self, grads, weight=None, sums=None) -> None:
        """Adds this replica's micro-batch to the open window.

        `sums`: the variables that hold the sums, if not `self.sums` (kmp.engine.buffers's
        one flat sum, for one flat gradient)."""
        for total, g in zip(self.sums if sums is None else sums, grads):
            total.assign_add(tf.convert_to_tensor(g))
        if weight is not None:
            self.weight_sum.assign_add(weight)
        self.micro_steps.assign_add(1)

    def close(self, grads, weight=None, sums=None):
        """(totals, micro-batch count, total weight or None) of the window, which is then cleared."""
        sums = self.sums if sums is None else sums
        totals = [_read(s) + tf.convert_to_tensor(g) for s, g in zip(sums, grads)]
        count = tf.cast(self.micro_steps.value + 1, tf.float32)
        if weight is not None:
            weight = self.weight_sum.value + weight
            self.weight_sum.assign(0.0)
        for total in sums:
            total.assign(tf.zeros_like(_read(total)))
        self.micro_steps.assign(0)
        return totals, count, weight


def _read(variable):
    """A Keras variable's value, or a plain tf.Variable's (kmp.engine.buffers's buffers)."""
    return variable.value if isinstance(variable, keras.Variable) else variable.read_value()

