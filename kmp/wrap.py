"""kmp.wrap: one call that returns the optimizer right for the precision.

    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), ...)

float16 compute gets a configured `kmp.LossScaleOptimizer`. bfloat16 and
float32 need no loss scaling: on one device without accumulation they get the
optimizer itself, with the config's clipping applied. Under a strategy with
several replicas (call `wrap` inside `strategy.scope()`, as Keras requires
for optimizers), or with gradient accumulation, they get kmp's optimizer
with a static scale of 1, so that gradients are all-reduced once before they
are clipped, and non-finite steps are skipped.

Precision comes from, in order: `precision=`, the config's `fp16`/`bf16`
block when one is enabled, the active global Keras policy. `wrap` never
changes the global policy.

`wrap` never changes the optimizer it is given. Clipping (DeepSpeed's
`gradient_clipping`, a global-norm clip) is done by kmp's optimizer, after the
all-reduce; where `wrap` returns a plain optimizer, it returns a copy
(`from_config`) with `global_clipnorm` set.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import tensorflow as tf

from kmp import values
from kmp.config import Config, LossScaleConfig, attempt, communication_of
from kmp.deepspeed import load_config, resolve_batch_sizes
from kmp.errors import Problem, check, did_you_mean
from kmp.optimizer import LossScaleOptimizer, own_clipping
from kmp.precision import Precision, resolve_precision

_SCALE_FIELDS = tuple(f.name for f in dataclasses.fields(LossScaleConfig))
_TOP_FIELDS = ("gradient_clipping", "gradient_accumulation_steps")
_OPTIMIZER_FIELDS = ("log_overflows", "fused", "communication")


def wrap(optimizer, config=None, *, precision=None, **overrides):
    """The optimizer to compile with, for the given or active precision.

    Args:
        optimizer: a `keras.optimizers.Optimizer` or a name Keras knows ("adamw").
        config: a `kmp.Config`, or a DeepSpeed-style config as a dict, a JSON
            file path or a JSON string (see `kmp.load_config`).
        precision: any spelling `kmp.resolve_precision` accepts; overrides
            the config and the global policy for this optimizer only.
        **overrides: loss-scale settings (`hysteresis=2`, `min_scale=...`,
            any `kmp.LossScaleOptimizer` argument), `gradient_clipping`,
            `gradient_accumulation_steps`.

    Batch sizes in the config (`train_batch_size`,
    `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`) are
    completed and checked as DeepSpeed does, with the strategy's replicas as
    its world size; more than one micro-batch per step turns on kmp's
    accumulation. Feed `fit()` the micro-batch: `batch_size = micro * replicas`.
    """
    settings = config if isinstance(config, Config) else (Config() if config is None else load_config(config))
    settings, extra = _with_overrides(settings, overrides)
    optimizer = _as_optimizer(optimizer)
    chosen = _choose_precision(precision, settings)
    clip = _clipping_to_add(optimizer, settings.gradient_clipping)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    steps = _accumulation_steps(settings, replicas)
    if steps is not None:
        extra["gradient_accumulation_steps"] = steps
    extra.setdefault("communication", settings.communication())
    if chosen.needs_loss_scaling:
        return LossScaleOptimizer(optimizer, loss_scale=settings.loss_scale, gradient_clipping=clip, **extra)
    if replicas > 1 or steps is not None:
        # Keras clips each replica's local gradient before its all-reduce, and
        # its own accumulation fails under tf.distribute. kmp's optimizer does
        # both right; a static scale of 1 is that pipeline without scaling
        # (and it still skips non-finite steps).
        return LossScaleOptimizer(optimizer, static_scale=1.0, gradient_clipping=clip, **extra)
    return optimizer if clip is None else _copy_with_clipping(optimizer, clip)


def _accumulation_steps(settings: Config, replicas: int) -> int | None:
    """Micro-batches per optimizer step, inferred as DeepSpeed does when batch sizes are given."""
    steps = settings.gradient_accumulation_steps
    if settings.train_batch_size is not None or settings.micro_batch_size is not None:
        _, _, steps = resolve_batch_sizes(settings, world_size=replicas)
    if steps == 1 and settings.gradient_accumulation_steps is None:
        return None  # inferred 1: no accumulation machinery
    return steps


def _with_overrides(settings: Config, overrides: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    known = _SCALE_FIELDS + _TOP_FIELDS + _OPTIMIZER_FIELDS
    problems = [
        Problem(values.key_name(name), f"one of {', '.join(known)}", value, did_you_mean(name, known))
        for name, value in overrides.items()
        if name not in known
    ]
    check(problems, "kmp.wrap arguments")
    scale = {k: v for k, v in overrides.items() if k in _SCALE_FIELDS}
    top = {k: v for k, v in overrides.items() if k in _TOP_FIELDS}
    extra = {k: v for k, v in overrides.items() if k in _OPTIMIZER_FIELDS}
    # Checked here too: a plain optimizer (no loss scaling needed) would not check them.
    for name in ("fused", "log_overflows"):
        if name in extra:
            values.boolean(name, extra[name], problems)
    if extra.get("communication") is not None:
        extra["communication"], more = communication_of(extra["communication"])
        problems += more
    loss_scale, more = attempt(lambda: dataclasses.replace(settings.loss_scale, **scale), settings.loss_scale)
    settings, even_more = attempt(lambda: dataclasses.replace(settings, loss_scale=loss_scale, **top), settings)
    check(problems + more + even_more, "kmp.wrap settings")
    return settings, extra


def _as_optimizer(optimizer) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        check([Problem(
            "optimizer", "an optimizer without loss scaling", type(optimizer).__name__,
            "It is already a LossScaleOptimizer: wrap its `inner_optimizer`, or use it as it is.",
        )], "kmp.wrap arguments")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    if isinstance(optimizer, str):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError:
            pass
    check([Problem(
        "optimizer", "a keras.optimizers.Optimizer or a name such as 'adamw', 'adam', 'sgd'", optimizer,
    )], "kmp.wrap arguments")


def _choose_precision(precision, settings: Config) -> Precision:
    if precision is not None:
        return resolve_precision(precision)
    policy = resolve_precision(keras.config.dtype_policy())
    if settings.precision == "fp32":
        return policy
    chosen = resolve_precision(settings)
    if chosen.compute_dtype != policy.compute_dtype:
        warnings.warn(
            f"The config asks for {settings.precision} but the global Keras policy computes in "
            f"{policy.compute_dtype}, so layers built now will not use {chosen.compute_dtype}. "
            f"Set the policy before building the model: kmp.set_precision({str(chosen)!r}).",
            stacklevel=3,
        )
    return chosen


def _clipping_to_add(optimizer: keras.optimizers.Optimizer, clip: float | None) -> float | None:
    """The global-norm clip kmp must add, or None (none asked, or the optimizer already clips so)."""
    if clip is None:
        return None
    already = own_clipping(optimizer)
    if already == {"global_clipnorm": clip}:
        return None
    if already:
        name, value = next(iter(already.items()))
        check([Problem(
            "gradient_clipping", f"unset, since the optimizer already clips ({name}={value})", clip,
            "Set clipping in one place: the config or the optimizer.",
        )], "kmp.wrap settings")
    return clip


def _copy_with_clipping(optimizer: keras.optimizers.Optimizer, clip: float) -> keras.optimizers.Optimizer:
    """A copy of the user's (unbuilt) optimizer with `global_clipnorm=clip`; the original is untouched."""
    if optimizer.built:
        check([Problem(
            "optimizer", "an optimizer not built yet, when the config adds gradient_clipping", "a built optimizer",
            f"Its state would be lost in a copy: set global_clipnorm={clip} on it yourself.",
        )], "kmp.wrap arguments")
    return type(optimizer).from_config({**optimizer.get_config(), "global_clipnorm": clip})
