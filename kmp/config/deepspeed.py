"""Read a DeepSpeed-style JSON config into `kmp.config.settings.Config`, and write one back.

- One table, `DEEPSPEED_KEYS`, maps each DeepSpeed key path to a Config field
  path. `load_config` and `to_deepspeed` both walk it, so a key cannot be read
  one way and written another: `load_config(to_deepspeed(c)) == c`.
- Checking has two layers. The table checks each JSON value's type (the string
  "2" is not a hysteresis); constructing the `Config` checks ranges and
  relations, and its problems are renamed to the JSON key paths here.
  Everything found goes into one ConfigError, so a file is fixed in one pass.
- This is the one reader of DeepSpeed's blocks: `kmp.resolve_precision` on a
  dict and `kmp.wrap` with a config go through `load_config` too.
- Keys the `fp16` block leaves out get DeepSpeed's defaults (the spec's
  Defaults table, right column), so a file means what it means to DeepSpeed.
- Unknown keys inside a block (fp16, bf16, kmp, zero_optimization) are
  errors with a did-you-mean, as DeepSpeed's own config models refuse them
  (torch_autocast's and data_types' too, which DeepSpeed ignores: kmp.config.autocast_block says why):
  a misspelled `hysterisis` that silently keeps the default is the bug this
  module exists to catch. Unknown top-level keys are named in one warning
  and the file loads, as DeepSpeed ignores them (`strict=True` makes them
  errors). Keys DeepSpeed knows but kmp does not act on (monitors,
  profilers, ZeRO's buckets, ...) are named together in one warning.
- The `optimizer` block is read by kmp.config.optimizer_block, the `scheduler` block by
  kmp.schedules.formulas, `zero_optimization` here (its stage; what kmp does instead
  is warned about; its other keys: kmp.config.zero_block), `torch_autocast` and `data_types` by
  kmp.config.autocast_block. Hugging Face's
  "auto" values are filled by kmp.config.auto.
- kmp-only settings live in a `kmp` block. DeepSpeed reads top-level keys one
  by one and ignores the rest, so one file can serve both.
- `resolve_batch_sizes` infers and checks batch sizes exactly as DeepSpeed's
  `DeepSpeedConfig._set_batch_related_parameters` / `_batch_assertion` do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kmp.config import auto, autocast_block, optimizer_block, zero_block
from kmp.config.settings import GROWTH_RULES, OVERFLOW_RULES, STRATEGIES, Config, LossScaleConfig, attempt
from kmp.errors import ConfigError, Problem, check, did_you_mean
from kmp.schedules import formulas
from kmp.values import FLOAT32_MAX, INT64_MAX, int_in, is_int, is_number, key_name, plain

# The spec's Defaults table, right column (DeepSpeed's FP16 constants, plus the
# growth rule and max scale of its current DynamicLossScaler).
DEEPSPEED_LOSS_SCALE = LossScaleConfig(
    initial_scale=2.0**16,
    dynamic_growth_steps=1000,
    hysteresis=2,
    consecutive_hysteresis=False,
    min_scale=1.0,
    max_scale=2.0**24,
    raise_at_min_scale=True,
    growth_rule="after_window",
    overflow="skip",  # DeepSpeed skips an overflowing step: its trajectories stay exact
)
# What scales the loss under torch_autocast float16 when no fp16 block is enabled: torch.amp.GradScaler()
# (deepspeed/runtime/engine.py; stage_1_and_2.py, stage3.py), at its defaults (init_scale=2**16,
# growth_interval=2000, factors 2 and 0.5, no hysteresis: it grows after 2000 steps in a row without an
# overflow, Keras's rule). kmp keeps its floor and ceiling, DeepSpeed's fp16 defaults (GradScaler has none).
GRADSCALER_LOSS_SCALE = dataclasses.replace(DEEPSPEED_LOSS_SCALE, dynamic_growth_steps=2000, hysteresis=1,
                                            growth_rule="every_window")


# JSON value kinds: (what the error says is expected, the test).
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_INT = ("an integer", is_int)
_NUMBER = ("a number", is_number)
_GROWTH_RULE = ("one of " + ", ".join(repr(r) for r in GROWTH_RULES), lambda v: isinstance(v, str))
_OVERFLOW = ("one of " + ", ".join(repr(r) for r in OVERFLOW_RULES), lambda v: isinstance(v, str))


def _zero_is_none(v: Any) -> float | None:
    return float(v) if v > 0 else None


def _none_is_zero(v: float | None) -> float:
    return 0 if v is None else v


def _two_to_the(power: int) -> float:
    # A power past float range becomes inf, which the range check then reports. int(): ldexp refuses numpy ints.
    return math.ldexp(1.0, int(power)) if power < 1024 else math.inf


def _is_power_of_two(x: Any) -> bool:
    return is_number(x) and x >= 1 and math.frexp(x)[0] == 0.5


def _same(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class _Key:
    """One row of the table: a DeepSpeed key path and the Config field it fills."""

    key: str
    field: str
    kind: tuple[str, Callable[[Any], bool]]
    load: Callable[[Any], Any] = _same  # JSON -> field value; None keeps the default
    dump: Callable[[Any], Any] = _same  # field value -> JSON; None leaves the key out
    note: str = ""  # added to range problems, formatted with the JSON value


# DeepSpeed's names of communication_data_type -> kmp's (TensorFlow's).
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# DeepSpeed lower-cases the value (runtime/config.py, get_communication_data_type): "FP16" is "fp16".
_COMMUNICATION_DTYPE = ("one of 'fp32', 'fp16', 'bf16' (any case)",
                        lambda v: isinstance(v, str) and v.lower() in _DTYPE_NAMES)
_STRATEGY = ("one of " + ", ".join(repr(s) for s in STRATEGIES), lambda v: isinstance(v, str))

DEEPSPEED_KEYS: tuple[_Key, ...] = (
    _Key("train_batch_size", "train_batch_size", _INT),
    _Key("train_micro_batch_size_per_gpu", "micro_batch_size", _INT),
    _Key("gradient_accumulation_steps", "gradient_accumulation_steps", _INT),
    _Key("gradient_clipping", "gradient_clipping", ("a number >= 0 (0 means no clipping)",
         lambda v: is_number(v) and v >= 0), _zero_is_none, _none_is_zero),
    _Key("fp16.enabled", "precision", _BOOL, lambda on: "fp16" if on else None, lambda p: p == "fp16"),
    _Key("fp16.loss_scale", "loss_scale.static_scale", ("a number >= 0 (0 means dynamic scaling)",
         lambda v: is_number(v) and v >= 0), _zero_is_none, _none_is_zero),
    _Key("fp16.initial_scale_power", "loss_scale.initial_scale", ("an integer >= 0 (initial scale = 2**power)",
         lambda v: is_int(v) and v >= 0), _two_to_the, lambda s: math.frexp(s)[1] - 1,
         note="The initial scale is 2**{}."),
    _Key("fp16.loss_scale_window", "loss_scale.dynamic_growth_steps", _INT),
    _Key("fp16.hysteresis", "loss_scale.hysteresis", _INT),
    _Key("fp16.consecutive_hysteresis", "loss_scale.consecutive_hysteresis", _BOOL),
    _Key("fp16.min_loss_scale", "loss_scale.min_scale", _NUMBER, float),
    _Key("bf16.enabled", "precision", _BOOL, lambda on: "bf16" if on else None, lambda p: p == "bf16"),
    _Key("kmp.growth_rule", "loss_scale.growth_rule", _GROWTH_RULE),
    _Key("kmp.max_scale", "loss_scale.max_scale", _NUMBER, float),
    _Key("kmp.raise_at_min_scale", "loss_scale.raise_at_min_scale", _BOOL),
    _Key("kmp.growth_factor", "loss_scale.growth_factor", _NUMBER, float),
    _Key("kmp.backoff_factor", "loss_scale.backoff_factor", _NUMBER, float),
    _Key("kmp.overflow", "loss_scale.overflow", _OVERFLOW),
    _Key("kmp.strategy", "strategy", _STRATEGY),
    _Key("communication_data_type", "communication_data_type", _COMMUNICATION_DTYPE,
         lambda v: _DTYPE_NAMES[v.lower()], lambda d: {t: k for k, t in _DTYPE_NAMES.items()}.get(d, d)),
    _Key("prescale_gradients", "prescale_gradients", _BOOL),
    _Key("gradient_predivide_factor", "gradient_predivide_factor", _NUMBER, float),
    _Key("wall_clock_breakdown", "wall_clock_breakdown", _BOOL),
    _Key("steps_per_print", "steps_per_print", _INT),
    _Key("kmp.allreduce_bytes_per_pack", "allreduce_bytes_per_pack", ("an integer >= 0 (0: one bucket)",
         lambda v: is_int(v) and v >= 0)),
)

_BLOCKS = ("fp16", "bf16", "kmp")

# Keys DeepSpeed reads (deepspeed/runtime/config.py, precision_config.py,
# monitor/config.py of DeepSpeed 0.19) that kmp does not act on.
_IGNORED: dict[str, list[str]] = {
    "": """memory_breakdown
        dump_state flops_profiler autotuning tensorboard wandb csv_monitor comet
        trackio comms_logger zero_allow_untested_optimizer zero_force_ds_cpu_optimizer amp
        seq_parallel_communication_data_type gradient_allreduce_op sparse_gradients disable_allgather
        checkpoint aio elasticity compression_training quantize_training data_efficiency
        curriculum_learning sparse_attention pipeline progressive_layer_drop eigenvalue hybrid_engine
        dataloader_drop_last vocabulary_size graph_harvesting weight_quantization compile timers
        tensor_parallel expert_parallel nebula datastates_ckpt use_data_before_expert_parallelism
        sequence_parallel_size log_level disable_python_gc managed_gradient_accumulation""".split(),
    "fp16": ["auto_cast", "fp16_master_weights_and_grads"],
    "bf16": ["immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"],
}
# Top-level blocks read by their own modules.
_READ_ELSEWHERE = ("optimizer", "scheduler", "zero_optimization", "activation_checkpointing", "torch_autocast",
                   "data_types")
# Where "auto" may stay: blocks kmp does not act on, and ZeRO's tuning keys.
_AUTO_LEFT = tuple(_IGNORED[""]) + ("zero_optimization", "activation_checkpointing")


DEEPSPEED_CONFIG = Config(loss_scale=DEEPSPEED_LOSS_SCALE)  # a file with no keys


def precision_of(source: Mapping[str, Any] | str | os.PathLike) -> str:
    """The precision a DeepSpeed config asks for ("fp32", "fp16" or "bf16"), read by `load_config`."""
    return load_config(source).precision


def _get(config: Config, field: str) -> Any:
    return functools.reduce(getattr, field.split("."), config)


def load_config(source: Mapping[str, Any] | str | os.PathLike, *, strict: bool = False, **fills: Any) -> Config:
    """A Config from a dict, a path to a JSON file, or a JSON string (starts with '{' or '[').

    Raises one ConfigError listing every problem. Warns once about unknown
    top-level keys (DeepSpeed ignores them; `strict=True` makes them errors)
    and once about DeepSpeed keys kmp does not act on.

    `fills` fill Hugging Face's "auto" values (kmp.config.auto): `precision`
    ("fp16", "bf16", "fp32"), `micro_batch_size`, `train_batch_size`,
    `gradient_accumulation_steps`, `replicas`, `total_steps`,
    `warmup_steps`, `gradient_clipping`, and the optimizer's `learning_rate`,
    `weight_decay`, `betas`, `eps`.
    `kmp.wrap` fills them from its optimizer, strategy and arguments.
    """
    return read_config(source, strict=strict, given=given_of(fills), stacklevel=3)


_FILL_NAMES = ("precision", "micro_batch_size", "train_batch_size", "gradient_accumulation_steps", "replicas",
               "total_steps", "warmup_steps", "gradient_clipping", "learning_rate", "weight_decay", "betas", "eps")


def given_of(fills: Mapping[str, Any]) -> auto.Given:
    """load_config's keyword arguments as a kmp.config.auto.Given, checked."""
    problems = [Problem(key_name(k), f"one of {', '.join(_FILL_NAMES)}", v, did_you_mean(str(k), _FILL_NAMES))
                for k, v in fills.items() if k not in _FILL_NAMES]
    for name, value in fills.items():
        if value is None or name not in _FILL_NAMES:
            continue
        if name == "precision":
            if value not in ("fp32", "fp16", "bf16"):
                problems.append(Problem(name, "'fp32', 'fp16' or 'bf16'", value))
        elif name in ("gradient_clipping", "learning_rate", "weight_decay", "eps"):
            if not (is_number(value) and value >= 0):
                problems.append(Problem(name, "a number >= 0", value))
        elif name == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(is_number(b) for b in value)):
                problems.append(Problem(name, "[beta1, beta2]", value))
        else:
            int_in(name, value, 0 if name == "warmup_steps" else 1, problems)
    check(problems, "kmp.load_config arguments")
    fills = {k: plain(v) for k, v in fills.items()}
    # As Hugging Face's learning_rate, weight_decay, adam_beta1/2, adam_epsilon: they fill the optimizer block's "auto".
    params = {"lr": fills.pop("learning_rate", None), "weight_decay": fills.pop("weight_decay", None),
              "betas": fills.pop("betas", None), "eps": fills.pop("eps", None)}
    optimizer = {k: list(v) if k == "betas" else v for k, v in params.items() if v is not None} or None
    return auto.Given(world_size=fills.pop("replicas", None), optimizer=optimizer,
                      optimizer_source="load_config's arguments", **fills)


