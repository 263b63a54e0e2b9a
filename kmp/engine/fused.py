"""The optimizer update as one XLA computation per replica.

Keras updates variables one small op at a time (about ten kernels per
variable for Adam, each a pass over memory with its own dispatch). Here the
whole of `optimizer.apply`, for gradients that are already all-reduced, is
compiled with XLA, traced once per optimizer settings, variable set and
replica, and reused:

    fused_apply(opt, grads, variables):
        if fused_support(opt) or this call needs Keras:   # reason logged once
            opt.apply(grads, variables)
        else, in one XLA computation on this replica's own copies:
            lr = learning_rate(iterations)        # variable, schedule or callable
            grads = clip(grads)                   # clipnorm | global_clipnorm | clipvalue
            var -= var * weight_decay * lr        # where opt._use_weight_decay(var)
            var, slots = update(var, grad, slots, lr, iterations + 1)
            iterations += 1

The math is Keras's `update_step` for SGD (momentum, nesterov), Adam
(amsgrad=False) and AdamW, op for op. XLA's CPU backend contracts a*b+c into
one FMA where Keras rounds twice, so results agree to about one ulp per
step; with FMA unavailable (XLA_FLAGS=--xla_cpu_max_isa=AVX) they are bit
for bit identical, except the norm clippings, whose sums XLA adds in another
order (tests/test_fused.py checks both).

Layout (benchmarks/p3_fused_bandwidth.py measures it):

- Per-variable element-wise loops, not flat buffers: concatenating into flat
  buffers and splitting back here costs extra passes and loses each
  variable's in-place update (kmp.engine.buffers keeps the buffers flat instead).
- At most GROUP_SIZE variables per computation: TensorFlow's XLA launch
  looks every input up in the output-alias table, so its cost per variable
  grows with the number of variables in one launch. 256 keeps most models
  in one computation.
- What is left is TensorFlow's cost per resource variable plus the bytes:
  near the memory bandwidth for large variables, far from it for many
  small ones.

Replicas: under a MirroredStrategy each replica calls this in replica
context, and the compiled step captures that replica's own component of
every mirrored variable (model variables, slots, iterations, the learning
rate), so each XLA computation touches only its own device's resources.
Nothing communicates inside: the gradients must already be all-reduced, and
a fallback to `optimizer.apply` must not all-reduce again
(kmp.LossScaleOptimizer shadows that reduction for the call).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import keras
import tensorflow as tf
from keras import ops
from keras.optimizers.schedules import LearningRateSchedule

from kmp.scaling.gradients import clip_by_global_norm, global_clip_scale

logger = logging.getLogger(__name__)

_HYPERPARAMETERS = {
    keras.optimizers.SGD: ("momentum", "nesterov"),
    keras.optimizers.Adam: ("beta_1", "beta_2", "epsilon"),
    keras.optimizers.AdamW: ("beta_1", "beta_2", "epsilon"),
}
_CLIPPING = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue")
# Keras's private optimizer state this module reads (kmp/seams.py lists them).
_INTERNALS = ("_learning_rate", "_iterations", "_trainable_variables_indices", "_var_key", "_get_variable_index",
              "_use_weight_decay", "_filter_empty_gradients", "_overwrite_variable_with_gradient")
GROUP_SIZE = 256  # variables per XLA computation (see "Layout" above)


def fused_support(optimizer, hyperparameters=None, fused_types="kmp fuses SGD, Adam and AdamW") -> str | None:
    """None if `fused_apply` fuses this optimizer's update, else why not.

    `hyperparameters` ({optimizer class: its hyperparameter names}) and
    `fused_types` let kmp.engine.buffers, which updates more classes, ask the same.
    """
    hyperparameters = hyperparameters or _HYPERPARAMETERS
    kind = type(optimizer)
    if kind not in hyperparameters:
        # Exact types only: a subclass may override update_step.
        return f"{kind.__name__} has no fused update ({fused_types})"
    missing = [name for name in _INTERNALS if not hasattr(optimizer, name)]
    if missing:
        return f"this Keras version lacks the optimizer internals kmp.engine.fused reads ({', '.join(missing)})"
    if getattr(optimizer, "amsgrad", False):
        return "amsgrad=True"
    if optimizer.use_ema:
        return "use_ema=True"
    if optimizer.gradient_accumulation_steps:
        return f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
    if optimizer.loss_scale_factor is not None:
        return f"loss_scale_factor={optimizer.loss_scale_factor}"
    for name in hyperparameters[kind] + _CLIPPING:
        value = getattr(optimizer, name)
        if value is not None and not isinstance(value, (int, float)):
            return f"{name} is a {type(value).__name__}, not a number"
    return None


@tf.autograph.experimental.do_not_convert
def fused_apply(optimizer, grads, variables=None) -> None:
    """`optimizer.apply(grads, variables)` on this replica, as one XLA computation.

    The gradients must already be all-reduced: nothing here communicates
    across replicas. Calls the optimizer needs Keras for fall back to
    `optimizer.apply`, with a one-line note (logged once per optimizer and
    reason).
    """
    grads = list(grads)
    step, reason = fused_step(optimizer, grads, variables)
    if reason is not None:
        _note(optimizer, reason)
        optimizer.apply(grads, variables)
        return
    step(grads)


def fused_step(optimizer, grads, variables=None):
    """(a callable `step(grads, clip_scale=None)` doing the fused update here, None), or (None, why not).

    `clip_scale`, a scalar the caller computed (kmp.scaling.gradients.global_clip_scale),
    multiplies every gradient in place of the optimizer's own clipping, which
    must then be off. The step touches only this replica's own variables and
    needs no cross-replica context: callers may run it inside a replica-context
    cond.
    """
    reason = fused_support(optimizer)
    if reason is not None:
        return None, reason
    return _step_for(optimizer, list(grads), variables)


# --- Caches: one compiled step per optimizer, settings, variables, replica ---

# Entries hold no reference to their optimizer, so an optimizer's steps go
# when it does. A step holds the Keras variables whose ids are in its key,
# so no other variable can take those ids while it lives.
_STEPS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_NOTED: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def _note(optimizer, reason: str) -> None:
    noted = _NOTED.setdefault(optimizer, set())
    if reason not in noted:
        noted.add(reason)
        logger.info("kmp.engine.fused: %s (%s) updates through Keras, unfused: %s.",
                    optimizer.name, type(optimizer).__name__, reason)


def _settings(optimizer) -> tuple:
    """Everything the compiled step bakes in; a change means a new step."""
    lr = optimizer._learning_rate
    if isinstance(lr, LearningRateSchedule):
        lr_key = ("schedule", id(lr))
    elif isinstance(lr, keras.Variable):
        lr_key = ("variable", id(lr))
    else:
        lr_key = ("callable", id(lr))
    names = _HYPERPARAMETERS[type(optimizer)] + _CLIPPING
    return (type(optimizer), lr_key) + tuple(getattr(optimizer, n) for n in names)


def _step_for(optimizer, grads, variables):
    """(the compiled step, None), or (None, why this call is not fused)."""
    if variables is None:
        if not optimizer.built:
            return None, "no variables given and the optimizer is not built"
        variables = optimizer._trainable_variables
    variables = list(variables)
    if len(grads) != len(variables):
        return None, f"{len(grads)} gradients for {len(variables)} variables"
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return None, "no gradients"
    if any(isinstance(grads[i], tf.IndexedSlices) for i in present):
        return None, "sparse gradients (tf.IndexedSlices)"
    replica, reason = _replica()
    if reason:
        return None, reason
    key = (_settings(optimizer), replica, tuple(id(variables[i]) for i in present))
    steps = _STEPS.setdefault(optimizer, {})
    if key not in steps:
        if not optimizer.built:
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
        steps[key] = _make_step(optimizer, [variables[i] for i in present])
    step = steps[key]
    if isinstance(step, str):
        return None, step
    if len(present) < len(variables):
        # Keras's warning for variables without gradients.
        optimizer._filter_empty_gradients(grads, variables)
    return (lambda grads, clip_scale=None: step([grads[i] for i in present], clip_scale)), None


def _replica():
    """(a key naming this replica, None), or (None, why not fusable here)."""
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == 1:
        return (id(strategy), 0), None
    context = tf.distribute.get_replica_context()
    if context is None:
        return None, "called in cross-replica context"
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    if replica is None:
        return None, "the replica id is not known while tracing"
    return (id(strategy), int(replica)), None


def _local(variable):
    """This replica's own copy of `variable` (a plain tf.Variable)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        # TF's own read path for a mirrored variable: the component of the
        # current replica (its local index under MultiWorkerMirroredStrategy).
        return value._get_on_device_or_primary()
    return value


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def _make_step(optimizer, variables):
    """The step for these variables on this replica, or why they cannot be fused."""
    for v in variables:
        if optimizer._var_key(v) not in optimizer._trainable_variables_indices:
            return f"variable {_name(v)} is not one the optimizer was built with"
        if getattr(v, "constraint", None) is not None:
            return f"variable {_name(v)} has a constraint"
        if optimizer._overwrite_variable_with_gradient(v):
            return f"variable {_name(v)} has overwrite_with_gradient=True"
        if not tf.as_dtype(v.dtype).is_floating:
            return f"variable {_name(v)} has dtype {v.dtype}"
    distributed = tf.distribute.get_strategy().num_replicas_in_sync > 1
    if distributed:
        for v in variables + [optimizer._iterations]:
            value = v.value if isinstance(v, keras.Variable) else v
            if not isinstance(value, tf.distribute.DistributedValues):
                return f"variable {_name(v)} is not mirrored across the replicas"

    kind = type(optimizer)
    hyper = {name: getattr(optimizer, name) for name in _HYPERPARAMETERS[kind] + _CLIPPING}
    index = [optimizer._get_variable_index(v) for v in variables]
    if kind is keras.optimizers.SGD:
        rule = _SGD
        slots = [(optimizer.momentums[i],) if hyper["momentum"] != 0 else () for i in index]
    else:
        rule = _Adam
        slots = [(optimizer._momentums[i], optimizer._velocities[i]) for i in index]
    decays = [hyper["weight_decay"] is not None and optimizer._use_weight_decay(v) for v in variables]
    lr = optimizer._learning_rate
    if isinstance(lr, keras.Variable):
        lr_var = _local(lr)
        if distributed and not isinstance(lr.value, tf.distribute.DistributedValues):
            return "the learning-rate variable is not mirrored across the replicas"
        learning_rate = lambda iterations: lr_var.read_value()
    elif isinstance(lr, LearningRateSchedule):
        learning_rate = lr  # evaluated inside, at the replica's own iterations
    else:
        learning_rate = None  # a callable: called outside, its value passed in
    return _Step(
        variables=tuple(variables) + (lr,),
        params=[_local(v) for v in variables],
        slots=[tuple(_local(s) for s in group) for group in slots],
        decays=decays,
        iterations=_local(optimizer._iterations),
        learning_rate=learning_rate,
        call_learning_rate=None if learning_rate is not None else lr,
        rule=rule,
        hyper=hyper,
    )


