"""DeepSpeed's five learning-rate schedulers as functions of the applied-update count. Imports no TensorFlow.

A DeepSpeed `scheduler` block, {"type": ..., "params": {...}}, is parsed into a
`Schedule`: the value of the learning rate (and, for OneCycle, the momentum)
that the k-th applied update uses, k = 0, 1, ... DeepSpeed's engine constructs
the scheduler once, which sets the lr of the optimizer's param groups, and
calls `lr_scheduler.step()` after every optimizer step that was applied, not
after an overflow step (engine.py, `_take_model_step`). So, with L the
`last_batch_iteration` param and f DeepSpeed's `get_lr()` as a function of its
`last_batch_iteration`:

    lr(0) = what the constructor leaves in the param group:
            f's start value if L == -1, else the optimizer's own lr (base_lr)
    lr(k) = f(L + k)                           for k >= 1

In Keras the optimizer evaluates `learning_rate(iterations)`, and `iterations`
counts applied updates only (kmp's LossScaleOptimizer does not apply, so does
not count, overflow steps or open accumulation windows), so `lr_at(k)` is the
schedule Keras needs.

The formulas are written once, in DeepSpeed's order of operations, against a
small math namespace: `PythonMath` gives Python floats (the very floats
DeepSpeed computes), `kmp.schedules.keras.KerasMath` float32 tensors.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from kmp import values
from kmp.errors import Problem, check, did_you_mean

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
WARMUP_TYPES = ("log", "linear")
ONE_CYCLE_BETA_2 = 0.99  # OneCycle sets betas = (momentum, 0.99): it overrides the optimizer's beta_2


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # a parameter DeepSpeed's constructor has no default for


class _NotGiven:
    def __repr__(self) -> str:
        return "nothing (the key is missing)"


_NOT_GIVEN = _NotGiven()

# The constructors' signatures in deepspeed/runtime/lr_schedules.py (the engine
# passes `params` as keyword arguments, so these defaults are the config's; the
# argparse defaults in the same file differ and apply to the command line only).
PARAMETERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
}

# Names DeepSpeed's own docs use for a parameter its constructor calls otherwise.
_DOC_NAMES = {"post_cycle_decay_step_size": "decay_step_size"}  # docs/_tutorials/one-cycle.md

# DeepSpeed also takes a list here, one value per torch param group.
_PER_GROUP = {"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom",
              "lr_range_test_min_lr"}


def _at_least(low):
    return lambda path, v, out: values.number_in(path, v, out, at_least=low)


def _count(low):
    return lambda path, v, out: values.int_in(path, v, low, out)


def _or_null(check_value, meaning):
    def checked(path, v, out):
        if v is None:
            return True
        problems: list[Problem] = []
        if check_value(path, v, problems):
            return True
        out.extend(Problem(p.path, f"{p.expected}, or null ({meaning})", p.received, p.fix) for p in problems)
        return False

    return checked


def _momentum(path, v, out):
    return values.number_in(path, v, out, at_least=0.0, at_most=1.0)


# Ranges are narrower than DeepSpeed's where its formulas would give a negative
# lr, divide by zero or read nonsense (docs/schedules.md lists each).
_CHECKS = {
    "warmup_min_lr": _at_least(0.0),
    "warmup_max_lr": _or_null(_at_least(0.0), "the optimizer's lr"),
    "warmup_num_steps": _count(1),
    "warmup_type": lambda path, v, out: values.choice(path, v, WARMUP_TYPES, out),
    "last_batch_iteration": _count(-1),
    "total_num_steps": _count(0),
    "warmup_min_ratio": _at_least(0.0),
    "cos_min_ratio": _at_least(0.0),
    "cycle_min_lr": _at_least(0.0),
    "cycle_max_lr": _at_least(0.0),
    "decay_lr_rate": _at_least(0.0),
    "cycle_first_step_size": lambda path, v, out: values.number_in(path, v, out, above=0.0),
    "cycle_second_step_size": _or_null(_at_least(0.0), "cycle_first_step_size"),
    "cycle_first_stair_count": _count(-1),
    "cycle_second_stair_count": _or_null(_count(-1), "cycle_first_stair_count"),
    "decay_step_size": _at_least(0.0),
    "cycle_momentum": values.boolean,
    "cycle_min_mom": _momentum,
    "cycle_max_mom": _momentum,
    "decay_mom_rate": _at_least(0.0),
    "lr_range_test_min_lr": _at_least(0.0),
    "lr_range_test_step_size": _count(1),
    "lr_range_test_step_rate": _at_least(0.0),
    "lr_range_test_staircase": values.boolean,
}


class PythonMath:
    """The formulas' namespace for Python floats: `lr_at(k)` is the float DeepSpeed computes."""

    pi = math.pi
    floor = staticmethod(math.floor)
    log = staticmethod(math.log)
    cos = staticmethod(math.cos)
    minimum = staticmethod(min)
    maximum = staticmethod(max)
    mod = staticmethod(lambda a, b: a % b)

    @staticmethod
    def where(condition, if_true, if_false):
        """if_true() or if_false(); both are thunks, so the branch not taken is never computed (log(0))."""
        return if_true() if condition else if_false()

    @staticmethod
    def equal(a, b):
        return a == b

    @staticmethod
    def step(k):
        return float(k)