def read_config(source: Any, *, strict: bool = False, given: auto.Given = auto.Given(), stacklevel: int = 2
                ) -> Config:
    """load_config, with what fills "auto" given as a kmp.config.auto.Given (what kmp.wrap passes)."""
    raw, name = _read(source)
    filled, auto_problems = [], []
    if isinstance(raw, Mapping):
        raw, filled, auto_problems = auto.fill_auto(raw, given, _AUTO_LEFT, keep=("kmp.strategy",))
    config, notes = _from_dict(raw, name, strict, auto_problems)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=stacklevel)
    if filled:
        print(auto.describe(filled, name))
    return config


def _read(source: Any) -> tuple[Any, str]:
    if isinstance(source, Mapping):
        return source, "DeepSpeed config"
    if isinstance(source, str) and source.lstrip().startswith(("{", "[")):
        return _parse(source, "DeepSpeed config (JSON string)"), "DeepSpeed config (JSON string)"
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError([Problem("source", "a dict, a path to a JSON file, or a JSON string", source)],
                          "DeepSpeed config")
    path = os.fspath(source)
    name = f"DeepSpeed config {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        problem = Problem("path", "an existing JSON file", path,
                          f"No such file; a relative path starts at {os.getcwd()}.")
        raise ConfigError([problem], name) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: a NUL character in the path
        problem = Problem("path", "a readable UTF-8 JSON file", path, f"Reading it failed: {e}.")
        raise ConfigError([problem], name) from None
    return _parse(text, name), name


