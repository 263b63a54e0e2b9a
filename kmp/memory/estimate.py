"""Bytes per replica of a model's training state, estimated: kmp.memory_estimate, `kmp memory`.

    kmp.memory_estimate(125_000_000, optimizer="adam", replicas=8, stage=1)   # a parameter count, or
    kmp.memory_estimate(model)          # a compiled model: its parameters and settings, read from it
    print(kmp.memory.estimate.table(rows))       # one row per estimate, as DeepSpeed's estimator prints
    kmp.measured_bytes(model)           # what the variables hold on each device (kmp.memory.allocation)

Per replica, for P trainable parameters of b bytes (4 in float32 and mixed
precision: Keras keeps float32 variables and casts each to float16/bfloat16
as a layer reads it; no 16-bit copy persists), k slots per parameter (SLOTS),
N replicas:

    weights          P*b + the non-trainable variables (BatchNorm statistics, seeds), as the model holds them
    gradients        P*b      transient, in no variable: one gradient (the engine's is one flat float32
                              tensor; per-variable, one tensor per variable); a step may briefly hold two
    optimizer_state  k*P*b    the inner optimizer's (Keras's) slot variables, whole; on the flat buffers at
                              stage 1, and at every stage on replicas that are CPUs of one process (`one_process`),
                              held once per process in host memory instead (`host`, kmp.engine.zero). 8-bit
                              (kmp.Adam8bit, kmp.AdamW8bit): per slot 1 byte per parameter and one
                              float32 scale per block (BLOCK_SIZE) of each variable's
    accumulators     4*P      kmp.scaling.accumulate's float32 sums, when accumulating; never sharded (local until
                              the window closes)
    flat_copies      4*P + k*4*S + 4*P if accumulating (+ 4*P of segment ids with Lamb): the flat-buffer
                     engine's second copy (kmp.engine.buffers, "Memory"; P padded to whole units of ALIGN
                     elements, S a whole number of units), S = P, or ceil(P/N) at stage 1 (its
                     sums then 4*N*S: they add up the flat gradient, padded to N whole shards; its
                     slots sharded; its weights stay whole: the forward pass reads them). Replicas
                     that are CPUs of one process read each other's memory: at every stage they hold
                     S = ceil(P/N) of the weights and slots (`one_process`, read from a model's
                     strategy; Lamb excepted). With 8-bit
                     states each variable spans whole blocks there (P rounded up per variable), and
                     each slot takes 1 byte per element and 4 per block of its shard
    scalars          step counters, learning rate, loss-scale state, accumulation counters (and metric totals)

DeepSpeed (deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py at
edaa7221, estimate_zero2_model_states_mem_needs, no offload) counts per GPU
2P + 18P/N: 16-bit weights (2) whole; 16- and 32-bit gradients (2 + 4),
32-bit masters (4) and Adam's moments (8) partitioned (4P + 16P/N before
f4cb866c, DeepSpeed #5099, 2024; stage3.py: 4 * largest layer + 18P/N). kmp
keeps no 16-bit copy, and its float32 masters are the Keras variables, which
no stage shards: Adam at stage 0 is 4 + 4 + 8 = 16 bytes per parameter.

Stage 1 shards the state the step updates, the flat buffers' slots
(kmp.engine.buffers); Keras's slot variables, the observable copy (saved, read by
callbacks), are held once per process in host memory (kmp.engine.zero.to_host), so
a replica device holds k*4*ceil(P/N) of optimizer state, as in DeepSpeed,
and the host k*P*b more. 8-bit states (kmp.scaling.eight_bit) in bitsandbytes' layout
(bitsandbytes-foundation/bitsandbytes bitsandbytes/optim/optimizer.py at
95f9af30: uint8 moments, one float32 absmax per block of 256; 2048 before
aa57bd89, 2024), in blocks per variable; as there, variables under
`min_8bit_size` (4096) elements keep 32-bit states. The flat buffers keep
the same blocks (kmp.engine.buffers aligns each quantized variable to one,
after a run of the float32 ones), and stage 1 shards them by whole blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from kmp import values
from kmp.errors import ConfigError, Problem, check, did_you_mean

STAGES = (0, 1)
STATES = ("32bit", "8bit")
BLOCK_SIZE = 256  # parameters per float32 scale of 8-bit states
MIN_8BIT_SIZE = 4096  # 8-bit states: variables under this many elements keep float32 ones (kmp.scaling.eight_bit)
# Elements every flat buffer and shard is a whole number of (kmp.engine.buffers): XLA:CPU vectorizes the
# update's loop, which reads the learning rate at run time, only over a multiple of 8.
ALIGN = 16
# Slots per parameter, as Keras 3.15's optimizers' build() adds them (amsgrad, RMSprop's options: read from one).
SLOTS = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "lion": 1, "adagrad": 1, "lamb": 2, "rmsprop": 1,
         "adamax": 2, "adadelta": 2, "ftrl": 2}
FLAT_OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "lion", "adagrad", "lamb")  # kmp.engine.buffers's rules
EIGHT_BIT_OPTIMIZERS = ("adam", "adamw")
OPTIONS = ("optimizer", "precision", "replicas", "stage", "states", "accumulation", "flat_buffers")
CATEGORIES = ("weights", "gradients", "optimizer_state", "accumulators", "flat_copies", "scalars")
_BYTES = {"float32": 4, "mixed_float16": 4, "mixed_bfloat16": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_SHORT = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}  # DeepSpeed's names
# Scalars, in bytes (int64 counters, float32 values): Keras's iterations and learning rate (none for a
# schedule); Keras's LossScaleOptimizer adds its own two, step_counter and dynamic_scale; kmp's adds four
# int64 states; kmp.scaling.accumulate two int64 counters and a float32 weight sum.
OPTIMIZER_SCALARS = 8 + 4
KERAS_LOSS_SCALE_SCALARS = 8 + 4 + 8 + 4
KMP_LOSS_SCALE_SCALARS = 4 * 8
ACCUMULATION_SCALARS = 8 + 8 + 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bytes:
    """Bytes per replica by category (the module docstring says what each holds)."""

    weights: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    accumulators: int = 0
    flat_copies: int = 0
    scalars: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def in_variables(self) -> Bytes:
        """All but the transient gradients: what variables hold, and measured_bytes sees."""
        return Bytes(**{c: getattr(self, c) for c in CATEGORIES if c != "gradients"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate(Bytes):
    """memory_estimate's answer: bytes per replica, and the settings they are for.

    `host`: bytes held once per process in host memory, on no replica device
    (Keras's copy of the optimizer state at stage 1 on the flat buffers,
    kmp.engine.zero); not in `total`. Where the replicas are CPU devices, replica
    0's device is the host and holds it too.
    """

    host: int = 0
    parameters: int
    optimizer: str
    precision: str
    replicas: int
    stage: int
    states: str
    gradient_accumulation_steps: int
    flat_buffers: bool

    def options(self, names=OPTIONS) -> str:
        """The settings named, as "adam, mixed_float16, replicas=8, stage=1, 32bit, ..." shows them."""
        shown = {"optimizer": self.optimizer, "precision": self.precision, "replicas": f"replicas={self.replicas}",
                 "stage": f"stage={self.stage}", "states": self.states,
                 "accumulation": f"accumulation={self.gradient_accumulation_steps}",
                 "flat_buffers": f"flat_buffers={'on' if self.flat_buffers else 'off'}"}
        return ", ".join(shown[name] for name in names)

    def __str__(self) -> str:
        rows = [f"kmp memory per replica: {_count(self.parameters)} parameters, {self.options()}"]
        rows += [f"  {c.replace('_', ' '):16}{_size(getattr(self, c)):>12}" + " (transient)" * (c == "gradients")
                 for c in CATEGORIES]
        rows.append(f"  {'total':16}{_size(self.total):>12}")
        if self.host:
            rows.append(f"  {'host memory':16}{_size(self.host):>12} once per process (Keras's copy of the state)")
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What an estimate is computed from: a count's defaults, or what a model holds, with the overrides."""

    parameters: int
    parameter_bytes: int  # of the trainable variables (each slot holds as many)
    optimizer: Any = "adam"
    slots: int = SLOTS["adam"]
    precision: str = "mixed_float16"
    replicas: int = 1
    stage: Any = 0
    states: Any = "32bit"
    gradient_accumulation_steps: int = 1
    accumulating: bool = False
    flat_buffers: bool = False
    other_weights: int = 0  # a model's non-trainable variables
    other_state: int = 0  # Keras's moving averages (use_ema)
    other_sums: int = 0  # Keras's own accumulation
    scalars: int | None = None  # a model's optimizers' and metrics' scalars; None: those kmp.wrap builds
    sizes: tuple | None = None  # a model's trainable variables' element counts; None: one tensor of P
    block_size: int = BLOCK_SIZE  # elements per scale of 8-bit states
    min_8bit_size: int = MIN_8BIT_SIZE  # 8-bit states: smaller variables keep float32 ones
    one_process: bool = False  # replicas that are CPUs of one process: the flat buffers in shards at any stage