@dataclass(eq=False)
class _Step:
    """The compiled update of one variable set on one replica.

    One XLA computation per group of at most `GROUP_SIZE` variables (one in
    all for most models). Every group reads `iterations`; the last one
    increments it. A global clipnorm over several groups is one more small
    computation, over the gradients only, before them.
    """

    # The Keras variables and the learning-rate object: holding them keeps
    # their ids (in the key) from being reused while this step lives.
    variables: tuple
    params: list
    slots: list
    decays: list
    iterations: tf.Variable
    learning_rate: Callable | None
    call_learning_rate: Callable | None
    rule: type
    hyper: dict

    def __post_init__(self):
        n = len(self.params)
        self.groups = [range(lo, min(lo + GROUP_SIZE, n)) for lo in range(0, n, GROUP_SIZE)]
        # No AutoGraph: the loops are over Python lists, and converting every
        # call inside them makes tracing several times slower.
        compile_ = lambda f: tf.function(f, jit_compile=True, autograph=False)
        self.functions = [
            compile_(functools.partial(self._update, group, last=k == len(self.groups) - 1))
            for k, group in enumerate(self.groups)
        ]
        global_clipnorm = self.hyper["global_clipnorm"]
        split_clip = len(self.groups) > 1 and bool(global_clipnorm and global_clipnorm > 0)
        self.clip_scale = compile_(functools.partial(global_clip_scale, clip_norm=global_clipnorm)) if split_clip else None

    def __call__(self, grads, clip_scale=None):
        extra = {}
        if self.call_learning_rate is not None:
            extra["learning_rate"] = tf.convert_to_tensor(self.call_learning_rate())
        if clip_scale is not None:
            extra["clip_scale"] = clip_scale
        elif self.clip_scale is not None:
            extra["clip_scale"] = self.clip_scale(grads)
        for group, function in zip(self.groups, self.functions):
            function([grads[i] for i in group], **extra)

    def _update(self, group, grads, learning_rate=None, clip_scale=None, *, last):
        h = self.hyper
        iterations = self.iterations.read_value()
        if learning_rate is None:
            learning_rate = self.learning_rate(iterations)
        if clip_scale is None:
            grads = _clip(grads, h["clipnorm"], h["global_clipnorm"], h["clipvalue"])
        else:
            grads = [g * clip_scale for g in grads]  # clip_by_global_norm's last line
        scalars = {}  # per dtype: computed once, not once per variable
        for i, grad in zip(group, grads):
            var = self.params[i]
            dtype = var.dtype
            if dtype not in scalars:
                lr = tf.cast(learning_rate, dtype)
                scalars[dtype] = self.rule.scalars(h, lr, tf.cast(iterations + 1, dtype), dtype)
                scalars[dtype]["lr"] = lr
                if h["weight_decay"] is not None:
                    scalars[dtype]["weight_decay"] = tf.cast(h["weight_decay"], dtype)
            s = scalars[dtype]
            value = var.read_value()
            if self.decays[i]:
                # Keras (TF backend): variable.assign_sub(variable * wd * lr)
                value = value - value * s["weight_decay"] * s["lr"]
            var.assign(self.rule.update(s, h, value, tf.cast(grad, dtype), self.slots[i]))
        if last:
            self.iterations.assign_add(1)