class _LongInteger:
    """An integer in JSON text with more digits than Python converts: no number, so its key reports it."""

    def __init__(self, digits: str):
        self.digits = digits

    def __repr__(self) -> str:
        return f"{self.digits[:12]}... ({len(self.digits.lstrip('-'))} digits)"


def _integer(digits: str) -> int | _LongInteger:
    try:
        return int(digits)
    except ValueError:  # past sys.get_int_max_str_digits()
        return _LongInteger(digits)


def _parse(text: str, name: str) -> Any:
    duplicates: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json keeps the last of two equal keys; DeepSpeed rejects them, and so do we.
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                duplicates.append(key)
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates, parse_int=_integer)
    except json.JSONDecodeError as e:
        lines = text.splitlines()
        line = lines[e.lineno - 1].strip() if e.lineno <= len(lines) else ""
        where = f"line {e.lineno}, column {e.colno}"
        problem = Problem(where, "valid JSON", line,
                          f"{e.msg} at {where}. JSON allows no comments, trailing commas or single quotes.")
        raise ConfigError([problem], name) from None
    except RecursionError:
        raise ConfigError([Problem("(top level)", "JSON nested no deeper than Python reads", f"{text[:12]}...",
                                   "A DeepSpeed config nests two levels deep.")], name) from None
    check([Problem(key_name(k), "each key once per object", "given more than once") for k in duplicates], name)
    return data