# The formulas. `t` is DeepSpeed's `last_batch_iteration` (a number of `m`);
# `s` the settings with defaults filled in. Each line follows lr_schedules.py.

def _warmup(s, m, t):
    """gamma() during warmup: WarmupLR._get_gamma's first branch, warmup_num_steps at least 2."""
    n = max(2, s["warmup_num_steps"])
    if s["warmup_type"] == "log":
        return n, lambda: (1.0 / math.log(n)) * m.log(t + 1)
    return n, lambda: t / n


def _warmup_lr(s, m, t):
    n, warm = _warmup(s, m, t)
    low, delta = s["warmup_min_lr"], s["warmup_max_lr"] - s["warmup_min_lr"]
    if "total_num_steps" in s:  # WarmupDecayLR: linear decay to 0 at total_num_steps
        total = s["total_num_steps"]
        after = lambda: m.maximum(0.0, (total - t) / float(max(1.0, total - n)))
    else:
        after = lambda: 1.0
    gamma = lambda: m.where(t < n, warm, after)
    return m.where(t < 0, lambda: low, lambda: low + delta * gamma())


def _warmup_cosine_lr(s, m, t):
    n, warm = _warmup(s, m, t)
    floor_ratio, total = s["cos_min_ratio"], s["total_num_steps"]

    def warmup_ratio():
        return s["warmup_min_ratio"] + warm() * (1.0 - s["warmup_min_ratio"])

    def cosine_ratio():
        progress = m.minimum(1.0, (t - n + 1) / max(1, total - n))
        return m.maximum(0.0, floor_ratio + (1.0 - floor_ratio) * ((1 + m.cos(m.pi * progress)) / 2))

    return m.where(t < 0, lambda: 0.0, lambda: s["base_lr"] * m.where(t < n, warmup_ratio, cosine_ratio))


def _range_test_lr(s, m, t):
    size = s["lr_range_test_step_size"]
    interval = m.floor((t + 1) / size) if s["lr_range_test_staircase"] else (t + 1) / size
    return s["lr_range_test_min_lr"] * (1 + s["lr_range_test_step_rate"] * interval)


def _one_cycle_shape(s):
    first = float(s["cycle_first_step_size"])
    second = first if s["cycle_second_step_size"] is None else float(s["cycle_second_step_size"])
    first_stairs = s["cycle_first_stair_count"]
    second_stairs = first_stairs if s["cycle_second_stair_count"] is None else s["cycle_second_stair_count"]
    return first, second, first + second, first_stairs, second_stairs


def _one_cycle_scale(s, m, t):
    """OneCycle._get_scale_factor: 0 -> 1 over the first half of the cycle, 1 -> 0 over the second."""
    first, second, total, first_stairs, second_stairs = _one_cycle_shape(s)
    ratio = first / total
    b = t + 1
    x = 1.0 + b / total - m.floor(1 + b / total)

    def stairs(count):
        at = m.mod(b, total)
        position = m.where(at <= first, lambda: at * count / first, lambda: (total - at) * count / second)
        return m.floor(position) / count

    rising = (lambda: stairs(first_stairs)) if first_stairs > 0 else (lambda: x / ratio)
    falling = (lambda: stairs(second_stairs)) if second_stairs > 0 else (lambda: (x - 1) / (ratio - 1))
    return m.where(x <= ratio, rising, falling)


def _decays(s, rate_key):
    # DeepSpeed skips the decay when decay_step_size or the rate is math.isclose(x, 0): exactly 0.
    return s["decay_step_size"] != 0 and s[rate_key] != 0


