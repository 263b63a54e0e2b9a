"""kmp.wrap: one call that returns the optimizer right for the precision.

    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), ...)

float16 compute gets a configured `kmp.LossScaleOptimizer`. bfloat16 and
float32 need no loss scaling: on one device, without accumulation,
clipping or ZeRO, they get the optimizer itself. Under a strategy with several
replicas (call `wrap` inside `strategy.scope()`, as Keras requires for
optimizers), with gradient accumulation, clipping or `zero_stage` (wherever
`wrap` is called) they get kmp's optimizer with a static scale of 1, so that
gradients are all-reduced once before they are clipped, and non-finite
steps are skipped.

Precision comes from, in order: `precision=`, the config's `fp16`/`bf16`
block when one is enabled, the active global Keras policy. `wrap` never
changes the global policy.

`wrap` never changes the optimizer it is given. Clipping (DeepSpeed's
`gradient_clipping`, a global-norm clip) is done by kmp's optimizer, after the
all-reduce. A config's `scheduler` block is set on a copy (`from_config`), as
its `learning_rate` (and, for OneCycle, its beta_1: kmp.schedules.momentum).

With no optimizer, `wrap` builds the one the config's `optimizer` block
names (kmp.config.optimizer_block); Hugging Face's "auto" values are filled from the
optimizer, the policy, the strategy and the arguments (kmp.config.auto).
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from typing import Any

import keras
import tensorflow as tf

from kmp import values
from kmp.config import auto, optimizer_block
from kmp.config.deepspeed import read_config, resolve_batch_sizes, zero_stage_note
from kmp.config.settings import Config, LossScaleConfig, attempt, communication_of
from kmp.errors import Problem, check, did_you_mean
from kmp.precision import Precision, resolve_precision
from kmp.scaling.eight_bit import with_states
from kmp.scaling.optimizer import FORWARD_OVERFLOW, LossScaleOptimizer, own_clipping
from kmp.schedules.keras import build_schedule
from kmp.schedules.momentum import with_momentum_schedule

_SCALE_FIELDS = tuple(f.name for f in dataclasses.fields(LossScaleConfig))
_TOP_FIELDS = ("gradient_clipping", "gradient_accumulation_steps", "train_batch_size", "micro_batch_size",
               "wall_clock_breakdown", "steps_per_print", "zero_stage")
_OPTIMIZER_FIELDS = ("log_overflows", "forward_overflow", "fused", "communication")
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def wrap(optimizer=None, config=None, *, precision=None, strict=False, total_steps=None, warmup_steps=None,
         states="32bit", **overrides):
    """The optimizer to compile with, for the given or active precision.

    Args:
        optimizer: a `keras.optimizers.Optimizer`, a name Keras knows
            ("adamw"), or None to build the one the config's `optimizer`
            block names (kmp.config.optimizer_block). A passed optimizer wins over the
            block; one warning lists the block's params it does not match.
        config: a `kmp.Config`; a DeepSpeed-style config as a dict, a JSON
            file path or a JSON string (see `kmp.load_config`); or the
            argparse namespace of `kmp.add_config_arguments`.
        precision: any spelling `kmp.resolve_precision` accepts; overrides
            the config and the global policy for this optimizer only.
        strict: unknown top-level config keys are errors, not a warning.
        total_steps, warmup_steps: fill the scheduler's "auto" step counts.
        states: "8bit" stores Adam's and AdamW's moments block-wise
            quantized (kmp.Adam8bit, kmp.AdamW8bit; docs/eight-bit.md).
        **overrides: loss-scale settings (`hysteresis=2`, `min_scale=...`,
            any `kmp.LossScaleOptimizer` argument), `gradient_clipping`,
            `gradient_accumulation_steps`, `train_batch_size`,
            `micro_batch_size` (these also fill "auto" values),
            `forward_overflow` ("raise", "float32", "backoff": what a float16
            layer whose forward output overflows does; docs/loss-scaling.md),
            `overflow` ("skip", the default, or "replay": an overflowing
            step recomputed at the lowered scale and applied; needs
            kmp.prepare(model); docs/loss-scaling.md),
            `wall_clock_breakdown` and `steps_per_print` (DeepSpeed's
            timers, applied by `kmp.prepare(model)`: kmp.engine.wall_clock),
            `zero_stage=1` (the optimizer state sharded across replicas on
            kmp.prepare's flat buffers: docs/zero.md).

    Batch sizes (`train_batch_size`, `train_micro_batch_size_per_gpu`,
    `gradient_accumulation_steps`) are completed and checked as DeepSpeed
    does, with the strategy's replicas as its world size; more than one
    micro-batch per step turns on kmp's accumulation. Feed `fit()` the
    micro-batch: `batch_size = micro * replicas`. The config's `scheduler`
    block becomes the optimizer's learning rate (kmp.schedules.formulas).
    """
    if isinstance(config, argparse.Namespace):
        config, precision, strict, total_steps, warmup_steps, overrides = _from_namespace(
            config, precision, strict, total_steps, warmup_steps, overrides)
    if optimizer is not None:
        optimizer = _as_optimizer(optimizer)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    policy = resolve_precision(precision if precision is not None else keras.config.dtype_policy())
    if isinstance(config, Config):
        settings = config
    elif config is None:
        settings = Config()
    else:
        given = _given(optimizer, policy, precision, overrides, replicas, total_steps, warmup_steps)
        settings = read_config(config, strict=strict, given=given, stacklevel=3)
    settings, extra = _with_overrides(settings, overrides)
    if overrides.get("zero_stage", 0) > 1:  # a config's stage is said by kmp.config.deepspeed
        warnings.warn(zero_stage_note("zero_stage", overrides["zero_stage"]), UserWarning, stacklevel=2)
    optimizer = with_states(_optimizer_for(optimizer, settings), states)
    chosen = _choose_precision(precision, settings)
    clip = _clipping_to_add(optimizer, settings.gradient_clipping)
    steps = _accumulation_steps(settings, replicas, asked="gradient_accumulation_steps" in overrides)
    if steps is not None:
        extra["gradient_accumulation_steps"] = steps
    extra.setdefault("communication", settings.communication())
    if settings.zero_stage:
        extra["zero_stage"] = 1  # stages 2 and 3 load as stage 1 (said above, or by kmp.config.deepspeed)
        if replicas == 1:
            warnings.warn("kmp.wrap was called outside a strategy's scope (one replica): zero_stage=1 shards the "
                          "optimizer state once the model is compiled and trained under a strategy of several "
                          "replicas; on one device its one shard is the whole state.", UserWarning, stacklevel=2)
    if chosen.needs_loss_scaling:
        wrapped = LossScaleOptimizer(optimizer, loss_scale=settings.loss_scale, gradient_clipping=clip, **extra)
    elif replicas > 1 or steps is not None or clip is not None or settings.zero_stage or chosen.name == "bfloat16":
        # Keras clips each replica's local gradient before its all-reduce (and
        # wrap, called outside strategy.scope(), cannot know the replicas),
        # and its own accumulation fails under tf.distribute. kmp's optimizer
        # does both right; a static scale of 1 is that pipeline without
        # scaling, and it skips non-finite steps. zero_stage, wherever wrap is called: its shards are made in
        # the scope the model trains in. bfloat16 weights: kmp.prepare's flat buffers train them from float32
        # masters, with kmp's optimizer.
        wrapped = LossScaleOptimizer(optimizer, static_scale=1.0, gradient_clipping=clip, **extra)
    elif (settings.wall_clock_breakdown or settings.activation_checkpointing
          or settings.lower_precision_safe_modules is not None):
        # A copy, unless built (its state would be lost): then the attributes below are set on it.
        wrapped = optimizer if optimizer.built else _copy_with(optimizer)
    else:
        return optimizer
    # Read by kmp.prepare (kmp.engine.wall_clock, kmp.engine.recompute, kmp.engine.lower_precision): run settings, not saved with the optimizer.
    if settings.wall_clock_breakdown:
        wrapped.kmp_wall_clock_breakdown = settings.steps_per_print or True
    if settings.activation_checkpointing:
        wrapped.kmp_activation_checkpointing = True
    if settings.lower_precision_safe_modules is not None:  # kmp.engine.lower_precision
        wrapped.kmp_lower_precision_safe_modules = settings.lower_precision_safe_modules
    return wrapped


def _given(optimizer, policy: Precision, precision, overrides, replicas, total_steps, warmup_steps) -> auto.Given:
    """What fills a config's "auto" values (kmp.config.auto)."""
    source = "precision=" if precision is not None else f"the active Keras policy {policy}"
    fills: dict[str, Any] = {"precision": _SHORT[policy.compute_dtype], "precision_source": source,
                             "world_size": replicas, "total_steps": total_steps, "warmup_steps": warmup_steps}
    for name in ("micro_batch_size", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping"):
        fills[name] = overrides.get(name)
    if optimizer is not None:
        fills["optimizer"] = _deepspeed_params(optimizer)
        fills["optimizer_source"] = f"the {type(optimizer).__name__} passed to kmp.wrap"
        if fills["gradient_clipping"] is None:
            fills["gradient_clipping"] = optimizer.global_clipnorm or 0
            fills["clipping_source"] = f"the {type(optimizer).__name__}'s global_clipnorm"
    return auto.Given(**fills)


def _deepspeed_params(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """The optimizer's settings under DeepSpeed's param names (what "auto" in optimizer.params is filled from)."""
    lr = optimizer._learning_rate
    out = {"lr": float(lr.numpy()) if hasattr(lr, "numpy") else lr if values.is_number(lr) else None,
           "weight_decay": optimizer.weight_decay or 0.0}
    if hasattr(optimizer, "beta_1") and hasattr(optimizer, "beta_2"):
        out["betas"] = [optimizer.beta_1, optimizer.beta_2]
    if hasattr(optimizer, "epsilon"):
        out["eps"] = optimizer.epsilon
    return out


def _optimizer_for(optimizer, settings: Config) -> keras.optimizers.Optimizer:
    """The passed optimizer, or the config's; with the config's schedule as its learning rate."""
    spec = settings.optimizer
    if optimizer is None and spec is None:
        check([Problem("optimizer", "an optimizer, or a config with an optimizer block", None,
                       'E.g. kmp.wrap(keras.optimizers.AdamW(1e-3), config), or {"optimizer": {"type": "AdamW", '
                       '"params": {"lr": 1e-3}}} in the config.')], "kmp.wrap arguments")
    if optimizer is not None and spec is not None:
        differ = optimizer_block.differences(spec, optimizer)
        if differ:
            warnings.warn(f"kmp.wrap uses the {type(optimizer).__name__} it was given, not the config's optimizer "
                          f"block ({spec.type}), which differs in: {'; '.join(differ)}.", UserWarning, stacklevel=4)
    if settings.scheduler is None:
        return optimizer if optimizer is not None else optimizer_block.build_optimizer(spec)
    base_lr = float(spec.params["lr"]) if optimizer is None else _deepspeed_params(optimizer)["lr"]
    if base_lr is None:
        check([Problem("optimizer.learning_rate", "a number, when the config has a scheduler block",
                       "a schedule", "Set the schedule in one place: the config's scheduler block or the "
                       "optimizer.")], "kmp.wrap arguments")
    beta_1 = spec.params.get("betas", (None,))[0] if optimizer is None else getattr(optimizer, "beta_1", None)
    schedule, momentum = build_schedule(settings.scheduler, base_lr=base_lr,
                                        base_momentum=beta_1 if values.is_number(beta_1) else None)
    if optimizer is None:
        optimizer = optimizer_block.build_optimizer(spec, learning_rate=schedule)
    else:
        optimizer = _copy_with(optimizer, learning_rate=schedule)
    if momentum is not None:
        cycled = with_momentum_schedule(optimizer, momentum)
        if cycled is None:  # as DeepSpeed's OneCycle, which cycles only betas
            warnings.warn(f"cycle_momentum is disabled because {type(optimizer).__name__} has no betas "
                          "(DeepSpeed's OneCycle does the same): only the learning rate follows the schedule.",
                          UserWarning, stacklevel=4)
        optimizer = cycled or optimizer
    return optimizer


def _accumulation_steps(settings: Config, replicas: int, asked: bool) -> int | None:
    """Micro-batches per optimizer step, inferred as DeepSpeed does when batch sizes are given.

    `asked`: `gradient_accumulation_steps=` passed to wrap, which turns the
    machinery on at any value, even 1 (what GradientAccumulationScheduler
    needs to change it later).
    """
    steps = settings.gradient_accumulation_steps
    if settings.train_batch_size is not None or settings.micro_batch_size is not None:
        _, _, steps = resolve_batch_sizes(settings, world_size=replicas)
    # One micro-batch per step from a config (11 of the corpus's files spell
    # it out) is no accumulation: an extra float32 copy of every parameter
    # would buy nothing.
    return None if steps == 1 and not asked else steps


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
    if "forward_overflow" in extra:
        values.choice("forward_overflow", extra["forward_overflow"], FORWARD_OVERFLOW, problems)
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
    policy = resolve_precision(keras.config.dtype_policy())
    if precision is not None:
        chosen = resolve_precision(precision)
        asked = f"kmp.wrap was given precision {chosen}"
    elif settings.precision == "fp32":
        return policy
    else:
        chosen, asked = resolve_precision(settings), f"The config asks for {settings.precision}"
    # The optimizer follows `chosen`; the model's layers follow the global policy.
    if chosen.compute_dtype != policy.compute_dtype:
        warnings.warn(
            f"{asked} but the global Keras policy computes in {policy.compute_dtype}, so layers built now will not "
            f"use {chosen.compute_dtype}. Set the policy before building the model: "
            f"kmp.set_precision({str(chosen)!r}).",
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


def _copy_with(optimizer: keras.optimizers.Optimizer, **changes: Any) -> keras.optimizers.Optimizer:
    """A copy of the user's (unbuilt) optimizer with `changes`; the original is untouched."""
    if optimizer.built:
        what = ", ".join(f"{k}={v!r}" if values.is_number(v) else f"{k}=..." for k, v in changes.items())
        check([Problem(
            "optimizer", "an optimizer not built yet, when the config changes it", "a built optimizer",
            f"Its state would be lost in a copy: set {what} on it yourself.",
        )], "kmp.wrap arguments")
    config = optimizer.get_config()
    if "learning_rate" in changes:
        changes["learning_rate"] = keras.optimizers.schedules.serialize(changes["learning_rate"])
    return type(optimizer).from_config({**config, **changes})


def _from_namespace(args: argparse.Namespace, precision, strict, total_steps, warmup_steps, overrides):
    """The values `kmp.add_config_arguments` parsed, under wrap's names; explicit arguments win."""
    read = vars(args)
    config = read.get("kmp_config")
    precision = precision if precision is not None else read.get("precision")
    strict = strict or bool(read.get("strict_config"))
    total_steps = total_steps if total_steps is not None else read.get("total_steps")
    warmup_steps = warmup_steps if warmup_steps is not None else read.get("warmup_steps")
    overrides = dict(overrides)
    for name in ("micro_batch_size", "gradient_accumulation_steps"):
        if read.get(name) is not None:
            overrides.setdefault(name, read[name])
    return config, precision, strict, total_steps, warmup_steps, overrides