def _from_dict(raw: Any, name: str, strict: bool = False, problems: list[Problem] | None = None
               ) -> tuple[Config, list[str]]:
    """(the Config, the warnings to give) for a parsed file; raises one ConfigError for every problem."""
    if not isinstance(raw, Mapping):
        check([Problem("(top level)", "a JSON object {...}", raw)], name)
    auto_problems = list(problems or [])
    problems = list(auto_problems)
    ignored: list[str] = []
    unknown: list[str] = []
    # "bfloat16" is DeepSpeed's old name of the bf16 block; report paths as the user spelled them.
    spelled = {b: b for b in _BLOCKS}
    if "bfloat16" in raw:
        if "bf16" in raw:
            problems.append(Problem("bfloat16", "no bfloat16 block next to bf16 (it is bf16's old name)",
                                    raw["bfloat16"], "Merge it into bf16."))
        else:
            spelled["bf16"] = "bfloat16"
    levels: dict[str, Mapping[str, Any]] = {"": raw}
    for block, block_name in spelled.items():
        if block_name in raw:
            if isinstance(raw[block_name], Mapping):
                levels[block] = raw[block_name]
            else:
                problems.append(Problem(block_name, "a JSON object {...}", raw[block_name]))

    def path_of(key: str) -> str:
        block, _, leaf = key.rpartition(".")
        return f"{spelled[block]}.{leaf}" if block else key

    # Unknown and ignored keys, level by level.
    for level, values in levels.items():
        known = [k.key.rpartition(".")[2] for k in DEEPSPEED_KEYS if k.key.rpartition(".")[0] == level]
        known += _IGNORED.get(level, []) + ([] if level else ["bfloat16", *_BLOCKS, *_READ_ELSEWHERE])
        for key, value in values.items():
            path = f"{spelled[level]}.{key_name(key)}" if level else key_name(key)
            if key in _IGNORED.get(level, []):
                ignored.append(path)
            elif key not in known:
                fix = _unknown_key_fix(str(key), level, known, spelled)
                if level or strict:  # DeepSpeed's block models forbid extra keys; its top level does not
                    problems.append(_unknown_key(path, spelled[level] if level else "the top level", value, fix))
                else:
                    unknown.append(f"{path} ({fix})" if fix.startswith(("Did", "Keys")) else path)

    # Values, through the table. A value of the wrong type is reported and
    # left out, so the range checks below do not report it a second time.
    claimed: dict[str, tuple[str, Any]] = {}  # field -> (key path, value)
    given: dict[str, Any] = {}  # key path -> JSON value
    for row in DEEPSPEED_KEYS:
        block, _, leaf = row.key.rpartition(".")
        if block not in levels or leaf not in levels[block]:
            continue
        path = path_of(row.key)
        value = given[path] = levels[block][leaf]
        expected, accepts = row.kind
        if not accepts(value):
            fix = ("'auto' is filled in by Hugging Face's Trainer, not by DeepSpeed or kmp; give the value."
                   if isinstance(value, str) and value == "auto" else "")
            problems.append(Problem(path, expected, value, fix))
            continue
        loaded = row.load(value)
        if loaded is None:
            continue
        if row.field in claimed:
            # Only fp16.enabled and bf16.enabled share a field: both true.
            other = claimed[row.field][0]
            for p in (other, path):
                problems.append(Problem(p, f"at most one of {other}, {path} to be true", True,
                                        "Train in one precision; bf16 needs no loss scaling."))
            continue
        claimed[row.field] = (path, loaded)

    scale = {f.partition(".")[2]: v for f, (_, v) in claimed.items() if f.startswith("loss_scale.")}
    top = {f: v for f, (_, v) in claimed.items() if not f.startswith("loss_scale.")}
    # kmp's ceiling (the spec's 2**24) is not DeepSpeed's, which has none: a
    # file starting above it raises it to its initial scale.
    if DEEPSPEED_LOSS_SCALE.max_scale < scale.get("initial_scale", 0) <= FLOAT32_MAX and "max_scale" not in scale:
        scale["max_scale"] = scale["initial_scale"]
    notes: list[str] = []
    if "optimizer" in raw:
        top["optimizer"], more, optimizer_notes = optimizer_block.parse_optimizer(raw["optimizer"])
        problems += more
        notes += optimizer_notes
    if "scheduler" in raw:
        top["scheduler"], more = _scheduler(raw["scheduler"], top.get("optimizer"))
        problems += more
    if "zero_optimization" in raw:
        top["zero_stage"], zero_notes, zero_ignored, more = _zero(raw["zero_optimization"])
        problems += more
        notes += zero_notes
        ignored += zero_ignored
    if "activation_checkpointing" in raw:
        top["activation_checkpointing"], checkpointing_notes, more = _activation_checkpointing(
            raw["activation_checkpointing"], strict, unknown)
        problems += more
        notes += checkpointing_notes
    base_scale = DEEPSPEED_LOSS_SCALE
    if "torch_autocast" in raw:
        precision, safe, autocast_notes = autocast_block.read_autocast(raw["torch_autocast"], problems)
        notes += autocast_notes
        if precision is not None:
            named = claimed.get("precision")
            if named is None:
                top["precision"] = precision
                if precision == "fp16":
                    base_scale = GRADSCALER_LOSS_SCALE
            elif named[1] != precision:
                problems.append(Problem(
                    "torch_autocast.dtype", f"{named[1]!r}, what {named[0]} asks for", raw["torch_autocast"].get("dtype"),
                    "kmp computes in one lower precision (DeepSpeed would keep the weights in one and autocast to "
                    "the other): make the two agree."))
            top["lower_precision_safe_modules"] = safe
    if "data_types" in raw:
        notes += autocast_block.read_data_types(
            raw["data_types"], claimed["precision"][1] if "precision" in claimed else "fp32", problems)
    # Constructing validates ranges; problems come back under field names and
    # are reported under the JSON key path, with the value as written there.
    rows = {row.field: row for row in DEEPSPEED_KEYS}
    loss_scale, found = attempt(lambda: dataclasses.replace(base_scale, **scale), base_scale, "loss_scale.")
    config, more = attempt(lambda: Config(**top, loss_scale=loss_scale), DEEPSPEED_CONFIG)
    for p in found + more:
        row = rows.get(p.path)
        if row is not None:
            path = path_of(row.key)
            # Show the value as written in JSON (the power, not 2**power).
            shown = given[path] if path in given else row.dump(_get(DEEPSPEED_CONFIG, row.field))
            fix = f"{p.fix} {row.note.format(shown)}"
            if path not in given:
                fix += " That is DeepSpeed's default; set the key to change it."
            expected = p.expected
            for other, other_row in rows.items():  # "a value <= max_scale=..." -> the JSON key
                field_name = other.rpartition(".")[2]
                if f"{field_name}=" in expected:
                    expected = expected.replace(f"{field_name}=", f"{path_of(other_row.key)}=")
            p = Problem(path, expected, shown, fix.strip())
        problems.append(p)
    # An "auto" kmp could not fill is reported once, by kmp.config.auto, not again as a value of the wrong type.
    unfilled = {p.path for p in auto_problems}
    problems = auto_problems + [p for p in problems[len(auto_problems):] if p.path not in unfilled]
    check(problems, name)
    if unknown:
        notes.insert(0, f"The {name} has keys neither kmp nor DeepSpeed knows; both ignore them: "
                        f"{', '.join(unknown)}. Pass strict=True (kmp config check --strict) to make them errors.")
    if ignored:
        notes.append(f"kmp does not act on these keys of the {name}, and ignores them: {', '.join(ignored)}. "
                     "Keep them if DeepSpeed reads the same file; remove them to silence this warning.")
    return config, notes