def memory_estimate(model_or_parameters, *, optimizer=None, precision=None, replicas=None, stage=None, states=None,
                    gradient_accumulation_steps=None, flat_buffers=None, block_size=None,
                    min_8bit_size=None) -> MemoryEstimate:
    """Bytes per replica of weights, gradients, optimizer state, accumulators, flat copies and scalars.

    `model_or_parameters`: a parameter count (an int, "125M", "1.3B", "7e9"),
    or a compiled Keras model: its parameters, optimizer (the one kmp's
    wraps), precision (its variables' dtypes), replicas, accumulation and
    flat-buffer engine (built, or what kmp.prepare's setting builds at the
    next fit) are read from it. A keyword given overrides what was read
    ("this model on 8 replicas"). For a count the defaults are "adam",
    "mixed_float16", 1 replica, stage 0, "32bit", no accumulation, no flat
    buffers. `optimizer`: a name in SLOTS, or a Keras optimizer.
    """
    source = model_or_parameters
    if hasattr(source, "trainable_variables"):
        # Here, not at the top: it imports TensorFlow, and `kmp memory` on a count does not.
        from kmp.memory.allocation import settings

        setup = settings(source)
    else:
        setup = _from_count(source)
    problems: list[Problem] = []
    change: dict[str, Any] = {"stage": stage, "states": states}
    if optimizer is not None:
        change["optimizer"], change["slots"] = optimizer_slots(optimizer, problems)
    if precision is not None and (name := _policy(precision, problems)) is not None:
        change.update(precision=name, parameter_bytes=setup.parameters * _BYTES[name])
    if replicas is not None and values.int_in("replicas", replicas, 1, problems):
        change["replicas"] = replicas
    if gradient_accumulation_steps is not None and values.int_in(
            "gradient_accumulation_steps", gradient_accumulation_steps, 1, problems):
        change.update(gradient_accumulation_steps=gradient_accumulation_steps,
                      accumulating=gradient_accumulation_steps > 1)
    if flat_buffers is not None and values.boolean("flat_buffers", flat_buffers, problems):
        change["flat_buffers"] = flat_buffers
    if block_size is not None and values.int_in("block_size", block_size, 1, problems):
        change["block_size"] = block_size
    if min_8bit_size is not None and values.int_in("min_8bit_size", min_8bit_size, 0, problems):
        change["min_8bit_size"] = min_8bit_size
    setup = dataclasses.replace(setup, **{k: v for k, v in change.items() if v is not None})
    _check(setup, problems)
    check(problems, "kmp.memory_estimate arguments")
    return _estimate(setup)