def _decay_factor(s, t, rate_key):
    """1 + rate * decay_interval, the interval counted from the step after the cycle."""
    total = _one_cycle_shape(s)[2]
    return 1 + s[rate_key] * ((t - total + 1) / s["decay_step_size"])


def _one_cycle_lr(s, m, t):
    low, high, total = s["cycle_min_lr"], s["cycle_max_lr"], _one_cycle_shape(s)[2]
    cycle = lambda: low + (high - low) * _one_cycle_scale(s, m, t)
    decay = (lambda: low / _decay_factor(s, t, "decay_lr_rate")) if _decays(s, "decay_lr_rate") else (lambda: low)
    return m.where(t < total, cycle, decay)


def _one_cycle_momentum(s, m, t):
    low, high, total = s["cycle_min_mom"], s["cycle_max_mom"], _one_cycle_shape(s)[2]
    cycle = lambda: high - (high - low) * _one_cycle_scale(s, m, t)
    decay = (lambda: high * _decay_factor(s, t, "decay_mom_rate")) if _decays(s, "decay_mom_rate") else (lambda: high)
    return m.where(t < total, cycle, decay)


_LR = {"WarmupLR": _warmup_lr, "WarmupDecayLR": _warmup_lr, "WarmupCosineLR": _warmup_cosine_lr,
       "OneCycle": _one_cycle_lr, "LRRangeTest": _range_test_lr}

# What each constructor writes into the param groups when last_batch_iteration == -1.
_CONSTRUCTOR_LR = {"WarmupLR": "warmup_min_lr", "WarmupDecayLR": "warmup_min_lr", "WarmupCosineLR": None,
                   "OneCycle": "cycle_min_lr", "LRRangeTest": "lr_range_test_min_lr"}


@dataclass(frozen=True)
class Schedule:
    """A validated DeepSpeed scheduler: the lr (and momentum) each applied update k = 0, 1, ... uses.

    Attributes:
        type: one of SCHEDULERS.
        params: the block's params as given, as (name, value) pairs; `settings`
            adds DeepSpeed's defaults.
        base_lr: the optimizer's own lr. WarmupCosineLR scales it, WarmupLR's
            warmup_max_lr defaults to it, and the first update uses it when
            last_batch_iteration is not -1 (the constructor then leaves the
            param groups alone). None where none of these applies.
        base_momentum: the optimizer's beta_1, which the first update uses when
            OneCycle cycles momentum and last_batch_iteration is not -1.

    Construct it with `parse_scheduler` (a block, with JSON key paths in the
    errors), or directly; either way it is validated.
    """

    type: str
    params: tuple[tuple[str, Any], ...] = ()
    base_lr: float | None = None
    base_momentum: float | None = None

    def __post_init__(self):
        pairs = self.params.items() if isinstance(self.params, Mapping) else self.params
        object.__setattr__(self, "params", tuple((k, values.plain(v)) for k, v in pairs))
        object.__setattr__(self, "base_lr", values.plain(self.base_lr))
        object.__setattr__(self, "base_momentum", values.plain(self.base_momentum))
        check(_problems(self.type, dict(self.params), self.base_lr, self.base_momentum, "scheduler"), _SOURCE)
        for note in (_short_decay(self.type, self.settings), _inverted_cycle(self.type, self.settings)):
            if note:
                # stacklevel 1: one place for every reader (load_config, kmp.wrap, the Keras
                # schedule), so the default filter says it once per process.
                warnings.warn(note, UserWarning, stacklevel=1)

    @property
    def settings(self) -> dict[str, Any]:
        """Every parameter, DeepSpeed's default where the block has none, and `base_lr`."""
        s = {**PARAMETERS[self.type], **dict(self.params), "base_lr": self.base_lr}
        if "warmup_max_lr" in s and s["warmup_max_lr"] is None:
            s["warmup_max_lr"] = self.base_lr  # WarmupLR: [group['lr'] for group in param_groups]
        return s

    @property
    def last_batch_iteration(self) -> int:
        return self.settings["last_batch_iteration"]

    @property
    def cycles_momentum(self) -> bool:
        """OneCycle with cycle_momentum (DeepSpeed's default): beta_1 follows `momentum_at`, beta_2 is 0.99."""
        return self.type == "OneCycle" and self.settings["cycle_momentum"]

    def block(self) -> dict[str, Any]:
        """The scheduler block, as given: parse_scheduler(schedule.block(), ...) == schedule."""
        return {"type": self.type, "params": dict(self.params)}

    def lr_at(self, step, math=PythonMath):
        """The lr of the update applied after `step` others.

        `step`: an int with PythonMath (a Python float back), an integer
        tensor with kmp.schedules.keras.KerasMath (a float32 tensor back).
        """
        s = self.settings
        last = s["last_batch_iteration"]
        key = _CONSTRUCTOR_LR[self.type]
        first = self.base_lr if last != -1 else (0.0 if key is None else s[key])
        return self._at(step, math, first, lambda t: _LR[self.type](s, math, t))

    def momentum_at(self, step, math=PythonMath):
        """OneCycle's beta_1 for the update applied after `step` others; None if momentum does not cycle."""
        if not self.cycles_momentum:
            return None
        s = self.settings
        # The constructor sets cycle_min_mom, not the formula's value at -1 (cycle_max_mom).
        first = s["cycle_min_mom"] if s["last_batch_iteration"] == -1 else self.base_momentum
        return self._at(step, math, first, lambda t: _one_cycle_momentum(s, math, t))

    def _at(self, step, math, first, formula):
        if math is PythonMath and not (values.is_int(step) and step >= 0):
            raise ValueError(str(Problem("step", "an integer >= 0 (the updates applied before this one)", step)))
        last = self.last_batch_iteration
        return math.where(math.equal(step, 0), lambda: first, lambda: formula(math.step(step) + last))

    def milestones(self) -> tuple[int, ...]:
        """Steps k where a phase starts or ends (warmup, decay, cycle), and their neighbours: rows for a table."""
        s, last = self.settings, self.last_batch_iteration
        if self.type == "OneCycle":
            first, _, total, _, _ = _one_cycle_shape(s)
            ends = [math.ceil(first) - 1, math.ceil(total)]
        elif self.type == "LRRangeTest":
            ends = [s["lr_range_test_step_size"] - 1]
        else:
            n = max(2, s["warmup_num_steps"])
            ends = [n]
            if self.type == "WarmupDecayLR":
                ends.append(s["total_num_steps"])
            elif self.type == "WarmupCosineLR":
                ends.append(n - 1 + max(1, s["total_num_steps"] - n))
        steps = {0, 1} | {t - last + d for t in ends for d in (-1, 0, 1)}
        return tuple(sorted(k for k in steps if k >= 0))


