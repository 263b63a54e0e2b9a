"""Typed kmp settings, each validated once: when it is constructed. Imports no TensorFlow.

`LossScaleConfig` holds the loss-scaling settings (docs/loss-scaling.md); its
defaults are those of a `kmp.LossScaleOptimizer` constructed in Python
(Keras's). `Communication` holds the all-reduce settings. `Config` holds a
whole training setup; `kmp.config.deepspeed` fills it from a DeepSpeed-style JSON file
with DeepSpeed's defaults instead.

An instance exists only if it is valid: construction raises one ConfigError
listing every problem, each under the field's name (`kmp.config.deepspeed` renames
them to JSON key paths). numpy scalars are stored as the Python numbers they
hold. Everything downstream takes these values as they are and checks nothing
again.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kmp import values
from kmp.config.optimizer_block import OptimizerSpec
from kmp.errors import ConfigError, Problem, check, did_you_mean

GrowthRule = Literal["every_window", "after_window"]
# What an overflowing step does (kmp.scaling.replay): skipped (DeepSpeed, Keras), or recomputed on its batch
# at the lowered scale until it is finite.
OverflowRule = Literal["skip", "replay"]
PrecisionName = Literal["fp32", "fp16", "bf16"]

StrategyName = Literal["auto", "default", "mirrored", "multi_worker_mirrored", "tpu"]

GROWTH_RULES: tuple[str, ...] = get_args(GrowthRule)
OVERFLOW_RULES: tuple[str, ...] = get_args(OverflowRule)
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
STRATEGIES: tuple[str, ...] = get_args(StrategyName)


def _validate(instance, problems: list[Problem], source: str) -> None:
    """Store numpy scalars as Python numbers, then raise if anything is wrong."""
    for f in dataclasses.fields(instance):
        object.__setattr__(instance, f.name, values.plain(getattr(instance, f.name)))
    check(problems, source)


def attempt(make, fallback, prefix: str = ""):
    """(make(), []), or (fallback, the ConfigError's problems with `prefix` on their paths).

    How a reader collects every problem of a setup before it raises one error.
    """
    try:
        return make(), []
    except ConfigError as e:
        return fallback, [dataclasses.replace(p, path=prefix + p.path) for p in e.problems]


def _named_fields(source: str):
    """Makes an unknown keyword (a misspelled field) a ConfigError with a did-you-mean, not a TypeError."""

    def decorate(cls):
        init = cls.__init__
        names = [f.name for f in dataclasses.fields(cls)]

        @functools.wraps(init)
        def __init__(self, /, *args, **kwargs):
            check([Problem(values.key_name(k), f"a field of {cls.__name__} ({', '.join(names)})", v,
                           did_you_mean(k, names)) for k, v in kwargs.items() if k not in names], source)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate


@_named_fields("loss-scale settings")
@dataclass(frozen=True)
class LossScaleConfig:
    """Settings of dynamic (or static) loss scaling (docs/loss-scaling.md).

    `static_scale=None` means dynamic. Every scale is a float32 in the
    optimizer, so each must be a normal float32 (> 0, not inf); counts are
    int64.
    """

    initial_scale: float = 2.0**15
    dynamic_growth_steps: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    raise_at_min_scale: bool = True
    growth_rule: GrowthRule = "every_window"
    static_scale: float | None = None
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    overflow: OverflowRule = "skip"

    def __post_init__(self) -> None:
        _validate(self, self._problems(), "loss-scale settings")

    @property
    def dynamic(self) -> bool:
        return self.static_scale is None

    def _problems(self) -> list[Problem]:
        out: list[Problem] = []
        ok_min = values.positive("min_scale", self.min_scale, out)
        ok_max = values.positive("max_scale", self.max_scale, out)
        if ok_min and ok_max and self.min_scale > self.max_scale:
            out.append(Problem("min_scale", f"a value <= max_scale={self.max_scale!r}", self.min_scale))
        if values.positive("initial_scale", self.initial_scale, out) and ok_min and ok_max:
            if not self.min_scale <= self.initial_scale <= self.max_scale:
                out.append(Problem(
                    "initial_scale",
                    f"a value between min_scale={self.min_scale!r} and max_scale={self.max_scale!r}",
                    self.initial_scale,
                ))
        values.int_in("dynamic_growth_steps", self.dynamic_growth_steps, 1, out)
        values.int_in("hysteresis", self.hysteresis, 1, out)
        values.boolean("consecutive_hysteresis", self.consecutive_hysteresis, out)
        values.boolean("raise_at_min_scale", self.raise_at_min_scale, out)
        values.choice("growth_rule", self.growth_rule, GROWTH_RULES, out)
        if self.static_scale is not None:
            values.positive("static_scale", self.static_scale, out)
        values.number_in("growth_factor", self.growth_factor, out, above=1)
        values.number_in("backoff_factor", self.backoff_factor, out, above=0, below=1)
        values.choice("overflow", self.overflow, OVERFLOW_RULES, out)
        return out


COMMUNICATION_DTYPES = ("float32", "float16", "bfloat16")

# A pre-divide factor multiplies every gradient by replicas / factor before
# the all-reduce: far from the replica count it overflows or underflows.
PREDIVIDE_RANGE = (2.0**-20, 2.0**20)


@_named_fields("kmp communication settings")
@dataclass(frozen=True)
class Communication:
    """How gradients cross replicas (kmp.distribute.communication): float32, one bucket, no extra factor by default."""

    dtype: str = "float32"
    bytes_per_pack: int = 0
    predivide_factor: float | None = None

    def __post_init__(self) -> None:
        out: list[Problem] = []
        values.choice("dtype", self.dtype, COMMUNICATION_DTYPES, out)
        values.int_in("bytes_per_pack", self.bytes_per_pack, 0, out, fix="0 means one bucket.")
        if self.predivide_factor is not None:
            low, high = PREDIVIDE_RANGE
            values.number_in("predivide_factor", self.predivide_factor, out, at_least=low, at_most=high,
                             fix="DeepSpeed's default is 1.0; a value near the replica count keeps sums in range.")
        _validate(self, out, "kmp communication settings")


def communication_of(value) -> tuple[Communication, list[Problem]]:
    """`value` (None, a Communication or a dict of its fields) as a Communication, and its problems."""
    if value is None:
        return Communication(), []
    if isinstance(value, Communication):
        return value, []
    if isinstance(value, dict):
        fields = sorted(f.name for f in dataclasses.fields(Communication))
        unknown = [
            Problem(f"communication.{values.key_name(k)}", f"a field of Communication ({', '.join(fields)})", v,
                    did_you_mean(k, fields) if isinstance(k, str) else "")
            for k, v in value.items() if k not in fields
        ]
        if unknown:
            return Communication(), unknown
        return attempt(lambda: Communication(**value), Communication(), "communication.")
    return Communication(), [Problem("communication", "None, a dict or a kmp.Communication", value)]


@_named_fields("kmp config")
@dataclass(frozen=True)
class Config:
    """A whole kmp training setup, as read from a DeepSpeed-style config.

    Batch sizes follow DeepSpeed's meaning: `train_batch_size` is the global
    batch per optimizer step, `micro_batch_size` the batch one replica sees
    per forward/backward pass. `None` means "not given, infer it".
    """

    precision: PrecisionName = "fp32"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    gradient_clipping: float | None = None
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    strategy: StrategyName = "auto"
    # The all-reduce (DeepSpeed's names; see communication()).
    communication_data_type: str = "float32"
    prescale_gradients: bool | None = None
    gradient_predivide_factor: float | None = None
    allreduce_bytes_per_pack: int = 0
    # The job around the precision: DeepSpeed's optimizer and scheduler
    # blocks as checked specs (kmp.config.optimizer_block, kmp.schedules.formulas; kmp.wrap builds
    # them), and the ZeRO stage asked for (kmp builds stage 1: 2 and 3 run as 1).
    optimizer: OptimizerSpec | None = None
    scheduler: Any = None  # the checked `scheduler` block, a dict
    zero_stage: int = 0
    # DeepSpeed's timers (kmp.engine.wall_clock): on through kmp.prepare; the lines every steps_per_print steps.
    wall_clock_breakdown: bool = False
    steps_per_print: int | None = None
    # DeepSpeed's activation_checkpointing block was given: on through kmp.prepare (kmp.engine.recompute).
    activation_checkpointing: bool = False
    # DeepSpeed's torch_autocast block, enabled: the torch module names whose Keras layers compute in
    # `precision`; every other layer computing on its own computes in float32 (kmp.engine.lower_precision).
    # None: no such block, every layer follows the model's policy.
    lower_precision_safe_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        out: list[Problem] = []
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            out.append(Problem("optimizer", "a kmp.config.optimizer_block.OptimizerSpec (kmp.load_config reads one)",
                               self.optimizer))
        values.int_in("zero_stage", self.zero_stage, 0, out, high=3)
        values.choice("precision", self.precision, PRECISIONS, out)
        values.choice("strategy", self.strategy, STRATEGIES, out)
        values.choice("communication_data_type", self.communication_data_type, COMMUNICATION_DTYPES, out)
        if not isinstance(self.loss_scale, LossScaleConfig):
            out.append(Problem("loss_scale", "a kmp.LossScaleConfig", self.loss_scale))
        if self.prescale_gradients is not None:
            values.boolean("prescale_gradients", self.prescale_gradients, out)
        if self.gradient_predivide_factor is not None:
            low, high = PREDIVIDE_RANGE
            values.number_in("gradient_predivide_factor", self.gradient_predivide_factor, out,
                             at_least=low, at_most=high)
        values.int_in("allreduce_bytes_per_pack", self.allreduce_bytes_per_pack, 0, out)
        if self.gradient_clipping is not None:
            values.positive("gradient_clipping", self.gradient_clipping, out)
        values.boolean("wall_clock_breakdown", self.wall_clock_breakdown, out)
        values.boolean("activation_checkpointing", self.activation_checkpointing, out)
        if self.lower_precision_safe_modules is not None:
            if isinstance(self.lower_precision_safe_modules, list):
                object.__setattr__(self, "lower_precision_safe_modules", tuple(self.lower_precision_safe_modules))
            if not (isinstance(self.lower_precision_safe_modules, tuple)
                    and all(isinstance(n, str) for n in self.lower_precision_safe_modules)):
                out.append(Problem("lower_precision_safe_modules", "a tuple of torch module names (or None)",
                                   self.lower_precision_safe_modules))
            elif self.precision == "fp32":
                out.append(Problem("lower_precision_safe_modules", "None when precision is 'fp32'",
                                   self.lower_precision_safe_modules,
                                   "They name the layers computing in fp16 or bf16: set precision to one."))
        for name in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps", "steps_per_print"):
            value = getattr(self, name)
            if value is not None:
                values.int_in(name, value, 1, out)
        _validate(self, out, "kmp config")

    def communication(self) -> Communication:
        """The all-reduce settings, with DeepSpeed's meaning of its two scaling keys.

        kmp's gradients are already divided by the replica count (through the
        loss) before the all-reduce: DeepSpeed's `prescale_gradients: true`.
        With `prescale_gradients: false` DeepSpeed divides by
        `gradient_predivide_factor` (default 1.0) before and by N/factor
        after, which kmp reproduces. When neither key is given kmp keeps its
        own order (DeepSpeed's default would be false): a different rounding
        of the same sum, and no extra pass over the gradients.
        """
        prescale = self.prescale_gradients
        if prescale is None:
            prescale = self.gradient_predivide_factor is None
        factor = None if prescale else (self.gradient_predivide_factor or 1.0)
        return Communication(self.communication_data_type, self.allreduce_bytes_per_pack, factor)
