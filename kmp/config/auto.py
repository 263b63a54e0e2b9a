"""Hugging Face's "auto" values in a DeepSpeed config, filled from what kmp is given.

Hugging Face and accelerate ship their DeepSpeed templates with "auto"
values, which their Trainer fills from its TrainingArguments
(transformers/integrations/deepspeed.py, `HfTrainerDeepSpeedConfig`:
`trainer_config_process` and `trainer_config_finalize`). kmp has no
TrainingArguments; `kmp.wrap` fills the same keys from what it is given:

    fp16.enabled, bf16.enabled           precision= or the active Keras policy
    optimizer.params.lr/betas/eps/weight_decay
                                         the optimizer passed to kmp.wrap
    gradient_clipping                    gradient_clipping=, else that optimizer's global_clipnorm (none: 0)
    train_micro_batch_size_per_gpu       micro_batch_size=
    gradient_accumulation_steps          gradient_accumulation_steps=, else inferred, else 1 (HF's default)
    train_batch_size                     train_batch_size=, else micro * accumulation * replicas (as HF)
    scheduler.params.warmup_min_lr       0 (as HF)
    scheduler.params.warmup_max_lr       the optimizer's learning rate (as HF: learning_rate)
    scheduler.params.total_num_steps     total_steps=
    scheduler.params.warmup_num_steps    warmup_steps=

"auto" under blocks kmp does not act on (zero_optimization, ...) stays as
it is; anywhere else it is an error. Every key that cannot be filled is
named, with the argument that fills it, in one ConfigError. Pure Python.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kmp.errors import Problem

AUTO = "auto"


@dataclass(frozen=True)
class Given:
    """What kmp knows besides the file. None: not given."""

    precision: str | None = None  # "fp32", "fp16" or "bf16"
    precision_source: str = "precision="
    optimizer: Mapping[str, Any] | None = None  # DeepSpeed names: lr, betas, eps, weight_decay
    optimizer_source: str = "the optimizer passed to kmp.wrap"
    gradient_clipping: float | None = None  # 0: none
    clipping_source: str = "gradient_clipping="
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    world_size: int | None = None
    total_steps: int | None = None
    warmup_steps: int | None = None


class _Missing:
    def __init__(self, how: str):
        self.how = how


def _precision(name: str) -> Callable[[Given, dict], Any]:
    def fill(given: Given, raw: dict):
        if given.precision is None:
            return _Missing("precision= (kmp.wrap, kmp.load_config, --precision), or call kmp.wrap, which reads "
                            "the active Keras policy")
        return given.precision == name, given.precision_source

    return fill


def _optimizer_param(param: str) -> Callable[[Given, dict], Any]:
    def fill(given: Given, raw: dict):
        if given.optimizer is None or given.optimizer.get(param) is None:
            return _Missing("an optimizer passed to kmp.wrap (its value is used), or write the value")
        return given.optimizer[param], given.optimizer_source

    return fill


def _clipping(given: Given, raw: dict):
    if given.gradient_clipping is None:
        return _Missing("gradient_clipping= (0 for none), or an optimizer passed to kmp.wrap")
    return given.gradient_clipping, given.clipping_source


def _micro(given: Given, raw: dict):
    if given.micro_batch_size is None:
        return _Missing("micro_batch_size= (the batch one replica sees per step)")
    return given.micro_batch_size, "micro_batch_size="


def _accumulation(given: Given, raw: dict):
    if given.gradient_accumulation_steps is not None:
        return given.gradient_accumulation_steps, "gradient_accumulation_steps="
    if _number(raw.get("train_batch_size")) and _number(raw.get("train_micro_batch_size_per_gpu")):
        return None, "inferred from the batch sizes, as DeepSpeed does"  # None: leave the key out
    return 1, "Hugging Face's default (gradient_accumulation_steps= changes it)"


def _train_batch(given: Given, raw: dict):
    if given.train_batch_size is not None:
        return given.train_batch_size, "train_batch_size="
    micro, steps = raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps", 1)
    if _number(micro) and _number(steps) and given.world_size is not None:
        return micro * steps * given.world_size, (
            f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * replicas ({given.world_size})")
    if _number(micro):
        return None, "inferred from train_micro_batch_size_per_gpu, as DeepSpeed does"
    return _Missing("train_batch_size=, or micro_batch_size=")


def _warmup_max(given: Given, raw: dict):
    lr = (given.optimizer or {}).get("lr")
    if lr is None:
        lr = ((raw.get("optimizer") or {}).get("params") or {}).get("lr")
    if not _number(lr):
        return _Missing("an optimizer passed to kmp.wrap (its learning rate), or write the value")
    return lr, "the optimizer's learning rate (as Hugging Face: learning_rate)"


def _steps(name: str, argument: str) -> Callable[[Given, dict], Any]:
    def fill(given: Given, raw: dict):
        value = getattr(given, name)
        if value is None:
            return _Missing(f"{argument} (kmp.wrap, kmp.load_config, --{argument.rstrip('=').replace('_', '-')})")
        return value, argument

    return fill


# In the order they are filled (train_batch_size after what it is computed
# from): key path -> (the fill, where the value comes from, for the docs).
FILLS: dict[str, tuple[Callable[[Given, dict], Any], str]] = {
    "fp16.enabled": (_precision("fp16"), "`precision=`, else the active Keras policy"),
    "bf16.enabled": (_precision("bf16"), "`precision=`, else the active Keras policy"),
    "bfloat16.enabled": (_precision("bf16"), "as bf16.enabled (bfloat16 is the bf16 block's old name)"),
    "optimizer.params.lr": (_optimizer_param("lr"), "the optimizer passed to `kmp.wrap`"),
    "optimizer.params.betas": (_optimizer_param("betas"), "the optimizer passed to `kmp.wrap` (beta_1, beta_2)"),
    "optimizer.params.eps": (_optimizer_param("eps"), "the optimizer passed to `kmp.wrap` (epsilon)"),
    "optimizer.params.weight_decay": (_optimizer_param("weight_decay"), "the optimizer passed to `kmp.wrap`"),
    "gradient_clipping": (_clipping, "`gradient_clipping=`, else the passed optimizer's global_clipnorm (none: 0)"),
    "train_micro_batch_size_per_gpu": (_micro, "`micro_batch_size=`"),
    "gradient_accumulation_steps": (_accumulation, "`gradient_accumulation_steps=`, else inferred from the "
                                                   "batch sizes, else 1 (Hugging Face's default)"),
    "train_batch_size": (_train_batch, "`train_batch_size=`, else micro x accumulation x replicas (as Hugging Face)"),
    "scheduler.params.warmup_min_lr": (lambda given, raw: (0, "Hugging Face's default"), "0 (as Hugging Face)"),
    "scheduler.params.warmup_max_lr": (_warmup_max, "the optimizer's learning rate (as Hugging Face)"),
    "scheduler.params.total_num_steps": (_steps("total_steps", "total_steps="), "`total_steps=`"),
    "scheduler.params.warmup_num_steps": (_steps("warmup_steps", "warmup_steps="), "`warmup_steps=`"),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def auto_paths(raw: Any, prefix: str = "") -> list[str]:
    """Every key path whose value is "auto", in file order."""
    if not isinstance(raw, Mapping):
        return []
    out = []
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value == AUTO:
            out.append(path)
        elif isinstance(value, Mapping):
            out += auto_paths(value, path + ".")
    return out


def fill_auto(raw: Mapping[str, Any], given: Given, ignored_blocks: tuple[str, ...], keep: tuple[str, ...] = ()
              ) -> tuple[dict[str, Any], list[tuple[str, Any, str]], list[Problem]]:
    """(the config with "auto" filled, [(key path, value, where it came from)], problems).

    A fill of None removes the key (DeepSpeed then infers it). `keep`: paths
    where "auto" is a value of its own (kmp.strategy). The caller's dict is
    not changed.
    """
    autos = [path for path in auto_paths(raw) if path not in keep]
    if not autos:
        return dict(raw), [], []
    out = copy.deepcopy(dict(raw))
    filled, problems = [], []
    for path in autos:
        if path not in FILLS and path.split(".")[0] not in ignored_blocks:
            problems.append(Problem(path, "a value ('auto' is filled only where Hugging Face fills it)", AUTO,
                                    "kmp fills 'auto' for: " + ", ".join(FILLS) + ". Write this value."))
    for path, (fill, _) in FILLS.items():
        if path not in autos:
            continue
        result = fill(given, out)
        if isinstance(result, _Missing):
            problems.append(Problem(path, "a value, or what fills 'auto'", AUTO,
                                    f"'auto' is Hugging Face's placeholder; kmp fills it from {result.how}."))
            continue
        value, source = result
        *parents, leaf = path.split(".")
        node = out
        for parent in parents:
            node = node[parent]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
        filled.append((path, value, source))
    return out, filled, problems


def describe(filled: list[tuple[str, Any, str]], name: str) -> str:
    """The one short block `kmp.load_config` prints: each filled key, its value, and where it came from."""
    width = max(len(path) for path, _, _ in filled)
    rows = [f"  {path:<{width}}  {'(left out)' if value is None else _json(value):<10}  from {source}"
            for path, value, source in filled]
    return f"kmp: filled the 'auto' values of the {name}:\n" + "\n".join(rows)


def _json(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)
