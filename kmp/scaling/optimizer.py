"""kmp.LossScaleOptimizer: Keras's LossScaleOptimizer, made to the loss-scaling contract.

What differs from `keras.optimizers.LossScaleOptimizer` (Keras 3.15) and why:

- The gradients are unscaled in float32 and all-reduced once, here, before
  the overflow check, so every replica sees the same gradients and takes the
  same skip decision. Keras checks replica 0's local gradients only, so an
  inf on replica 1 is applied and reaches the weights.
- The scale follows `kmp.scaling.state` (hysteresis, a floor, a ceiling, two
  growth rules). Keras halves without a floor, so the scale reaches 0 and the
  next finite step writes -inf into the weights; it also grows without a
  ceiling, to inf.
- State (scale, hysteresis left, clean steps, skipped steps) lives in
  optimizer variables: saved in checkpoints and `.keras` files.

One effective step, in replica context:

    grads = [float32(g) / scale for g in grads]        # kmp.scaling.gradients.unscale
    (accumulate: sum micro-batches locally until the window closes; kmp.scaling.accumulate)
    grads = all_reduce_sum(grads) / micro-batches      # once (kmp.distribute.communication)
    clip = min(1, gradient_clipping / global_norm(grads))     # if set
    finite = all(isfinite(grads)) and isfinite(clip)   # identical on every replica
    if finite: update(inner, grads * clip)             # kmp.engine.fused: one XLA update per replica
    state = loss_scale.adjust(state, finite)           # raises at the floor if asked

With `fused=False` and a scale that never reaches the floor, the scale and
the weights follow exactly the trajectory of Keras's class; fused, the weights
agree to about one ulp per step (XLA's FMA contraction, see kmp.engine.fused).

The inner optimizer is left as the user made it: its own all-reduce hook is
shadowed only for the duration of each update call (`_reduced_already`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from kmp import seams, values
from kmp.config.settings import LossScaleConfig, attempt, communication_of
from kmp.distribute.communication import reduce_mean
from kmp.engine import replica_state, wall_clock, zero
from kmp.engine.fused import fused_apply, fused_step
from kmp.errors import Problem, check, did_you_mean
from kmp.scaling import overflow
from kmp.scaling import replay as replay_module
from kmp.scaling import state as loss_scale
from kmp.scaling.accumulate import Accumulation
from kmp.scaling.gradients import clipped_check, finite_flags, typed_where, unscale

logger = logging.getLogger(__name__)

# What a forward overflow does (kmp.engine.forward_overflow says each).
FORWARD_OVERFLOW = ("raise", "float32", "backoff")
_STATE_FIELDS = ("hysteresis_left", "good_steps", "skipped_steps", "overflow_variable")
# The loss-scale keywords' defaults: LossScaleConfig's, written once there.
_DEFAULTS = LossScaleConfig()


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
        overflow: what an overflowing step does: "skip" it (Keras, DeepSpeed),
            or "replay" it: its batch's forward/backward again at the lowered
            scale, inside the step, until finite (at most
            kmp.scaling.replay.MAX_REPLAYS times, not below min_scale), then
            one update. Needs kmp.prepare(model), whose step can recompute.
        loss_scale: all of the above as one `kmp.LossScaleConfig` (what
            `kmp.wrap` passes); then leave the arguments above at their defaults.
        log_overflows: print one line per overflow (not on clean steps).
            Lines are not printed inside XLA-compiled steps.
        forward_overflow: what a forward overflow does, an overflow no loss
            scale can fix (a layer's output not finite; kmp.engine.forward_overflow):
            "raise" kmp.LossScaleError naming the layer and the fix, at once;
            "float32" computes that layer in float32 and trains on; "backoff"
            treats it as any overflow (the scale backs off, as Keras and DeepSpeed do).
        gradient_accumulation_steps: micro-batches per optimizer step (None: 1).
        gradient_clipping: clip the all-reduced, unscaled gradient to this
            global norm (DeepSpeed's `gradient_clipping`); the inner optimizer
            must then not clip itself.
        fused: update through `kmp.engine.fused` (one XLA computation per replica)
            for SGD, Adam and AdamW; other optimizers fall back to Keras's
            update with a one-line note. False: always Keras's update.
        communication: a `kmp.Communication` (all-reduce dtype, bucket size,
            pre-divide factor), or a dict of its fields.
        zero_stage: 1 shards the optimizer state across the replicas
            (DeepSpeed's ZeRO stage 1, on kmp.prepare's flat buffers; see
            docs/zero.md); 0 keeps it whole on every replica. At 1 the
            inner optimizer's slot variables, then only the observable
            copy, are held once in host memory, not on every replica.
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=_DEFAULTS.initial_scale,
        dynamic_growth_steps=_DEFAULTS.dynamic_growth_steps,
        hysteresis=_DEFAULTS.hysteresis,
        consecutive_hysteresis=_DEFAULTS.consecutive_hysteresis,
        min_scale=_DEFAULTS.min_scale,
        max_scale=_DEFAULTS.max_scale,
        raise_at_min_scale=_DEFAULTS.raise_at_min_scale,
        growth_rule=_DEFAULTS.growth_rule,
        static_scale=_DEFAULTS.static_scale,
        growth_factor=_DEFAULTS.growth_factor,
        backoff_factor=_DEFAULTS.backoff_factor,
        overflow=_DEFAULTS.overflow,
        log_overflows=True,
        forward_overflow="raise",
        gradient_accumulation_steps=None,
        fused=True,
        communication=None,
        gradient_clipping=None,
        loss_scale=None,
        zero_stage=0,
        name=None,
        **kwargs,
    ):
        given = dict(
            initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps, hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale, max_scale=max_scale,
            raise_at_min_scale=raise_at_min_scale, growth_rule=growth_rule, static_scale=static_scale,
            growth_factor=growth_factor, backoff_factor=backoff_factor, overflow=overflow,
        )
        problems = _inner_problems(inner_optimizer, gradient_clipping) + _unknown_arguments(kwargs)
        config, more = _loss_scale_config(loss_scale, given)
        communication, even_more = communication_of(communication)
        problems += more + even_more
        values.boolean("fused", fused, problems)
        values.boolean("log_overflows", log_overflows, problems)
        values.choice("forward_overflow", forward_overflow, FORWARD_OVERFLOW, problems)
        if gradient_accumulation_steps is not None:
            values.int_in("gradient_accumulation_steps", gradient_accumulation_steps, 1, problems)
        if gradient_clipping is not None:
            values.positive("gradient_clipping", gradient_clipping, problems)
        values.int_in("zero_stage", zero_stage, 0, problems, high=1,
                      fix="kmp builds ZeRO stage 1 (the optimizer state sharded); stages 2 and 3 are out of scope.")
        check(problems, "kmp.LossScaleOptimizer arguments")
        # Keras's constructor rejects the same arguments as before (dynamic=False,
        # clipnorm on the wrapper, ...): kmp stays a drop-in.
        super().__init__(
            inner_optimizer,
            initial_scale=loss_scale_initial(config),
            dynamic_growth_steps=config.dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        self.loss_scale_config = config
        self.log_overflows = log_overflows
        self.forward_overflow = forward_overflow
        self.fused = fused
        self.communication = communication
        self.gradient_clipping = values.plain(gradient_clipping)
        self.zero_stage = values.plain(zero_stage)
        self._zero_noted = False
        self._sixteen_noted = False  # apply said that 16-bit weights are updated in their own dtype
        self._replay_noted = False  # apply said that a step without kmp.prepare's cannot replay
        self._floor_asserts = True  # False while tracing a call that began before kmp wrapped it (apply)
        # kmp's own accumulation. Keras's `gradient_accumulation_steps`
        # attribute stays None: Keras would otherwise accumulate by itself.
        steps = values.plain(gradient_accumulation_steps)
        self.accumulation = None if steps is None else Accumulation(steps)

    @classmethod
    def from_loss_scale_config(cls, inner_optimizer, config: LossScaleConfig, **kwargs):
        return cls(inner_optimizer, loss_scale=config, **kwargs)

    def build(self, var_list):
        self._raise_floor_errors_in_caller()
        strategy = tf.distribute.get_strategy()
        moved = [o.name for o in (self, self.inner_optimizer) if _into_the_scope(o, strategy)]
        if moved:
            logger.warning("kmp: %s made outside the strategy's scope: their step counters and learning rates are "
                           "made again in it, with their values (Keras would count each step once per replica, and "
                           "an XLA step on another device could not read them). Make optimizers inside "
                           "`with strategy.scope():`.", " and ".join(moved))
        # As Keras's build: the state variables are tracked once, by add_variable.
        with seams.get("DotNotTrackScope")():
            super().build(var_list)
            start = loss_scale.initial_state(self.loss_scale_config)
            # overflow_variable: index of the first variable whose gradient was
            # not finite at the last overflow (-1: none yet), for the logs.
            initial = {"hysteresis_left": start.hysteresis_left, "good_steps": 0, "skipped_steps": 0,
                       "overflow_variable": -1}
            # replayed_steps: steps recomputed at a lowered scale (overflow="replay" only: "skip"'s
            # checkpoints keep Keras's and DeepSpeed's variables).
            fields = _STATE_FIELDS + (("replayed_steps",) if self.replays else ())
            for field in fields:
                setattr(self, field, self.add_variable(
                    shape=(), dtype="int", initializer=keras.initializers.Constant(initial.get(field, 0)),
                    aggregation="none", name=field,
                ))
            if self.accumulation is not None:
                self.accumulation.build(self, var_list)
        if self.accumulation is not None:
            # Tracked outside Keras's no-tracking scope (tf.train.Checkpoint must
            # see it) and after the variables: a restore deferred to this build
            # gives the variables their values first and the rows last.
            self.per_replica_window = replica_state.PerReplicaWindow(
                self.accumulation.local_state, self.accumulation.micro_steps)

    def __bool__(self) -> bool:
        # Keras's compile() of a mixed_float16 model asks `self.optimizer and ...` (whether to wrap it in
        # Keras's own LossScaleOptimizer). On one device that is the only call from the model before its
        # first train function call traces the step: the floor's error is converted from that call on.
        if "loss_scale_config" in vars(self):  # not while __init__ runs
            self._raise_floor_errors_in_caller()
        return True

    def _raise_floor_errors_in_caller(self) -> bool:
        """In the model that compiles (with mixed_float16), builds or traces this optimizer (fit,
        train_on_batch, load_weights), a step stuck at the floor raises kmp.LossScaleError, not
        TensorFlow's InvalidArgumentError of the in-graph assert (kmp.scaling.overflow.raise_floor_errors_in).

        Returns whether a step traced now may assert: False in a model's train function call that began
        before kmp wrapped it; its wrapper then checks the state after the call."""
        config = self.loss_scale_config
        if config.dynamic and (config.raise_at_min_scale or self.forward_overflow != "backoff"):
            model = calling_model(self)
            if model is not None:
                return overflow.raise_floor_errors_in(model)
        return True

    def finalize_variable_values(self, var_list):
        super().finalize_variable_values(var_list)
        # Keras's fit() ends here: a step stuck in a call traced before kmp wrapped the train function (its
        # first, where it builds this optimizer) is reported now if no later call did.
        model = calling_model(self)
        if model is not None:
            overflow.settle_floor(model)

    @property
    def replays(self) -> bool:
        """Whether an overflowing step is replayed at a lowered scale (overflow="replay", a dynamic scale)."""
        config = self.loss_scale_config
        return config.overflow == "replay" and config.dynamic

    @property
    def overflows(self):
        """Overflow steps. Every overflow skips its step (the contract), so this is `skipped_steps`."""
        return getattr(self, "skipped_steps", None)

    # Keras's own code is never autograph-converted (TensorFlow's DoNotConvert('keras')); in a user's
    # tf.function, kmp's step would otherwise be, at several seconds of CPU on its first trace, for nothing.
    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None, *, micro_batch_weight=None, replay=None):
        """One (micro-)step. `micro_batch_weight` (e.g. a token count) makes
        the gradient the weighted mean: sum(grads) / sum(weights) over the
        micro-batches of the window and every replica; the loss whose
        gradients are passed is then a sum over the micro-batch, not a mean.
        `replay` (a kmp.scaling.replay.Replay, from kmp.prepare's step): how
        to recompute these gradients, scaled, at another scale.
        """
        # Traced: once per train function (eagerly the step raises itself), before the build, which
        # would wrap the train function for the next calls only.
        asserts = tf.executing_eagerly() or self._raise_floor_errors_in_caller()
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        wall_clock.stamp("gradients", grads)
        if self.zero_stage and tf.distribute.get_strategy().num_replicas_in_sync > 1 and not self._zero_noted:
            self._zero_noted = True  # once per optimizer
            warnings.warn("kmp: zero_stage=1 shards the optimizer state on kmp.prepare(model)'s flat buffers; this "
                          "step updates per variable (kmp.prepare was not called, or its log line says why the "
                          "buffers are off), so every replica keeps the whole optimizer state.", UserWarning,
                          stacklevel=3)  # past do_not_convert's wrapper, at apply's caller
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        sixteen = sorted({v.dtype for v in variables if v.dtype in ("bfloat16", "float16")})
        if sixteen and not self._sixteen_noted:
            self._sixteen_noted = True  # once per optimizer
            warnings.warn(f"kmp: this step updates {' and '.join(sixteen)} weights in their own dtype, per variable "
                          "(kmp.prepare was not called, or its log line says why its flat buffers are off): an update "
                          "below 2**-8 of a weight (float16: 2**-11) is lost, and Keras's Adam and AdamW compute their "
                          "bias correction in that dtype, where it is 0, so the weights do not move. kmp.prepare(model)'s "
                          "flat buffers train them from float32 master weights; a 'mixed_' policy keeps float32 "
                          "weights.", UserWarning, stacklevel=3)
        # Every micro-batch of a window is scaled by the same scale: it only
        # changes when a window closes. A static scale of 1 (float32,
        # bfloat16) divides by nothing.
        config = self.loss_scale_config
        scale = None if not config.dynamic and config.static_scale == 1 else self.dynamic_scale.value
        grads = [g if self._overwrite_variable_with_gradient(v) else unscale(g, scale) for g, v in zip(grads, variables)]
        weight = None if micro_batch_weight is None else tf.cast(micro_batch_weight, tf.float32)
        if replay is not None:
            own = [self._overwrite_variable_with_gradient(v) for v in variables]
            raw = replay.gradients
            replay = dataclasses.replace(replay, gradients=lambda s: [
                g if o else unscale(g, s) for g, o in zip(raw(s), own)])
        self._floor_asserts = asserts
        try:
            self._step(grads, _PerVariable(self, variables, trainable_variables), weight, self._replay_of(replay))
        finally:
            self._floor_asserts = True

    def apply_flat(self, grad, buffers, replay=None) -> None:
        """One (micro-)step on flat buffers (kmp.engine.buffers): `grad` is this replica's
        gradient of the flat weights, already unscaled in float32 (kmp.engine
        divides inside its XLA computation, saving a pass over memory). The
        same contract as `apply`: one all-reduce (in buckets), one overflow
        check, clipping by the global norm after the reduce, the update in one
        XLA computation if finite. `replay`: as apply's, its gradients the
        flat one, unscaled.
        """
        wall_clock.stamp("gradients", grad)
        if replay is not None:
            raw = replay.gradients
            replay = dataclasses.replace(replay, gradients=lambda s: [raw(s)])
        self._step([grad], buffers.layout, None, self._replay_of(replay))

    def _replay_of(self, given):
        """The step's replay where this optimizer replays (else None); said once where it cannot."""
        if not self.replays:
            return None
        if given is None and not self._replay_noted:
            self._replay_noted = True
            logger.warning("kmp: overflow=\"replay\" needs the step of kmp.prepare(model), which can compute a "
                           "batch's gradients again; this model's step cannot (kmp.prepare was not called, or the "
                           "model has its own train_step): its overflowing steps are skipped, as with \"skip\".")
        return given

    def _step(self, grads, layout, weight, replay=None):
        """One (micro-)step of `grads` (unscaled float32) in `layout`: _PerVariable, or the flat
        buffers' (kmp.engine.layout)."""
        if self.accumulation is None:
            self._effective_step(grads, layout, None, weight, replay)
            return
        if replay is not None:
            # Only this micro-batch is replayed, before it joins the window (kmp.scaling.replay).
            grads, _, _, _ = replay_module.replayed(self, replay, grads, replay_module.agreed_finite(grads), None,
                                                    None, layout, None, weight, reduce=False)
        _maybe_merge_call(self._micro_step, grads, layout, weight)

    def _micro_step(self, strategy, grads, layout, weight):
        # The window is the same on every replica. Where merge_call is used
        # (CPU/GPU Mirrored) this runs in cross-replica context, so the
        # collective in the closing branch is not built inside a replica-context
        # cond (Keras's own accumulation does that, and crashes).
        if isinstance(layout, tf.distribute.DistributedValues):  # each replica's _PerVariable, all alike
            layout = strategy.experimental_local_results(layout)[0]
        ops.cond(
            self.accumulation.closes(),
            lambda: _each_replica(strategy, self._close_window, grads, layout, weight),
            lambda: _each_replica(strategy, lambda g, w: self.accumulation.add(g, w, sums=layout.sums()), grads,
                                  weight),
        )

    def _close_window(self, grads, layout, weight):
        totals, count, weight = self.accumulation.close(grads, weight, sums=layout.sums())
        self._effective_step(totals, layout, count, weight)

    def _effective_step(self, grads, layout, count, weight, replay=None):
        """All-reduce once, check, (replay,) clip, apply if finite, move the scale (replica context)."""
        grads = layout.reduce(self, grads, count, weight)
        wall_clock.stamp("reduced", grads)
        finite, clip, flags = layout.check(self, grads)
        wall_clock.stamp("checked", [finite, clip])
        if replay is not None:
            grads, finite, clip, flags = replay_module.replayed(self, replay, grads, finite, clip, flags, layout,
                                                                count, weight)
        layout.update(self, grads, finite, clip)
        wall_clock.stamp("updated", layout.updated())
        self._adjust(finite, flags, layout.variables)  # flags: a vector on the flat path, no op per variable
        wall_clock.stamp("adjusted", self.skipped_steps)

    def _apply_if_finite(self, strategy, grads, trainable_variables, finite):
        # Every replica computed `finite` from the same reduced gradients. A
        # cond whose branch calls merge_call (as Keras's update does) must be
        # built in cross-replica context under MirroredStrategy.
        finite = strategy.experimental_local_results(finite)[0]
        ops.cond(
            finite, lambda: _each_replica(strategy, self._apply_inner, grads, trainable_variables), lambda: None
        )

    def _apply_inner(self, grads, trainable_variables):
        """The inner optimizer's update of already all-reduced, unscaled gradients."""
        with _reduced_already(self.inner_optimizer):
            if self.fused:
                fused_apply(self.inner_optimizer, grads, trainable_variables)
            else:
                self.inner_optimizer.apply(grads, trainable_variables)

    def _adjust(self, finite, flags=(), variables=()):
        """Moves the loss-scale state one step (see kmp.scaling.state.adjust).

        `flags` (one per variable of `variables`, a list or a bool vector) say whose gradient was not
        finite: the overflow line names them.
        """
        config = self.loss_scale_config
        old = loss_scale.LossScaleState(self.dynamic_scale.value, self.hysteresis_left.value, self.good_steps.value)
        new, stuck = loss_scale.adjust(config, old, finite, where=typed_where)
        overflow.raise_if_stuck(config, stuck, old.scale, in_graph=self._floor_asserts)
        printed = None
        if self.log_overflows:
            printed = overflow.log_overflow(config, finite, old, new, flags, variables, end=overflow.line_end(self))
        grew = finite & loss_scale.grows(config, new.good_steps) if config.dynamic else finite & False
        # Keras's step_counter: clean steps since the last growth or overflow.
        self.step_counter.assign(typed_where(finite & ~grew, self.step_counter.value + 1, 0))
        if config.dynamic:  # a static state never moves
            self.dynamic_scale.assign(new.scale)
            self.hysteresis_left.assign(new.hysteresis_left)
            self.good_steps.assign(new.good_steps)
        # After the line: a step that ends the line (kmp.engine.overflow_layer) reads this counter first.
        with tf.control_dependencies([] if printed is None else [printed]):
            self.skipped_steps.assign_add(tf.cast(tf.logical_not(finite), self.skipped_steps.dtype))
        if overflow.flag_count(flags):
            vector = overflow.flag_vector(flags)
            first = tf.argmin(tf.cast(vector, tf.int32), output_type=tf.int64)  # first False
            named = tf.logical_not(finite) & tf.logical_not(tf.reduce_all(vector))
            self.overflow_variable.assign(typed_where(named, first, self.overflow_variable.value))

    def save_own_variables(self, store):
        """Keras's format (one value per variable), plus every replica's own
        accumulation state under `per_replica_<index>`: Keras would save replica
        0's partial sums for every replica (.keras, .weights.h5, ModelCheckpoint).
        Under several workers, inside a window, the rows are gathered from every
        worker, so every worker must call the save (kmp.engine.replica_state).
        tf.train.Checkpoint saves them through `per_replica_window`."""
        super().save_own_variables(store)
        if self.accumulation is None or not self.built:
            return
        # On one device too (one row): loaded on several replicas, the sums
        # then go to the first replica only, not to each.
        rows = {id(v): r for v, r in zip(self.accumulation.local_state(), self.per_replica_window.rows(), strict=True)}
        for index, variable in enumerate(self.variables):
            if id(variable) in rows:
                store[f"per_replica_{index}"] = rows[id(variable)].numpy()

    def load_own_variables(self, store):
        keys = [k for k in store.keys() if k.startswith("per_replica_")]
        model = None if self.built else calling_model(self)
        if model is not None:
            # Keras skips an unbuilt optimizer's state (a fresh model's
            # load_weights, a ModelCheckpoint file): it is built here, from the
            # model that loads it, so the state and the window come back.
            with model.distribute_strategy.scope(), keras.name_scope(self.name, caller=self):
                self.build(model.trainable_variables)
            self.built = True
        super().load_own_variables({k: store[k] for k in store.keys() if k not in keys})
        if not self.built:
            return  # Keras warned that it skipped the state
        replica_state.assign_rows([self.variables[int(k.removeprefix("per_replica_"))] for k in keys],
                                  [np.asarray(store[k]) for k in keys])

    def get_config(self):
        config = super().get_config()
        config.update(dataclasses.asdict(self.loss_scale_config))
        config["log_overflows"] = self.log_overflows
        config["forward_overflow"] = self.forward_overflow
        config["gradient_accumulation_steps"] = None if self.accumulation is None else self.accumulation.initial_steps
        config["gradient_clipping"] = self.gradient_clipping
        config["fused"] = self.fused
        config["zero_stage"] = self.zero_stage
        config["communication"] = dataclasses.asdict(self.communication)
        return config


def _into_the_scope(optimizer, strategy) -> bool:
    """Keras made `optimizer`'s step counter and learning rate where it was made, and keeps that strategy for its
    updates. Made outside `strategy`'s scope (one device), each replica counts every step (a learning-rate
    schedule runs as many times faster), and a replica's XLA step cannot read them from another device: the
    TensorFlow variables behind them are mirrored in the scope (the Keras variables stay the same objects, so
    nothing that holds or tracks them changes). Whether any was."""
    if getattr(optimizer, "_distribution_strategy", strategy) is strategy or not tf.distribute.has_strategy():
        return False
    variables = [getattr(optimizer, name, None) for name in ("_iterations", "_learning_rate")]
    moved = zero.to_replicas([v for v in variables if isinstance(v, keras.Variable)], strategy)
    if moved:  # not another strategy's variables: made under no strategy at all
        optimizer._distribution_strategy = strategy
    return moved


def loss_scale_initial(config: LossScaleConfig) -> float:
    return loss_scale.initial_state(config).scale


def calling_model(optimizer):
    """The keras.Model compiled with `optimizer` whose method is calling it now (fit, train_on_batch,
    load_weights), or None.

    Keras never hands an optimizer its model, but its methods call the
    optimizer from the model's own, so the model is a caller's `self`.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model) and getattr(owner, "optimizer", None) is optimizer:
            return owner
        frame = frame.f_back
    return None


def own_clipping(optimizer) -> dict:
    """The clipping a Keras optimizer does itself: {"clipnorm" | "clipvalue" | "global_clipnorm": value}."""
    names = ("clipnorm", "clipvalue", "global_clipnorm")
    return {k: getattr(optimizer, k) for k in names if getattr(optimizer, k) is not None}


class _PerVariable:
    """The per-variable path's layout (kmp.engine.layout has the flat buffers'): each replica's own Keras
    variables, stepped by kmp.engine.fused or by the inner optimizer's update."""

    def __init__(self, optimizer, variables, given):
        self.variables, self.given = variables, given  # `given`: apply()'s trainable_variables (None: built ones)
        # The values float8 layers overwrite (amax history, scales) arrive as
        # their "gradients" and stay each replica's own, as in Keras: they are
        # not summed, averaged or clipped.
        self.own = [optimizer._overwrite_variable_with_gradient(v) for v in variables]

    def sums(self):
        return None  # the accumulation's own, one per variable

    def reduce(self, optimizer, grads, count, weight=None):
        shared = reduce_mean([None if o else g for g, o in zip(grads, self.own)], optimizer.communication,
                             optimizer.dynamic_scale.value, count, weight)
        return [g if o else r for g, r, o in zip(grads, shared, self.own)]

    def check(self, optimizer, grads):
        flags = finite_flags(grads)
        finite = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
        # Which gradients overflowed, for the log line: the float8 values (amax history, scales) are state, not
        # gradients, and are not named (a non-finite one still skips the step, as in Keras).
        flags = [tf.constant(True) if o else f for f, o in zip(flags, self.own)]
        finite, clip = clipped_check(finite, [g for g, o in zip(grads, self.own) if not o], optimizer.gradient_clipping)
        return finite, clip, flags

    def update(self, optimizer, grads, finite, clip) -> None:
        step, _ = fused_step(optimizer.inner_optimizer, grads, self.given) if optimizer.fused else (None, None)
        if step is not None:
            # The fused update and the state variables (aggregation "none":
            # each replica writes its own copy) need no cross-replica context,
            # and every replica takes the same branch from the same gradients.
            ops.cond(finite, lambda: step(grads, clip), lambda: None)
            return
        if clip is not None:
            grads = [g if o or g is None else g * clip for g, o in zip(grads, self.own)]
        _maybe_merge_call(optimizer._apply_if_finite, grads, self.given, finite)

    def updated(self):
        return self.variables[:1]