# DeepSpeed's activation_checkpointing keys (deepspeed/runtime/activation_checkpointing/config.py): what each
# would do, and why kmp does not, said where the file turns it on.
_CHECKPOINTING_KEYS: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "partition_activations": ("true or false", lambda v: isinstance(v, bool),
                              "it splits the checkpoints across model-parallel ranks, and kmp has no model "
                              "parallelism: each replica keeps its blocks' inputs whole"),
    "cpu_checkpointing": ("true or false", lambda v: isinstance(v, bool),
                          "kmp keeps the checkpoints on the device that computes them (on a CPU, host memory "
                          "already)"),
    "contiguous_memory_optimization": ("true or false", lambda v: isinstance(v, bool),
                                       "TensorFlow allocates the checkpoints; there is no buffer of kmp's to make "
                                       "contiguous"),
    "number_checkpoints": ("an integer >= 1 or null", lambda v: v is None or (is_int(v) and v >= 1),
                           "it sizes DeepSpeed's contiguous buffer; kmp.prepare finds the blocks itself (or is "
                           "given them: activation_checkpointing=[...])"),
    "synchronize_checkpoint_boundary": ("true or false", lambda v: isinstance(v, bool),
                                        "it synchronizes CUDA at each checkpoint; a TensorFlow graph orders its ops "
                                        "itself"),
    "profile": ("true or false", lambda v: isinstance(v, bool),
                "it times DeepSpeed's checkpoint functions; kmp's wall_clock_breakdown times the forward and "
                "backward pass whole"),
}