def _short_decay(kind: str, s: Mapping[str, Any]) -> str:
    """DeepSpeed's warning for a decay that ends before warmup does, with what the lr then does; or ''."""
    if "total_num_steps" not in s or s["total_num_steps"] >= max(2, s["warmup_num_steps"]):
        return ""
    total, warmup = s["total_num_steps"], s["warmup_num_steps"]
    floor = (f"warmup_min_lr ({s['warmup_min_lr']:g})" if kind == "WarmupDecayLR" else
             f"cos_min_ratio ({s['cos_min_ratio']:g}) times the lr")
    return (f"{kind}: total_num_steps ({total}) is less than warmup_num_steps ({warmup}), as DeepSpeed warns too: "
            f"the lr warms up over {warmup} steps, then drops straight to {floor} instead of decaying to it. "
            f"Set total_num_steps to the run's whole number of steps, warmup included (above {warmup}).")


def _inverted_cycle(kind: str, s: Mapping[str, Any]) -> str:
    """For a OneCycle whose cycle_min_lr is above its cycle_max_lr (DeepSpeed takes it silently): what the lr
    then does; or ''."""
    if kind != "OneCycle" or s["cycle_min_lr"] <= s["cycle_max_lr"]:
        return ""
    low, high = s["cycle_min_lr"], s["cycle_max_lr"]
    return (f"OneCycle: cycle_min_lr ({low:g}) is above cycle_max_lr ({high:g}), which DeepSpeed accepts too: the lr "
            f"falls from {low:g} to {high:g} over the cycle's first half and rises back, then stays at (or decays "
            f"from) {low:g}. Swap the two for a cycle that rises to cycle_max_lr.")


_SOURCE = "DeepSpeed scheduler block"


