"""kmp.LossScaleOptimizer: Keras's LossScaleOptimizer, made to the spec.

What differs from `keras.optimizers.LossScaleOptimizer` (Keras 3.15) and why:

- The gradients are all-reduced once, here, before the overflow check, so
  every replica sees the same gradients and takes the same skip decision.
  Keras checks replica 0's local gradients only, so an inf on replica 1 is
  applied and reaches the weights.
- The scale follows `kmp.loss_scale` (hysteresis, a floor, a ceiling, two
  growth rules). Keras halves without a floor, so the scale reaches 0 and the
  next finite step writes -inf into the weights; it also grows without a
  ceiling, to inf.
- State (scale, hysteresis left, clean steps, overflows, skipped steps) lives
  in optimizer variables: saved in checkpoints and `.keras` files.

One step, in replica context:

    grads = all_reduce_sum(float32(grads) / scale)  # once (kmp.communication)
    finite = all(isfinite(grads))            # identical on every replica
    if finite: fused_apply(inner, grads)     # one XLA update per replica (kmp.fused)
    state = loss_scale.adjust(state, finite) # raises at the floor if asked

With `fused=False` and a scale that never reaches the floor, the scale and
the weights follow exactly the trajectory of Keras's class; fused, the weights
agree to about one ulp per step (XLA's FMA contraction, see kmp.fused).
"""

from __future__ import annotations

import dataclasses
import sys

import keras
import tensorflow as tf
from keras import ops
from keras.src.utils import tracking
from tensorflow.python.ops import control_flow_util

from kmp import loss_scale
from kmp.communication import Communication, all_reduce_sum
from kmp.config import LossScaleConfig
from kmp.errors import LossScaleError, Problem, check
from kmp.fused import fused_apply, fused_step

_STATE_FIELDS = ("hysteresis_left", "good_steps", "overflows", "skipped_steps")


def typed_where(cond, a, b):
    """`tf.where` that gives Python numbers the dtype of the tensor beside them."""
    ref = next((x for x in (a, b) if tf.is_tensor(x)), None)
    if ref is not None:
        a, b = (tf.cast(x, ref.dtype) for x in (a, b))
    return tf.where(cond, a, b)


def all_finite(grads) -> tf.Tensor:
    """True iff no gradient holds an inf or a nan (sparse ones included)."""
    flags = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads
        if g is not None
    ]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def unscale(grad, scale):
    """`grad / scale`, computed in float32 (the spec's master precision)."""
    if grad is None:
        return None
    scale = tf.cast(scale, tf.float32)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, tf.float32) / scale, grad.indices, grad.dense_shape)
    return tf.cast(grad, tf.float32) / scale


def _in_xla() -> bool:
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _hand_over_reduction(inner: keras.optimizers.Optimizer) -> None:
    """The inner optimizer receives gradients this class already all-reduced.

    Keras's TensorFlow optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients` before its update; doing it again would
    multiply them by the number of replicas. Only this instance, which the
    LossScaleOptimizer owns, is changed (tests/test_keras_seams.py guards the
    name).
    """
    inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