def _activation_checkpointing(block: Any, strict: bool, unknown: list[str]) -> tuple[bool, list[str], list[Problem]]:
    """(on, warnings, problems) of an `activation_checkpointing` block: present, it turns kmp.prepare's
    activation checkpointing on (docs/memory.md); each key set that kmp does not honour is said, with why."""
    if not isinstance(block, Mapping):
        return False, [], [Problem("activation_checkpointing", "a JSON object {...}", block)]
    problems, honoured_not = [], []
    for key, value in block.items():
        path = f"activation_checkpointing.{key_name(key)}"
        if key not in _CHECKPOINTING_KEYS:
            fix = did_you_mean(str(key), _CHECKPOINTING_KEYS) or f"It accepts: {', '.join(_CHECKPOINTING_KEYS)}."
            if strict:
                problems.append(_unknown_key(path, "activation_checkpointing", value, fix))
            else:  # DeepSpeed's block reads the keys it knows and ignores the others
                unknown.append(f"{path} ({fix})")
            continue
        expected, accepts, why = _CHECKPOINTING_KEYS[key]
        if isinstance(value, str) and value == "auto":
            continue  # Hugging Face's: DeepSpeed's Trainer fills it; kmp honours none of these keys anyway
        if not accepts(value):
            problems.append(Problem(path, expected, value))
        elif value not in (False, None):
            honoured_not.append(f"{key}={json.dumps(value)} ({why})")
    notes = [f"kmp does not honour these keys of activation_checkpointing: {'; '.join(honoured_not)}. kmp.prepare "
             "recomputes each block's activations in the backward pass, as the block asks (docs/memory.md)."
             ] if honoured_not else []
    return True, notes, problems


