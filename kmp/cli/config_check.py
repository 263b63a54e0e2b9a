"""`kmp config check FILE`: what a DeepSpeed config resolves to in kmp, as a table; no training.

Exit code 0 when the file loads and its batch sizes agree for the given
replicas, 1 otherwise (for CI). Pure Python: reading the file, the optimizer
table and the schedule's sample learning rates import no TensorFlow.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

from kmp.config import optimizer_block
from kmp.config.deepspeed import load_config, resolve_batch_sizes
from kmp.errors import ConfigError
from kmp.schedules import formulas

_POLICIES = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


def check(path: str, *, replicas: int = 1, strict: bool = False, **fills: Any) -> tuple[str, int]:
    """(the report, the exit code) for the config at `path`; `fills` as kmp.load_config's."""
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            config = load_config(path, strict=strict, replicas=replicas, **fills)
            schedule = _schedule(config)  # its notes are load_config's too: each is shown once, below
    except ConfigError as error:
        return f"kmp config check: {path}\n{error}", 1
    rows: list[tuple[str, str]] = [("precision", f"{config.precision} ({_POLICIES[config.precision]})")]
    rows.append(("loss scaling", _loss_scaling(config)))
    rows.append(("clipping", f"global norm {config.gradient_clipping:g}" if config.gradient_clipping else "none"))
    rows += _optimizer(config)
    rows += schedule
    code = 0
    try:
        train, micro, steps = resolve_batch_sizes(config, world_size=replicas)
        accumulation = "no accumulation" if steps == 1 else f"accumulation over {steps} micro-batches"
        rows.append(("batch", f"train_batch_size {train} = micro {micro} x {steps} x {replicas} replicas "
                              f"({accumulation}); feed fit() batch_size={micro * replicas}"))
    except ConfigError as error:
        if config.train_batch_size is None and config.micro_batch_size is None:
            rows.append(("batch", "not given (fit()'s batch_size is the global batch)"))
        else:
            rows.append(("batch", "INVALID: " + "; ".join(f"{p.expected}, received {p.received}. {p.fix}"
                                                            for p in error.problems)))
            code = 1
    communication = config.communication()
    rows.append(("all-reduce", f"{communication.dtype}, " + (
        "one bucket" if not communication.bytes_per_pack else f"buckets of {communication.bytes_per_pack} bytes")
        + ("" if communication.predivide_factor is None else f", predivide factor {communication.predivide_factor:g}")))
    if printed.getvalue().strip():
        rows.append(("'auto' filled", "\n".join(printed.getvalue().strip().splitlines()[1:]).strip()))
    for note in dict.fromkeys(str(warning.message) for warning in caught):
        rows.append(("note", note))
    width = max(len(name) for name, _ in rows)
    lines = [f"kmp config check: {path}"]
    for name, text in rows:
        first, *rest = str(text).splitlines() or [""]
        lines.append(f"  {name:<{width}}  {first}")
        lines += [f"  {'':<{width}}  {line.strip()}" for line in rest]
    lines.append("OK" if code == 0 else "FAILED")
    return "\n".join(lines), code


def _loss_scaling(config) -> str:
    if config.precision != "fp16":
        return f"none ({config.precision} needs no loss scaling)"
    s = config.loss_scale
    if not s.dynamic:
        return f"static, scale {s.static_scale:g}"
    return (f"dynamic: initial {s.initial_scale:g}, window {s.dynamic_growth_steps}, hysteresis {s.hysteresis}"
            f"{' (consecutive)' if s.consecutive_hysteresis else ''}, min {s.min_scale:g}, max {s.max_scale:g}, "
            f"growth {s.growth_rule}")


def _optimizer(config) -> list[tuple[str, str]]:
    if config.optimizer is None:
        return [("optimizer", "none in the file: pass one to kmp.wrap")]
    name, args, notes = optimizer_block.keras_arguments(config.optimizer)
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in args.items() if v is not None)
    rows = [("optimizer", f"{config.optimizer.type} -> keras.optimizers.{name}({shown})")]
    rows += [("", f"differs: {note}") for note in notes]
    return rows


def _schedule(config) -> list[tuple[str, str]]:
    if config.scheduler is None:
        return [("schedule", "none (the optimizer's learning rate)")]
    spec = config.optimizer
    base = spec.params["lr"] if spec is not None else None
    betas = spec.params.get("betas") if spec is not None else None
    try:
        schedule = formulas.parse_scheduler(config.scheduler, base_lr=base,
                                             base_momentum=betas[0] if betas else None)
    except ConfigError as error:
        return [("schedule", f"{config.scheduler['type']}: needs {error.problems[0].fix}")]
    samples = ", ".join(f"{k}: {schedule.lr_at(k):.4g}" for k in schedule.milestones())
    rows = [("schedule", f"{schedule.type}; lr at update k -> {samples}")]
    if schedule.cycles_momentum:
        moms = ", ".join(f"{k}: {schedule.momentum_at(k):.4g}" for k in schedule.milestones())
        rows.append(("", f"beta_1 at update k -> {moms}; beta_2 0.99"))
    return rows