def _clip(grads, clipnorm, global_clipnorm, clipvalue):
    """BaseOptimizer._clip_gradients, with the TF backend's clip_by_norm."""
    if clipnorm and clipnorm > 0:
        return [tf.clip_by_norm(g, clipnorm) for g in grads]
    if global_clipnorm and global_clipnorm > 0:
        return clip_by_global_norm(grads, global_clipnorm)
    if clipvalue and clipvalue > 0:
        return [ops.clip(g, -clipvalue, clipvalue) for g in grads]
    return grads


class _SGD:
    """keras.optimizers.SGD.update_step, op for op."""

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        return {"momentum": tf.cast(h["momentum"], dtype)}

    @staticmethod
    def update(s, h, value, grad, slots):
        lr = s["lr"]
        if not slots:
            return value - grad * lr
        (m,) = slots
        new_m = m.read_value() * s["momentum"] - grad * lr
        m.assign(new_m)
        if h["nesterov"]:
            return value + (new_m * s["momentum"] - grad * lr)
        return value + new_m


class _Adam:
    """keras.optimizers.Adam.update_step (amsgrad=False), op for op."""

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        beta_1_power = tf.pow(tf.cast(h["beta_1"], dtype), local_step)
        beta_2_power = tf.pow(tf.cast(h["beta_2"], dtype), local_step)
        return {
            "alpha": lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power),
            # Keras multiplies by the Python floats 1 - beta: rounded once.
            "one_minus_beta_1": tf.constant(1 - h["beta_1"], dtype),
            "one_minus_beta_2": tf.constant(1 - h["beta_2"], dtype),
            "epsilon": tf.constant(h["epsilon"], dtype),
        }

    @staticmethod
    def update(s, h, value, grad, slots):
        m, v = slots
        m_value, v_value = m.read_value(), v.read_value()
        new_m = m_value + (grad - m_value) * s["one_minus_beta_1"]
        new_v = v_value + (tf.square(grad) - v_value) * s["one_minus_beta_2"]
        m.assign(new_m)
        v.assign(new_v)
        return value - (new_m * s["alpha"]) / (tf.sqrt(new_v) + s["epsilon"])