_ZERO_STAGES = {
    1: "the flat buffers' optimizer slots sharded across the replicas (kmp.prepare; Keras's slot variables stay "
       "whole: docs/zero.md)",
    2: "stage 2 partitions gradients and optimizer state; kmp uses stage 1 (docs/zero.md): gradients stay whole on "
       "every replica",
    3: "stage 3 partitions parameters too; kmp uses stage 1 (docs/zero.md): parameters and gradients stay whole on "
       "every replica",
}


def zero_stage_note(key: str, stage: int) -> str:
    """What is said where `key` asks for ZeRO stage 2 or 3, which kmp runs as stage 1."""
    return f"{key} is {stage}: {_ZERO_STAGES[stage]}. The training is the same; the memory saved is less."


def _zero(block: Any) -> tuple[int, list[str], list[str], list[Problem]]:
    """(stage, warnings, keys kmp does not act on, problems) of a `zero_optimization` block (its keys:
    kmp.config.zero_block). Training is the same; memory is not."""
    if isinstance(block, bool):  # DeepSpeed's legacy form: true is stage 1
        block = {"stage": int(block)}
    if not isinstance(block, Mapping):
        return 0, [], [], [Problem("zero_optimization", "a JSON object {...}", block)]
    unknown, problems, ignored = zero_block.check(block)
    for path, value in unknown:
        where, _, key = path.rpartition(".")
        known = zero_block.known(path)
        fix = did_you_mean(key, known) or (f"{where} accepts: {', '.join(sorted(known))}." if len(known) < 20 else
                                           "Check its spelling against DeepSpeed's zero_optimization keys "
                                           "(docs/config.md lists them), or remove it.")
        problems.append(_unknown_key(path, where, value, fix))
    stage = block.get("stage", 0)
    if not int_in("zero_optimization.stage", stage, 0, problems, high=3, fix="DeepSpeed's stages are 0 to 3."):
        return 0, [], [], problems
    notes = [zero_stage_note("zero_optimization.stage", stage)] if stage > 1 else []
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if isinstance(block.get(k), Mapping) and str(block[k].get("device", "none")).lower() != "none"]
    if block.get("cpu_offload") is True:
        offloaded.append("cpu_offload")
    if offloaded:
        notes.append(f"zero_optimization.{', '.join(offloaded)}: kmp does not offload; optimizer state and "
                     "parameters stay on the training device.")
    return stage, notes, ignored, problems


def _unknown_key(path: str, where: str, value: Any, fix: str) -> Problem:
    return Problem(path, f"a key of {where} that kmp or DeepSpeed knows", value, fix)


def _scheduler(block: Any, optimizer: optimizer_block.OptimizerSpec | None) -> tuple[Any, list[Problem]]:
    """The checked `scheduler` block, as a dict; kmp.wrap builds it against the optimizer it uses.

    What the schedule reads from the optimizer (its lr, beta_1) is checked
    here against the config's optimizer block when there is one, else against
    stand-ins: kmp.wrap checks it again with the real optimizer.
    """
    lr = optimizer.params["lr"] if optimizer is not None else 1.0
    betas = optimizer.params.get("betas") if optimizer is not None else None
    schedule, problems = attempt(lambda: formulas.parse_scheduler(
        block, base_lr=lr, base_momentum=betas[0] if betas else 0.9), None)
    return (None if schedule is None else schedule.block()), problems


def _unknown_key_fix(key: str, level: str, known: list[str], spelled: dict[str, str]) -> str:
    if level:
        return did_you_mean(key, known) or f"{spelled[level]} accepts: {', '.join(sorted(known))}."
    # A block's key written at the top level, as "hysteresis" or "fp16.hysteresis".
    nested = [k.key.split(".") for k in DEEPSPEED_KEYS if "." in k.key and key in (k.key, k.key.split(".")[1])]
    if nested:
        return "Keys nest by block: write " + " or ".join(f'{{"{b}": {{"{k}": ...}}}}' for b, k in nested) + "."
    # Offer "fp16.hysteresis" too, for a misspelled key put outside its block.
    return did_you_mean(key, known + [k.key for k in DEEPSPEED_KEYS]) or (
        "Check its spelling against DeepSpeed's config documentation, or remove it.")