def _maybe_merge_call(fn, *args):
    """fn(strategy, *args): through merge_call where the strategy needs one, else here."""
    strategy = tf.distribute.get_strategy()
    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def _each_replica(strategy, fn, *args):
    """fn(*args) on every replica: from cross-replica context (after a merge_call), or here."""
    if tf.distribute.in_cross_replica_context():
        return strategy.extended.call_for_each_replica(fn, args=args)
    return fn(*args)


def _as_given(grads_and_vars):
    return list(grads_and_vars)


@contextlib.contextmanager
def _reduced_already(inner):
    """The inner optimizer receives gradients this class already all-reduced.

    Keras's TensorFlow optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients` before its update; doing it again would
    multiply them by the number of replicas. The hook is shadowed on this
    instance for one update call (under tf.function: while it is traced),
    then removed, so the optimizer used on its own all-reduces as before.
    """
    had = "_all_reduce_sum_gradients" in vars(inner)
    previous = vars(inner).get("_all_reduce_sum_gradients")
    inner._all_reduce_sum_gradients = _as_given
    try:
        yield
    finally:
        if had:
            inner._all_reduce_sum_gradients = previous
        else:
            del inner._all_reduce_sum_gradients


def _loss_scale_config(given_config, arguments: dict) -> tuple[LossScaleConfig, list[Problem]]:
    if given_config is None:
        return attempt(lambda: LossScaleConfig(**arguments), LossScaleConfig())
    if not isinstance(given_config, LossScaleConfig):
        return LossScaleConfig(), [Problem("loss_scale", "None or a kmp.LossScaleConfig", given_config)]
    # Passed, not merely equal to the default: a default argument is the very
    # object in the signature (and `!=` on an array answers no bool).
    defaults = inspect.signature(LossScaleOptimizer.__init__).parameters
    changed = [k for k, v in arguments.items() if v is not defaults[k].default]
    if changed:
        return given_config, [Problem(
            changed[0], "its default when loss_scale= is given", arguments[changed[0]],
            "Put every loss-scale setting in the LossScaleConfig, or pass them all as arguments.",
        )]
    return given_config, []