@keras.saving.register_keras_serializable(package="kmp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling with DeepSpeed's controls; a drop-in for Keras's class.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        initial_scale: the scale at step 0.
        dynamic_growth_steps: the window W: clean steps before the scale grows.
        hysteresis: overflows tolerated before the scale shrinks (H).
        consecutive_hysteresis: refill H on every clean step, not only at growth.
        min_scale, max_scale: the floor and the ceiling of the scale.
        raise_at_min_scale: raise `kmp.LossScaleError` on an overflow at the floor.
        growth_rule: "every_window" (Keras, PyTorch) or "after_window"
            (DeepSpeed >= 0.17.1).
        static_scale: a fixed scale instead of a dynamic one; overflowing
            steps are still skipped.
        growth_factor, backoff_factor: 2 and 0.5 by default.
        log_overflows: print one line per overflow (not on clean steps).
            Lines are not printed inside XLA-compiled steps.
        gradient_accumulation_steps: micro-batches per optimizer step (None: 1).
        fused: update through `kmp.fused` (one XLA computation per replica)
            for SGD, Adam and AdamW; other optimizers fall back to Keras's
            update with a one-line note. False: always Keras's update.
        communication: a `kmp.communication.Communication` (all-reduce dtype,
            bucket size, pre-divide factor), or a dict of its fields.
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        hysteresis=1,
        consecutive_hysteresis=False,
        min_scale=1.0,
        max_scale=2.0**24,
        raise_at_min_scale=True,
        growth_rule="every_window",
        static_scale=None,
        growth_factor=2.0,
        backoff_factor=0.5,
        log_overflows=True,
        gradient_accumulation_steps=None,
        fused=True,
        communication=None,
        name=None,
        **kwargs,
    ):
        problems = _inner_problems(inner_optimizer)
        if not isinstance(fused, bool):
            problems.append(Problem("fused", "true or false", fused))
        communication, more = _communication(communication)
        problems += more
        if not isinstance(log_overflows, bool):
            problems.append(Problem("log_overflows", "true or false", log_overflows))
        if gradient_accumulation_steps is not None and (
            not isinstance(gradient_accumulation_steps, int) or isinstance(gradient_accumulation_steps, bool)
            or gradient_accumulation_steps < 1
        ):
            problems.append(Problem("gradient_accumulation_steps", "None or an integer >= 1", gradient_accumulation_steps))
        config = LossScaleConfig(
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            raise_at_min_scale=raise_at_min_scale,
            growth_rule=growth_rule,
            static_scale=static_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
        )
        check(problems + config.problems(), "kmp.LossScaleOptimizer arguments")
        # Keras's constructor rejects the same arguments as before (dynamic=False,
        # clipnorm on the wrapper, ...): kmp stays a drop-in.
        super().__init__(
            inner_optimizer,
            initial_scale=loss_scale.initial_state(config).scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self.loss_scale_config = config
        self.log_overflows = log_overflows
        # Not Keras's `gradient_accumulation_steps` attribute, which the base
        # class reads to accumulate by itself (and must stay None).
        self._accumulation = gradient_accumulation_steps
        self.fused = fused
        self.communication = communication
        _hand_over_reduction(self.inner_optimizer)

    @classmethod
    def from_loss_scale_config(cls, inner_optimizer, config: LossScaleConfig, **kwargs):
        fields = dataclasses.asdict(config)
        return cls(inner_optimizer, **fields, **kwargs)

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        super().build(var_list)
        state = loss_scale.initial_state(self.loss_scale_config)
        initial = {"hysteresis_left": state.hysteresis_left, "good_steps": 0, "overflows": 0, "skipped_steps": 0}
        for field in _STATE_FIELDS:
            variable = self.add_variable(
                shape=(),
                dtype="int",
                initializer=keras.initializers.Constant(initial[field]),
                aggregation="none",
                name=field,
            )
            setattr(self, field, variable)
        if self._accumulation is not None:
            self._build_accumulation(var_list)

    def _build_accumulation(self, var_list):
        if any(self._overwrite_variable_with_gradient(v) for v in var_list):
            check([Problem(
                "gradient_accumulation_steps", "None for models with overwrite_with_gradient variables (float8)",
                self._accumulation,
            )], "kmp.LossScaleOptimizer arguments")
        make = lambda name, dtype, value: self.add_variable(
            shape=(), dtype=dtype, initializer=keras.initializers.Constant(value), aggregation="none", name=name
        )
        self.accumulation_steps = make("accumulation_steps", "int", self._accumulation)
        self.micro_steps = make("micro_steps", "int", 0)
        self.accumulated_weight = make("accumulated_weight", "float32", 0.0)
        # float32 whatever the variable's dtype; local to each replica.
        self._accumulators = [
            self.add_variable(shape=v.shape, dtype="float32", aggregation="none", name="accumulator")
            for v in var_list
        ]

    def apply(self, grads, trainable_variables=None, *, micro_batch_weight=None):
        """One (micro-)step. `micro_batch_weight` (e.g. a token count) makes
        the gradient the weighted mean: sum(grads) / sum(weights) over the
        micro-batches of the window and every replica; the loss whose
        gradients are passed is then a sum over the micro-batch, not a mean.
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        scale = self.dynamic_scale.value
        # Every micro-batch of a window is scaled by the same scale: it only
        # changes when a window closes.
        grads = [g if self._overwrite_variable_with_gradient(v) else unscale(g, scale) for g, v in zip(grads, variables)]
        weight = None if micro_batch_weight is None else tf.cast(micro_batch_weight, tf.float32)
        if self._accumulation is None:
            self._effective_step(grads, trainable_variables, None, weight)
        elif tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._micro_step(grads, trainable_variables, weight)
        else:
            tf.distribute.get_replica_context().merge_call(
                self._merged_micro_step, args=(grads, trainable_variables, weight)
            )

    def _effective_step(self, grads, trainable_variables, count, weight):
        """All-reduce once, check, apply if finite, move the scale (replica context)."""
        if weight is None:
            grads = self._all_reduce(grads)
            if count is not None:
                grads = [g / count for g in grads]
        elif self.communication.dtype == "float16":
            # A token count times the loss scale would overflow float16.
            grads = self._all_reduce(grads)
            (total,) = all_reduce_sum([weight])
            grads = [g / total for g in grads]
        else:
            *grads, total = self._all_reduce(grads + [weight])
            grads = [g / total for g in grads]
        finite = all_finite(grads)
        step, _ = fused_step(self.inner_optimizer, grads, trainable_variables) if self.fused else (None, None)
        if step is not None:
            # The fused update and the state variables (aggregation "none":
            # each replica writes its own copy) need no cross-replica context,
            # and every replica takes the same branch from the same gradients.
            ops.cond(finite, lambda: step(grads), lambda: None)
            self._adjust(finite)
        elif tf.__internal__.distribute.strategy_supports_no_merge_call():
            ops.cond(finite, lambda: self._apply_inner(grads, trainable_variables), lambda: None)
            self._adjust(finite)
        else:
            # A cond whose branch calls merge_call (as the inner update does)
            # must be built in cross-replica context under MirroredStrategy.
            tf.distribute.get_replica_context().merge_call(
                self._merged_apply, args=(grads, trainable_variables, finite)
            )

    def _merged_apply(self, strategy, grads, trainable_variables, finite):
        # Every replica computed `finite` from the same reduced gradients.
        finite = strategy.experimental_local_results(finite)[0]

        def apply_on_replicas():
            strategy.extended.call_for_each_replica(self._apply_inner, args=(grads, trainable_variables))

        ops.cond(finite, apply_on_replicas, lambda: None)
        self._adjust(finite)

    def _all_reduce(self, grads):
        return all_reduce_sum(grads, self.communication, self.dynamic_scale.value)

    def _apply_inner(self, grads, trainable_variables):
        """The inner optimizer's update of already all-reduced, unscaled gradients."""
        if self.fused:
            fused_apply(self.inner_optimizer, grads, trainable_variables)
        else:
            self.inner_optimizer.apply(grads, trainable_variables)

    # Gradient accumulation: a window of micro-steps, one effective step.

    def _window_closes(self):
        return self.micro_steps.value + 1 >= self.accumulation_steps.value

    def _micro_step(self, grads, trainable_variables, weight):
        ops.cond(
            self._window_closes(),
            lambda: self._close_window(grads, trainable_variables, weight),
            lambda: self._accumulate(grads, weight),
        )

    def _merged_micro_step(self, strategy, grads, trainable_variables, weight):
        # The window is the same on every replica; the collective inside the
        # closing branch is built in cross-replica context (Keras's own
        # accumulation builds it in a replica-context cond and crashes).
        run = strategy.extended.call_for_each_replica
        ops.cond(
            self._window_closes(),
            lambda: run(self._close_window, args=(grads, trainable_variables, weight)),
            lambda: run(self._accumulate, args=(grads, weight)),
        )

    def _accumulate(self, grads, weight):
        """Adds this replica's micro-batch locally: no communication."""
        for accumulator, g in zip(self._accumulators, grads):
            accumulator.assign_add(tf.convert_to_tensor(g))
        if weight is not None:
            self.accumulated_weight.assign_add(weight)
        self.micro_steps.assign_add(1)

    def _close_window(self, grads, trainable_variables, weight):
        totals = [a.value + tf.convert_to_tensor(g) for a, g in zip(self._accumulators, grads)]
        count = tf.cast(self.micro_steps.value + 1, tf.float32)
        if weight is not None:
            weight = self.accumulated_weight.value + weight
            self.accumulated_weight.assign(0.0)
        # Cleared whether or not the step is applied: an overflow in any
        # micro-batch skips the whole window.
        for accumulator in self._accumulators:
            accumulator.assign(tf.zeros_like(accumulator.value))
        self.micro_steps.assign(0)
        self._effective_step(totals, trainable_variables, count, weight)

    def _adjust(self, finite):
        """Moves the loss-scale state one step (see kmp.loss_scale.adjust)."""
        config = self.loss_scale_config
        old = loss_scale.LossScaleState(
            self.dynamic_scale.value, self.hysteresis_left.value, self.good_steps.value
        )
        new, stuck = loss_scale.adjust(config, old, finite, where=typed_where)
        self._raise_if_stuck(stuck, old.scale)
        if self.log_overflows:
            self._log_overflow(finite, old, new)
        grew = finite & loss_scale.grows(config, new.good_steps) if config.dynamic else finite & False
        skipped = tf.cast(tf.logical_not(finite), self.overflows.dtype)
        # Keras's step_counter: clean steps since the last growth or overflow.
        self.step_counter.assign(typed_where(finite & ~grew, self.step_counter.value + 1, 0))
        self.dynamic_scale.assign(new.scale)
        self.hysteresis_left.assign(new.hysteresis_left)
        self.good_steps.assign(new.good_steps)
        self.overflows.assign_add(skipped)
        self.skipped_steps.assign_add(skipped)

    def _raise_if_stuck(self, stuck, scale):
        if not self.loss_scale_config.raise_at_min_scale or not self.loss_scale_config.dynamic:
            return
        if tf.executing_eagerly():
            if bool(stuck):
                raise LossScaleError(loss_scale.floor_message(float(scale), self.loss_scale_config))
        elif not _in_xla():
            # XLA compiles asserts away; see docs/loss-scaling.md for that case.
            message = loss_scale.floor_message(self.loss_scale_config.min_scale, self.loss_scale_config)
            tf.debugging.Assert(tf.logical_not(stuck), [message])

    def _log_overflow(self, finite, old, new):
        if _in_xla():
            return  # tf.print does not compile under XLA

        def line(*parts):
            def emit():
                tf.print("kmp: gradient overflow, step skipped.", *parts, output_stream=sys.stderr)
            return emit

        if not self.loss_scale_config.dynamic:
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

    def get_config(self):
        config = super().get_config()
        config.update(dataclasses.asdict(self.loss_scale_config))
        config["log_overflows"] = self.log_overflows
        config["gradient_accumulation_steps"] = self._accumulation
        config["fused"] = self.fused
        config["communication"] = dataclasses.asdict(self.communication)
        return config


def _communication(value) -> tuple[Communication, list[Problem]]:
    if value is None:
        return Communication(), []
    if isinstance(value, Communication):
        return value, value.problems("communication.")
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(Communication)}
        unknown = [Problem(f"communication.{k}", f"one of {', '.join(sorted(fields))}", k) for k in value if k not in fields]
        if unknown:
            return Communication(), unknown
        made = Communication(**value)
        return made, made.problems("communication.")
    return Communication(), [Problem("communication", "None, a dict or a kmp.communication.Communication", value)]


def _inner_problems(inner) -> list[Problem]:
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        return [Problem(
            "inner_optimizer", "a plain Keras optimizer", type(inner).__name__,
            "It is already a LossScaleOptimizer: pass its `inner_optimizer` instead.",
        )]
    if not isinstance(inner, keras.optimizers.Optimizer):
        return [Problem(
            "inner_optimizer", "a keras.optimizers.Optimizer instance", inner,
            "Create one first, e.g. keras.optimizers.AdamW(1e-3), or use kmp.wrap('adamw').",
        )]
    if inner.gradient_accumulation_steps:
        return [Problem(
            "inner_optimizer.gradient_accumulation_steps", "None", inner.gradient_accumulation_steps,
            "Pass gradient_accumulation_steps to kmp.LossScaleOptimizer (or kmp.wrap) instead: "
            "Keras's own accumulation fails under tf.distribute and checks overflows per micro-batch.",
        )]
    return []
