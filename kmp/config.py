"""Typed kmp settings with validation. Imports no TensorFlow.

`LossScaleConfig` holds the loss-scaling contract's settings
(../shared/spec/loss-scaling.md); its defaults are those of a
`kmp.LossScaleOptimizer` constructed in Python (Keras's). `Config` holds a
whole training setup; `kmp.deepspeed` fills it from a DeepSpeed-style JSON file
with DeepSpeed's defaults instead.

Every `problems()` method returns all problems at once, each with its key
path, so one error can list them together.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kmp.errors import Problem, check, did_you_mean

GrowthRule = Literal["every_window", "after_window"]
PrecisionName = Literal["fp32", "fp16", "bf16"]

StrategyName = Literal["auto", "default", "mirrored", "multi_worker_mirrored", "tpu"]

GROWTH_RULES: tuple[str, ...] = get_args(GrowthRule)
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
STRATEGIES: tuple[str, ...] = get_args(StrategyName)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number(path: str, value: Any, out: list[Problem]) -> bool:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        out.append(Problem(path, "a finite number > 0", value))
        return False
    return True


def _int_at_least(path: str, value: Any, low: int, out: list[Problem]) -> None:
    if not _is_int(value) or value < low:
        out.append(Problem(path, f"an integer >= {low}", value))


def _bool(path: str, value: Any, out: list[Problem]) -> None:
    if not isinstance(value, bool):
        out.append(Problem(path, "true or false", value))


def _choice(path: str, value: Any, choices: tuple[str, ...], out: list[Problem]) -> None:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        out.append(Problem(path, f"one of {options}", value, hint))


@dataclass(frozen=True)
class LossScaleConfig:
    """Settings of dynamic (or static) loss scaling; see the spec's table.

    `static_scale=None` means dynamic. Key paths in errors are
    `<prefix><field>`, so a DeepSpeed loader can report its own paths.
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

    @property
    def dynamic(self) -> bool:
        return self.static_scale is None

    def problems(self, paths: dict[str, str] | None = None) -> list[Problem]:
        """All invalid fields. `paths` renames fields (e.g. to JSON keys)."""
        p = {f.name: f.name for f in dataclasses.fields(self)} | (paths or {})
        out: list[Problem] = []
        ok_min = _positive_number(p["min_scale"], self.min_scale, out)
        ok_max = _positive_number(p["max_scale"], self.max_scale, out)
        if ok_min and ok_max and self.min_scale > self.max_scale:
            out.append(Problem(p["min_scale"], f"a value <= {p['max_scale']}={self.max_scale!r}", self.min_scale))
        if _positive_number(p["initial_scale"], self.initial_scale, out) and ok_min and ok_max:
            if not self.min_scale <= self.initial_scale <= self.max_scale:
                out.append(Problem(
                    p["initial_scale"],
                    f"a value between {p['min_scale']}={self.min_scale!r} and {p['max_scale']}={self.max_scale!r}",
                    self.initial_scale,
                ))
        _int_at_least(p["dynamic_growth_steps"], self.dynamic_growth_steps, 1, out)
        _int_at_least(p["hysteresis"], self.hysteresis, 1, out)
        _bool(p["consecutive_hysteresis"], self.consecutive_hysteresis, out)
        _bool(p["raise_at_min_scale"], self.raise_at_min_scale, out)
        _choice(p["growth_rule"], self.growth_rule, GROWTH_RULES, out)
        if self.static_scale is not None:
            _positive_number(p["static_scale"], self.static_scale, out)
        if not _is_number(self.growth_factor) or not math.isfinite(self.growth_factor) or self.growth_factor <= 1:
            out.append(Problem(p["growth_factor"], "a finite number > 1", self.growth_factor))
        if not _is_number(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            out.append(Problem(p["backoff_factor"], "a number between 0 and 1 (exclusive)", self.backoff_factor))
        return out

    def validated(self, source: str = "loss-scale settings") -> "LossScaleConfig":
        check(self.problems(), source)
        return self


COMMUNICATION_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Communication:
    """How gradients cross replicas (kmp.communication): float32, one bucket, no extra factor by default."""

    dtype: str = "float32"
    bytes_per_pack: int = 0
    predivide_factor: float | None = None

    def problems(self, prefix: str = "") -> list[Problem]:
        out = []
        if self.dtype not in COMMUNICATION_DTYPES:
            out.append(Problem(f"{prefix}dtype", f"one of {', '.join(COMMUNICATION_DTYPES)}", self.dtype))
        if not _is_int(self.bytes_per_pack) or self.bytes_per_pack < 0:
            out.append(Problem(f"{prefix}bytes_per_pack", "an integer >= 0 (0: one bucket)", self.bytes_per_pack))
        f = self.predivide_factor
        if f is not None and (not _is_number(f) or not math.isfinite(f) or f <= 0):
            out.append(Problem(f"{prefix}predivide_factor", "None or a finite number > 0", f))
        return out

    def validated(self, source: str = "kmp communication settings") -> "Communication":
        check(self.problems(), source)
        return self


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

    def problems(self, paths: dict[str, str] | None = None) -> list[Problem]:
        p = {f.name: f.name for f in dataclasses.fields(self)} | (paths or {})
        out: list[Problem] = []
        _choice(p["precision"], self.precision, PRECISIONS, out)
        _choice(p["strategy"], self.strategy, STRATEGIES, out)
        _choice(p["communication_data_type"], self.communication_data_type, COMMUNICATION_DTYPES, out)
        if self.prescale_gradients is not None:
            _bool(p["prescale_gradients"], self.prescale_gradients, out)
        if self.gradient_predivide_factor is not None:
            _positive_number(p["gradient_predivide_factor"], self.gradient_predivide_factor, out)
        _int_at_least(p["allreduce_bytes_per_pack"], self.allreduce_bytes_per_pack, 0, out)
        if self.gradient_clipping is not None:
            _positive_number(p["gradient_clipping"], self.gradient_clipping, out)
        for name in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(p[name], value, 1, out)
        # Loss-scale fields are reported as "loss_scale.<field>" unless the
        # caller maps them (a DeepSpeed file reports "fp16.<key>").
        scale_paths = {f.name: f"loss_scale.{f.name}" for f in dataclasses.fields(LossScaleConfig)}
        scale_paths |= {k[len("loss_scale."):]: v for k, v in p.items() if k.startswith("loss_scale.")}
        return out + self.loss_scale.problems(scale_paths)

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

    def validated(self, source: str = "kmp config") -> "Config":
        check(self.problems(), source)
        return self