def _unknown_arguments(kwargs: dict) -> list[Problem]:
    """Names neither kmp nor Keras's optimizers take, as one problem in Keras's words.

    Keras's own names are left to Keras's checks, which word their errors themselves.
    """
    # Every Keras optimizer takes the base class's arguments (clipnorm, use_ema,
    # ...): the ones SGD and Adam share. Keras's wrapper rejects them itself.
    shared = set(inspect.signature(keras.optimizers.SGD.__init__).parameters)
    keras_names = (shared & set(inspect.signature(keras.optimizers.Adam.__init__).parameters)) | {"dynamic"}
    ours = [n for n in inspect.signature(LossScaleOptimizer.__init__).parameters if n not in ("self", "kwargs")]
    unknown = {name: value for name, value in kwargs.items() if name not in keras_names}
    if not unknown:
        return []
    hints = [f"`{name}`: {hint}" for name in unknown if (hint := did_you_mean(name, ours))]
    return [Problem("**kwargs", "only arguments of kmp.LossScaleOptimizer", unknown, " ".join([
        f"LossScaleOptimizer does not support arguments: `{'`, `'.join(unknown)}`.", *hints]))]


def _inner_problems(inner, gradient_clipping) -> list[Problem]:
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
    clipping = own_clipping(inner)
    if gradient_clipping is not None and clipping:
        name, value = next(iter(clipping.items()))
        return [Problem(
            "gradient_clipping", f"None, since the inner optimizer already clips ({name}={value})", gradient_clipping,
            "Set clipping in one place: the config/kmp argument or the optimizer.",
        )]
    return []