def parse_scheduler(block: Any, *, base_lr: float | None = None, base_momentum: float | None = None,
                    path: str = "scheduler") -> Schedule:
    """A `Schedule` from a DeepSpeed `scheduler` block {"type": ..., "params": {...}} (no "auto" values).

    Raises one ConfigError listing every problem, each at its key path
    (`scheduler.params.warmup_num_steps`), with a did-you-mean for misspelled
    names: DeepSpeed passes params as constructor keyword arguments, so it
    fails on an unknown one too.
    """
    if not isinstance(block, Mapping):
        check([Problem(path, 'an object {"type": ..., "params": {...}}', block)], _SOURCE)
    problems = [Problem(f"{path}.{values.key_name(k)}", "a key of the scheduler block ('type', 'params')", v,
                        did_you_mean(k, ("type", "params")) if isinstance(k, str) else "")
                for k, v in block.items() if k not in ("type", "params")]
    params = block.get("params", _NOT_GIVEN)
    if not isinstance(params, Mapping):
        problems.append(Problem(f"{path}.params", "an object of the scheduler's parameters", params,
                                'DeepSpeed passes it to the scheduler as keyword arguments and fails without it; '
                                '"params": {} takes every default.'))
        params = {}
    problems += _problems(block.get("type", _NOT_GIVEN), params, base_lr, base_momentum, path)
    check(problems, _SOURCE)
    return Schedule(block["type"], tuple(params.items()), base_lr, base_momentum)


def _problems(kind: Any, params: Mapping, base_lr: Any, base_momentum: Any, path: str) -> list[Problem]:
    out: list[Problem] = []
    if not (isinstance(kind, str) and kind in SCHEDULERS):
        hint = next((f"Did you mean '{n}'?" for n in SCHEDULERS if isinstance(kind, str) and n.lower() == kind.lower()),
                    did_you_mean(kind, SCHEDULERS) if isinstance(kind, str) else "")
        fix = f"{hint} DeepSpeed also takes torch.optim.lr_scheduler classes by name; kmp does not.".strip()
        return [Problem(f"{path}.type", "one of " + ", ".join(repr(n) for n in SCHEDULERS), kind, fix)]
    defaults = PARAMETERS[kind]
    for name, value in params.items():
        where = f"{path}.params.{values.key_name(name)}"
        if name not in defaults:
            owners = [k for k, p in PARAMETERS.items() if name in p]
            if owners:
                hint = f"It is a parameter of {', '.join(owners)}."
            elif name in _DOC_NAMES:
                hint = f"Did you mean '{_DOC_NAMES[name]}'? (DeepSpeed's tutorial says {name}; its code does not.)"
            else:
                hint = did_you_mean(name, defaults) if isinstance(name, str) else ""
            out.append(Problem(where, f"a parameter of {kind} ({', '.join(defaults)})", value,
                               f"{hint} DeepSpeed fails on it too (params are constructor arguments).".strip()))
        elif isinstance(value, (list, tuple)) and name in _PER_GROUP:
            out.append(Problem(where, "one number", value, "DeepSpeed's per-param-group lists are not supported: "
                               "a Keras optimizer has one learning rate and momentum for all its variables."))
        else:
            _CHECKS[name](where, value, out)
    for name, default in defaults.items():
        if default is REQUIRED and name not in params:
            out.append(Problem(f"{path}.params.{name}", f"a number (DeepSpeed's {kind} has no default for it)",
                               _NOT_GIVEN))
    return out + _base_problems(kind, params, base_lr, base_momentum, needs=not out)


def _base_problems(kind, params, base_lr, base_momentum, needs: bool) -> list[Problem]:
    """base_lr / base_momentum: checked when given; when `needs`, required where the schedule reads them."""
    out: list[Problem] = []
    if base_lr is not None:
        values.number_in("base_lr", base_lr, out, at_least=0.0)
    if base_momentum is not None:
        _momentum("base_momentum", base_momentum, out)
    if not needs:
        return out
    s = {**PARAMETERS[kind], **params}
    resumes = s["last_batch_iteration"] != -1
    if base_lr is None:
        why = ("scales the optimizer's lr" if kind == "WarmupCosineLR" else
               "warms up to the optimizer's lr (warmup_max_lr is null)" if s.get("warmup_max_lr", 0) is None else
               "leaves the optimizer's lr for the first update (last_batch_iteration is not -1)" if resumes else "")
        if why:
            out.append(Problem("base_lr", "the optimizer's learning rate, a number >= 0", None,
                               f"{kind} {why}: pass it (optimizer.params.lr in a DeepSpeed config)."))
    if base_momentum is None and kind == "OneCycle" and s["cycle_momentum"] and resumes:
        out.append(Problem("base_momentum", "the optimizer's beta_1, a number from 0 to 1", None,
                           "OneCycle with last_batch_iteration not -1 leaves the optimizer's betas for the first "
                           "update: pass beta_1 (optimizer.params.betas[0] in a DeepSpeed config)."))
    return out