def to_deepspeed(config: Config) -> dict[str, Any]:
    """The DeepSpeed-style dict that `load_config` reads back as `config`.

    Every table key is written, defaults too, so the file means the same to
    any reader whatever its defaults. Raises ConfigError for an invalid config,
    or an initial scale that is not 2**n (DeepSpeed stores only the power).
    """
    problems = []
    scale = config.loss_scale.initial_scale
    if not _is_power_of_two(scale):
        problems.append(Problem("loss_scale.initial_scale", "a power of two >= 1 (DeepSpeed stores "
                                "fp16.initial_scale_power)", scale, "Use 2.0**n, e.g. 2.0**16."))
    check(problems, "kmp config")
    out: dict[str, Any] = {}
    for row in DEEPSPEED_KEYS:
        value = row.dump(_get(config, row.field))
        if value is not None:
            block, _, leaf = row.key.rpartition(".")
            (out.setdefault(block, {}) if block else out)[leaf] = value
    if config.optimizer is not None:
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in config.optimizer.params.items()}
        out["optimizer"] = {"type": config.optimizer.type, "params": params}
    if config.scheduler is not None:
        out["scheduler"] = config.scheduler
    if config.zero_stage:
        out["zero_optimization"] = {"stage": config.zero_stage}
    if config.activation_checkpointing:
        out["activation_checkpointing"] = {}
    if config.lower_precision_safe_modules is not None:
        out["torch_autocast"] = {"enabled": True, "dtype": autocast_block.AUTOCAST_DTYPE_NAME[config.precision],
                                 "lower_precision_safe_modules": list(config.lower_precision_safe_modules)}
    return out


def resolve_batch_sizes(config: Config, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch_size, gradient_accumulation_steps), DeepSpeed's way.

    Missing values are inferred as DeepSpeed's `_set_batch_related_parameters`
    does, with floor division (so a bad pair can infer a wrong value, which the
    check then reports):

        train, micro -> gas   = train // micro // world
        train, gas   -> micro = train // world // gas
        micro, gas   -> train = micro * gas * world
        train        -> gas = 1, micro = train // world
        micro        -> gas = 1, train = micro * world
    then, as its `_batch_assertion`: train == micro * gas * world.
    """
    train, micro, gas = config.train_batch_size, config.micro_batch_size, config.gradient_accumulation_steps
    problems = []
    int_in("world_size", world_size, 1, problems, fix="The number of data-parallel replicas.")
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if value is not None:
            int_in(key, value, 1, problems, fix="None infers it.")
    if train is None and micro is None:
        problems.append(Problem(
            "train_batch_size", "train_batch_size or train_micro_batch_size_per_gpu to be given", None,
            "DeepSpeed: 'Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided'."))
    check(problems, "batch sizes")

    # numpy integers as Python ints: their products would wrap around at 2**63.
    train, micro, gas, world, inferred = plain(train), plain(micro), plain(gas), plain(world_size), ""
    if train is not None and micro is not None and gas is None:
        gas = train // micro // world
        inferred = f"gradient_accumulation_steps was inferred as {train} // {micro} // {world} = {gas}. "
    elif train is not None and micro is None:
        gas = 1 if gas is None else gas
        micro = train // world // gas
        inferred = f"train_micro_batch_size_per_gpu was inferred as {train} // {world} // {gas} = {micro}. "
    elif train is None:
        gas = 1 if gas is None else gas
        train = micro * gas * world
        if train > INT64_MAX:
            check([Problem(
                "train_batch_size", f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size = "
                f"{micro} * {gas} * {world} <= {INT64_MAX} (int64's largest)", None,
                "It is inferred from these; give smaller ones.",
            )], "batch sizes")
    if train != micro * gas * world:
        choices = []
        if micro >= 1 and gas >= 1 and micro * gas * world <= INT64_MAX:
            choices.append(f"train_batch_size={micro * gas * world}")
        if micro >= 1 and train % (micro * world) == 0:
            choices.append(f"gradient_accumulation_steps={train // (micro * world)}")
        if gas >= 1 and train % (gas * world) == 0:
            choices.append(f"train_micro_batch_size_per_gpu={train // (gas * world)}")
        choices = choices or [f"train_batch_size={max(micro, 1) * max(gas, 1) * world}"]
        check([Problem(
            "train_batch_size",
            "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size = "
            f"{micro} * {gas} * {world} = {micro * gas * world}",
            train,
            "DeepSpeed: 'Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
            f"* gradient_acc_step * world_size {train} != {micro} * {gas} * {world}'. {inferred}"
            f"Consistent values (change one): {', or '.join(choices)}.",
        )], "batch sizes")
    return train, micro, gas
