"""What a compiled model allocates: its settings, for kmp.memory.estimate's estimate, and the bytes each device holds.

    setup = settings(model)          # kmp.memory.estimate.Setup: parameters, optimizer, replicas, engine, ...
    kmp.measured_bytes(model)        # {device: kmp.memory.estimate.Bytes}, summed from the variables

Measured, per replica device: each variable's own component there
(`strategy.experimental_local_results`: under MirroredStrategy every replica
holds one of each variable), by kmp.memory.estimate's categories:

    weights          the model's trainable and non-trainable variables
    optimizer_state  the inner optimizer's variables, but its iterations and learning rate
    accumulators     kmp.scaling.accumulate's sums (and Keras's own accumulators)
    flat_copies      the flat-buffer engine's buffers (kmp.engine.buffers; Keras does not track them)
    scalars          the optimizers' other variables, the metrics' variables
    gradients        0: they live in tensors of a step, not in variables
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from kmp import seams
from kmp.distribute.communication import cpus_of_one_process
from kmp.engine import engine
from kmp.engine.prepare import flat_reason
from kmp.errors import Problem, check
from kmp.memory.estimate import (BLOCK_SIZE, CATEGORIES, KERAS_LOSS_SCALE_SCALARS, KMP_LOSS_SCALE_SCALARS,
                                 MIN_8BIT_SIZE, OPTIMIZER_SCALARS, Bytes, Setup, optimizer_slots)
from kmp.scaling.eight_bit import states_of


def settings(model) -> Setup:
    """What kmp.memory.estimate's estimate needs to know about a compiled model, read from it.

    Scalars as the model's optimizers and metrics hold them, but the
    accumulation counters: kmp.memory.estimate adds those from the setting.
    """
    problems: list[Problem] = []
    wrapper = getattr(model, "optimizer", None)
    if not isinstance(model, keras.Model) or wrapper is None or not model.built:
        problems.append(Problem("model", "a built, compiled keras.Model, or a parameter count", type(model).__name__,
                                "Compile (and build) the model first, or pass its parameter count."))
    else:
        inner = getattr(wrapper, "inner_optimizer", wrapper)
        name, slots = optimizer_slots(inner, problems)
    check(problems, "kmp.memory_estimate arguments")
    trainable = model.trainable_variables
    parameter_bytes = sum(_nbytes(v) for v in trainable)
    accumulation = getattr(wrapper, "accumulation", None)
    stage, states = _zero_settings(wrapper)
    scalars = OPTIMIZER_SCALARS - 4 * (not isinstance(inner._learning_rate, keras.Variable))
    scalars += KERAS_LOSS_SCALE_SCALARS * isinstance(wrapper, keras.optimizers.LossScaleOptimizer)
    scalars += KMP_LOSS_SCALE_SCALARS * hasattr(wrapper, "loss_scale_config")
    return Setup(
        parameters=sum(_elements(v) for v in trainable), parameter_bytes=parameter_bytes, optimizer=name, slots=slots,
        precision=model.dtype_policy.name, replicas=model.distribute_strategy.num_replicas_in_sync, stage=stage,
        states=states, gradient_accumulation_steps=1 if accumulation is None else accumulation.initial_steps,
        accumulating=accumulation is not None, flat_buffers=_flat_in_use(model),
        other_weights=sum(_nbytes(v) for v in model.non_trainable_variables),
        other_state=parameter_bytes * bool(inner.use_ema),
        other_sums=parameter_bytes * bool(inner.gradient_accumulation_steps),
        scalars=scalars + sum(_nbytes(v) for v in model.metrics_variables),
        sizes=tuple(_elements(v) for v in trainable), block_size=getattr(inner, "block_size", BLOCK_SIZE),
        min_8bit_size=getattr(inner, "min_8bit_size", MIN_8BIT_SIZE),
        one_process=cpus_of_one_process(model.distribute_strategy))


def _zero_settings(optimizer) -> tuple[int, str]:
    """(ZeRO stage, state type) of an optimizer (kmp's, or a plain one)."""
    return getattr(optimizer, "zero_stage", 0), states_of(getattr(optimizer, "inner_optimizer", optimizer))


def _flat_in_use(model) -> bool:
    """Whether the model trains on the flat buffers: they exist, or kmp.prepare's setting builds them at fit()."""
    if engine.engine_of(model) is not None:
        return True
    if getattr(type(model), "train_step", None) is not seams.get("TensorFlowTrainer").train_step:
        return False  # a model's own train_step keeps the per-variable path
    return flat_reason(model) is None


def measured_bytes(model) -> dict[str, Bytes]:
    """{device: Bytes} of the variables each replica device holds (its own component of each), by category."""
    wrapper, built = model.optimizer, engine.engine_of(model)
    groups = []  # the first group a variable is in names its category
    if wrapper is not None:
        inner = getattr(wrapper, "inner_optimizer", wrapper)
        rate = [inner._learning_rate] if isinstance(inner._learning_rate, keras.Variable) else []
        groups += [("accumulators", [*getattr(getattr(wrapper, "accumulation", None), "sums", []),
                                     *(getattr(inner, "_accumulated_gradients", None) or [])]),
                   ("scalars", [inner._iterations, *rate]), ("optimizer_state", inner.variables),
                   ("scalars", wrapper.variables)]
    groups += [("weights", model.trainable_variables + model.non_trainable_variables),
               ("scalars", model.metrics_variables),
               ("flat_copies", _flat_variables(built))]
    seen, totals = set(), {}
    for category, variables in groups:
        for variable in variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            value = variable.value if isinstance(variable, keras.Variable) else variable
            for component in model.distribute_strategy.experimental_local_results(value):
                counts = totals.setdefault(tf.DeviceSpec.from_string(component.device).to_string(),
                                           dict.fromkeys(CATEGORIES, 0))
                counts[category] += _nbytes(component)
    return {device: Bytes(**counts) for device, counts in sorted(totals.items())}


def _elements(variable) -> int:
    return math.prod(int(d) for d in variable.shape)


def _nbytes(variable) -> int:
    return _elements(variable) * tf.as_dtype(variable.dtype).size


def _flat_variables(built) -> list:
    """The engine's buffers, and Lamb's per-element segment ids (kmp.engine.buffers)."""
    if built is None:
        return []
    ids = getattr(built.buffers, "segment_ids", None)
    return list(built.buffers.buffers.values()) + ([ids] if ids is not None else [])