def estimates(parameters, **settings) -> list[MemoryEstimate]:
    """memory_estimate(parameters, ...) for every combination of the settings' values (each a list), in order."""
    return [memory_estimate(parameters, **dict(zip(settings, combination)))
            for combination in itertools.product(*settings.values())]


def _estimate(s: Setup) -> MemoryEstimate:
    p, n = s.parameters, s.replicas
    # Stage 1 shards the flat buffers' slots (kmp.engine.buffers), padded to N equal shards, and holds
    # Keras's copy of the slots in host memory (kmp.engine.zero); replicas that are CPUs of one process
    # do both at stage 0 too. Lamb and the per-variable path keep them whole.
    flat_shards = s.flat_buffers and s.optimizer != "lamb" and n > 1
    gathered = flat_shards and s.stage == 1 and not s.one_process  # kmp.engine.layout's GatheredShards
    sharded = flat_shards and (s.stage == 1 or s.one_process)
    # The flat buffers: every variable starts on a block (8-bit states, except the variables that keep
    # float32 ones, a run of their own first), the whole is padded to units of ALIGN elements and whole
    # blocks, and a shard is a whole number of units (kmp.engine.buffers).
    block = s.block_size if s.states == "8bit" else 1
    unit = math.lcm(block, ALIGN)
    sizes = s.sizes or (p,)
    kept = [k for k in sizes if s.states == "8bit" and k < s.min_8bit_size]
    quantized = [k for k in sizes if not (s.states == "8bit" and k < s.min_8bit_size)]
    kept_p = -(-sum(kept) // unit) * unit
    flat_p = kept_p + -(-sum(-(-k // block) * block for k in quantized) // unit) * unit
    shard = -(-flat_p // (n * unit)) * unit if sharded else flat_p
    kept_weights = 0
    if s.states == "8bit":
        # A byte per moment and a float32 scale per block of each quantized variable; the others' moments as
        # their weights. On the flat buffers, each replica's float32 buffers hold what its shard needs of
        # the kept run (the most any replica's does), and its code buffers its whole shard (the kept run's
        # codes are scratch); stepped in place (not gathered), the kept run's weights are a buffer of their own.
        blocks = sum(-(-k // s.block_size) for k in quantized)
        state = s.slots * (sum(quantized) + 4 * blocks + s.parameter_bytes // p * sum(kept))
        windows = [(k * shard, shard) for k in range(n)] if sharded else [(0, flat_p)]
        held = max(max(0, (min(kept_p, o + e) if quantized else o + e) - o) for o, e in windows) if kept else 0
        codes = shard if quantized else 0
        flat_state = s.slots * (4 * held + codes + 4 * codes // s.block_size)
        kept_weights = held if quantized and not gathered else 0
    else:
        state, flat_state = s.slots * s.parameter_bytes, s.slots * 4 * shard
    # Replicas of one process read each other's shards of the weights too (kmp.engine.buffers, weight_shards).
    flat_weights = (shard if sharded and s.one_process else flat_p) + kept_weights
    # The flat sums add up the flat gradient, padded to N whole shards when sharded (kmp.engine.buffers, `length`).
    flat_sums = n * shard if sharded else flat_p
    sums = 4 * p * s.accumulating
    scalars = s.scalars
    if scalars is None:  # as kmp.wrap builds the optimizer: kmp's for float16, replicas, accumulation, the engine
        kmp_optimizer = s.precision in ("mixed_float16", "float16") or n > 1 or s.accumulating or s.flat_buffers or (
            s.stage == 1 or s.states == "8bit")
        scalars = OPTIMIZER_SCALARS + (KERAS_LOSS_SCALE_SCALARS + KMP_LOSS_SCALE_SCALARS) * kmp_optimizer
    # Sharded, Keras's copy of the slots is held once in host memory, not per replica (kmp.engine.zero).
    host, state = (state, 0) if sharded else (0, state)
    return MemoryEstimate(
        host=host,
        weights=s.parameter_bytes + s.other_weights, gradients=s.parameter_bytes, optimizer_state=state + s.other_state,
        accumulators=sums + s.other_sums,
        flat_copies=(4 * (flat_weights + flat_sums * s.accumulating + flat_p * (s.optimizer == "lamb")) + flat_state)
        * s.flat_buffers,
        scalars=scalars + ACCUMULATION_SCALARS * s.accumulating, parameters=p, optimizer=s.optimizer,
        precision=s.precision, replicas=n, stage=s.stage, states=s.states,
        gradient_accumulation_steps=s.gradient_accumulation_steps, flat_buffers=s.flat_buffers)


def _check(s: Setup, problems: list[Problem]) -> None:
    if not values.is_int(s.stage) or s.stage not in STAGES:
        problems.append(Problem("stage", "0 or 1 (ZeRO stages 2 and 3 are out of kmp's scope)", s.stage,
                                "Stage 1 shards the optimizer state across the replicas: use stage=1."))
    if values.choice("states", s.states, STATES, problems) and s.states == "8bit" and (
            s.optimizer not in EIGHT_BIT_OPTIMIZERS):
        problems.append(Problem("states", f"'32bit' with {s.optimizer!r} (8-bit states are for "
                                f"{' and '.join(EIGHT_BIT_OPTIMIZERS)})", s.states, "Use states='32bit'."))
    if s.flat_buffers and (s.optimizer not in FLAT_OPTIMIZERS or s.slots != SLOTS[s.optimizer]):
        problems.append(Problem("flat_buffers", f"False with {s.optimizer!r} (kmp.engine.buffers updates "
                                f"{', '.join(FLAT_OPTIMIZERS)}, without amsgrad)", True, "Use flat_buffers=False."))
    elif s.flat_buffers and s.parameter_bytes != 4 * s.parameters:
        problems.append(Problem("flat_buffers", f"False with {s.precision} variables (the buffers hold float32)",
                                True, "Use flat_buffers=False, or float32 or mixed precision."))


def _from_count(parameters) -> Setup:
    problems: list[Problem] = []
    count = parse_count(parameters) if isinstance(parameters, (str, float)) else parameters
    values.int_in("parameters", count, 1, problems, fix="Pass a parameter count or a compiled keras.Model.")
    check(problems, "kmp.memory_estimate arguments")
    return Setup(parameters=count, parameter_bytes=4 * count)


def optimizer_slots(optimizer, problems: list[Problem]) -> tuple[str | None, int]:
    """(name, slots per parameter) of an optimizer name or Keras optimizer."""
    if isinstance(optimizer, str):
        if optimizer not in SLOTS:
            problems.append(Problem("optimizer", f"one of {', '.join(map(repr, SLOTS))}, or a Keras optimizer",
                                    optimizer, did_you_mean(optimizer, SLOTS)))
        return optimizer, SLOTS.get(optimizer, 0)
    name = type(optimizer).__name__.lower()
    name = "sgd_momentum" if name == "sgd" and optimizer.momentum else name
    if type(optimizer).__module__ == "kmp.scaling.eight_bit":  # Adam8bit, AdamW8bit: Adam's two slots, in 8 bits
        name = name.removesuffix("8bit")
    elif name not in SLOTS or not type(optimizer).__module__.startswith("keras."):
        problems.append(Problem("optimizer", f"a Keras {', '.join(sorted({*SLOTS} - {'sgd_momentum'}))} optimizer",
                                type(optimizer).__name__, "Other optimizers' slots are not in kmp's table (SLOTS)."))
        return name, 0
    extra = bool(getattr(optimizer, "amsgrad", False))
    if name == "rmsprop":
        extra += bool(optimizer.momentum > 0) + bool(optimizer.centered)
    return name, SLOTS[name] + extra


def _policy(precision, problems: list[Problem]) -> str | None:
    if isinstance(precision, str) and (precision in _BYTES or precision in _SHORT):
        return _SHORT.get(precision, precision)
    from kmp.precision import resolve_precision  # the other spellings; here: it imports TensorFlow

    try:
        return resolve_precision(precision).name
    except ConfigError as error:
        problems.extend(error.problems)
        return None


def parse_count(text: Any) -> int:
    """A parameter count written as 125000000, "125M", "1.3B", "7e9" or "350K" (K, M, B or G, T: powers of 1000)."""
    match = re.fullmatch(r"\s*([0-9][0-9_.]*(?:[eE][+]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    try:
        number = Decimal(match[1].replace("_", "")) * 1000 ** " KMBT".index(match[2].upper().replace("G", "B") or " ")
    except (TypeError, InvalidOperation):
        number = None
    if number is None or number != number.to_integral_value() or number < 1:
        check([Problem("parameters", 'a whole number >= 1, as 125000000, "125M", "1.3B" or "7e9"', text)],
              "parameter count")
    return int(number)


def table(estimates) -> str:
    """One row per estimate, as DeepSpeed's estimate_zero2_model_states_mem_needs_all_cold prints its settings.

    The settings all rows share are said once, above the rows; the others in each row's options."""
    estimates = list(estimates)
    varying = [n for n in OPTIONS if len({e.options([n]) for e in estimates}) > 1] or ["replicas", "stage", "states"]
    shared = [n for n in OPTIONS if n not in varying]
    heads = ("per replica", "weights", "gradients", "opt. state", "accum.", "flat copies", "scalars", "host, once")
    rows = [heads] + [(_size(e.total), *(_size(getattr(e, c)) for c in CATEGORIES), _size(e.host)) for e in estimates]
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    options = ["options"] + [e.options(varying) for e in estimates]
    counts = ", ".join(dict.fromkeys(_count(e.parameters) for e in estimates))
    return "\n".join(["Estimated memory per replica of weights, gradients, optimizer states and accumulators",
                      "(kmp; activations and TensorFlow's own memory not included).",
                      f"Model with {counts} parameters; {estimates[0].options(shared)}."]
                     + [" | ".join([*(c.rjust(w) for c, w in zip(row, widths)), o]) for row, o in zip(rows, options)])


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
