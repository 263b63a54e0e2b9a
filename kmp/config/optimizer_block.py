"""DeepSpeed's `optimizer` block as a Keras optimizer: which class, which arguments, what differs.

DeepSpeed builds its optimizer by passing `params` as keyword arguments to one
class (deepspeed/runtime/engine.py, `_configure_basic_optimizer`). So here:

- a param that class does not take is an error (DeepSpeed fails there too);
- a param left out gets that class's default, not Keras's (Keras's AdamW
  decays weights by 0.004 by default; DeepSpeed's Adam by 0);
- type names in DeepSpeed's own list are case-insensitive ("Adam", "adamw",
  "Lamb", "Lion", "Adagrad", "OneBitAdam", ...); others name a torch.optim
  class exactly ("SGD"), as DeepSpeed's `getattr(torch.optim, name)`.

"Adam" means decoupled weight decay (AdamW) unless `adam_w_mode` is false,
as DeepSpeed's ADAM_W_MODE_DEFAULT = True. 1-bit / 0-1 variants are their
base optimizer, every step uncompressed as in DeepSpeed's warmup stage.
What Keras's class cannot do (an L2 weight decay, no bias correction,
LAMB's trust-ratio bounds, ...) is listed by `keras_arguments` and warned
about once by `build_optimizer`. Pure Python: keras is imported only to build.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from kmp import values
from kmp.errors import ConfigError, Problem, did_you_mean

_ADAM = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
         "amsgrad": False}
_ONEBIT = {"freeze_step": 100000, "eps_inside_sqrt": False, "cuda_aware": False,
           "comm_backend_name": "nccl"}
_LAMB_BOUNDS = {"max_coeff": 10.0, "min_coeff": 0.01}

# type -> (its constructor's params and defaults, the source of those defaults)
OPTIMIZERS: dict[str, dict[str, Any]] = {
    # deepspeed/ops/adam/fused_adam.py FusedAdam; adam_w_mode/torch_adam popped by the engine
    "adam": {**_ADAM, "adam_w_mode": True, "torch_adam": False, "set_grad_none": True},
    "adamw": {**_ADAM, "adam_w_mode": True, "torch_adam": False, "set_grad_none": True},
    # deepspeed/ops/lamb/fused_lamb.py FusedLamb
    "lamb": {**_ADAM, "eps_inside_sqrt": False, **_LAMB_BOUNDS},
    # deepspeed/ops/lion/fused_lion.py FusedLion (betas default (0.9, 0.999), not Keras's 0.99)
    "lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "set_grad_none": True},
    # torch.optim.Adagrad (torch 2.13)
    "adagrad": {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10,
                "foreach": None, "maximize": False, "differentiable": False, "fused": None},
    # torch.optim.SGD (torch 2.13)
    "SGD": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
            "maximize": False, "foreach": None, "differentiable": False, "fused": None},
    # deepspeed/runtime/fp16/onebit/{adam,zoadam,lamb}.py
    "onebitadam": {**_ADAM, **_ONEBIT},
    "zerooneadam": {**_ADAM, **_ONEBIT, "var_freeze_step": 100000, "var_update_scaler": 16,
                    "local_step_scaler": 32678, "local_step_clipper": 16},
    "onebitlamb": {**_ADAM, **_ONEBIT, **_LAMB_BOUNDS, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                   "factor_threshold": 0.1},
}
COMPRESSED = {"onebitadam": "adamw", "zerooneadam": "adamw", "onebitlamb": "lamb"}
# What kmp does not do of each compressed type (deepspeed/runtime/fp16/onebit/): every step
# stays an uncompressed step of the base optimizer, as in DeepSpeed's warmup stage.
_UNCOMPRESSED = {
    "onebitadam": "from freeze_step ({freeze_step}) on, DeepSpeed freezes the variance and all-reduces the "
                  "momentum in 1 bit: kmp does neither, every step stays uncompressed as in DeepSpeed's warmup",
    "zerooneadam": "DeepSpeed freezes the variance from var_freeze_step ({var_freeze_step}) on, skips all-reduces "
                   "on local steps and all-reduces the momentum in 1 bit: kmp does none of this, every step stays "
                   "uncompressed",
    "onebitlamb": "from freeze_step ({freeze_step}) on, DeepSpeed freezes the variance and the trust ratios (then "
                  "scaled within [factor_min, factor_max]) and all-reduces the momentum in 1 bit: kmp does none "
                  "of this, every step stays uncompressed as in DeepSpeed's warmup",
}
# Names DeepSpeed lower-cases (its DEEPSPEED_OPTIMIZERS) but kmp does not build.
_NOT_BUILT = ("muadam", "muadamw", "musgd", "muon")
# Settings of an implementation, with no effect on the numbers: accepted, nothing to honour.
_IMPLEMENTATION = {"set_grad_none", "torch_adam", "foreach", "differentiable", "fused", "cuda_aware",
                   "comm_backend_name", "freeze_step", "var_freeze_step", "var_update_scaler",
                   "local_step_scaler", "local_step_clipper", "coeff_beta", "factor_max", "factor_min",
                   "factor_threshold"}


def canonical_type(name: Any) -> str | None:
    """The table's key for a DeepSpeed optimizer type, or None."""
    if not isinstance(name, str):
        return None
    if name.lower() in OPTIMIZERS and name.lower() != "sgd":
        return name.lower()
    return name if name in OPTIMIZERS else None


@dataclass(frozen=True)
class OptimizerSpec:
    """A checked `optimizer` block: DeepSpeed's type (canonical) and every param, defaults filled in."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)
    written: tuple[str, ...] = field(default=(), compare=False)  # the params the file gave

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(self.params))


def parse_optimizer(block: Any, prefix: str = "optimizer"
                    ) -> tuple[OptimizerSpec | None, list[Problem], list[str]]:
    """(the block as an OptimizerSpec, every problem found (key paths under `prefix`), warnings to give)."""
    if not isinstance(block, Mapping):
        return None, [Problem(prefix, '{"type": ..., "params": {...}}', block)], []
    problems: list[Problem] = []
    notes: list[str] = []
    for key in block:
        if key not in ("type", "params", "legacy_fusion"):
            problems.append(Problem(f"{prefix}.{values.key_name(key)}", "type, params or legacy_fusion", block[key],
                                    did_you_mean(str(key), ["type", "params"])))
    name = block.get("type")
    kind = canonical_type(name)
    if kind is None:
        built = sorted({"Adam", "AdamW", "Lamb", "Lion", "Adagrad", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"})
        fix = (f"kmp builds {', '.join(built)}; for another, pass a Keras optimizer to kmp.wrap and drop this block."
               if not (isinstance(name, str) and name.lower() in _NOT_BUILT) else
               "kmp does not build mu-P or Muon optimizers: pass a Keras optimizer to kmp.wrap and drop this block.")
        same_letters = [b for b in built if isinstance(name, str) and b.lower() == name.lower()]
        hint = (f"Did you mean '{same_letters[0]}'?" if same_letters
                else did_you_mean(name, built) if isinstance(name, str) else "")
        problems.append(Problem(f"{prefix}.type", "one of " + ", ".join(built), name, f"{hint} {fix}".strip()))
        return None, problems, notes
    params = block.get("params", {})
    if not isinstance(params, Mapping):
        return None, problems + [Problem(f"{prefix}.params", "a JSON object {...}", params)], notes
    known = OPTIMIZERS[kind]
    for key, value in params.items():
        path = f"{prefix}.params.{values.key_name(key)}"
        if key == "max_grad_norm":
            # Files from before DeepSpeed 0.3 have it; DeepSpeed now refuses it.
            notes.append(f"{path}={value!r} is ignored: DeepSpeed refuses it today ('use the deepspeed parameter "
                         "gradient_clipping'), and so does kmp's clipping: set the top-level gradient_clipping.")
        elif key not in known:
            problems.append(Problem(path, f"a parameter of {name} ({', '.join(sorted(known))})", value,
                                    did_you_mean(str(key), list(known)) or "DeepSpeed passes params to the "
                                    "optimizer's constructor, which would refuse it."))
        else:
            _check_param(path, key, value, known[key], problems)
    if params.get("amsgrad") is True and kind in ("lamb", "onebitadam", "zerooneadam", "onebitlamb"):
        problems.append(Problem(f"{prefix}.params.amsgrad", "false", True, f"DeepSpeed's {name} refuses AMSGrad."))
    if problems:
        return None, problems, notes
    filled = {**known, **{k: values.plain(v) for k, v in params.items() if k in known}}
    if "betas" in filled:
        filled["betas"] = tuple(values.plain(b) for b in filled["betas"])
    if kind in ("adam", "adamw") and filled["torch_adam"] and "weight_decay" not in params and _decoupled(kind, filled):
        filled["weight_decay"] = 1e-2  # torch.optim.AdamW's default, which torch_adam selects
    return OptimizerSpec(kind, filled, tuple(k for k in params if k in known)), [], notes


def _check_param(path: str, key: str, value: Any, default: Any, problems: list[Problem]) -> None:
    if key == "betas":
        ok = (isinstance(value, (list, tuple)) and len(value) == 2
              and all(values.is_number(b) and 0 <= b < 1 for b in value))
        if not ok:
            problems.append(Problem(path, "[beta1, beta2], each in [0, 1)", value))
    elif isinstance(default, bool) or default is None:
        if not (isinstance(value, bool) or (default is None and value is None)):
            problems.append(Problem(path, "true or false", value))
    elif isinstance(default, str):
        if not isinstance(value, str):
            problems.append(Problem(path, "a string", value))
    elif isinstance(default, int) and not isinstance(default, bool) and key.endswith(("step", "scaler", "clipper")):
        values.int_in(path, value, 0, problems)
    elif key == "eps":
        values.number_in(path, value, problems, above=0)
    else:
        values.number_in(path, value, problems, at_least=0)


def _decoupled(kind: str, params: Mapping[str, Any]) -> bool:
    return kind in ("adamw", "onebitadam", "zerooneadam") or bool(params.get("adam_w_mode", True))


def keras_arguments(spec: OptimizerSpec) -> tuple[str, dict[str, Any], list[str]]:
    """(Keras optimizer class name, its arguments, what Keras's class does differently) for `spec`."""
    kind, p = COMPRESSED.get(spec.type, spec.type), spec.params
    notes: list[str] = []
    if spec.type in COMPRESSED:
        notes.append(_UNCOMPRESSED[spec.type].format(**p))
    args: dict[str, Any] = {"learning_rate": float(p["lr"])}
    if "betas" in p:
        args["beta_1"], args["beta_2"] = (float(b) for b in p["betas"])
    if "eps" in p:
        args["epsilon"] = float(p["eps"])
    decay = float(p.get("weight_decay", 0.0))
    coupled = kind in ("SGD", "adagrad") or (kind == "adam" and not _decoupled(kind, p))
    if coupled and decay > 0:
        notes.append(f"weight_decay={decay} is an L2 penalty added to the gradient in DeepSpeed's {kind}; "
                     "Keras decays weights decoupled (as AdamW), which kmp uses")
    args["weight_decay"] = decay or None
    if kind in ("adam", "adamw"):
        name = "AdamW" if _decoupled(kind, p) and decay > 0 else "Adam"
        args["amsgrad"] = bool(p["amsgrad"])
    elif kind == "lamb":
        name = "Lamb"
        notes.append("Keras's Lamb decays weights outside the trust ratio and does not bound it to "
                     f"[min_coeff, max_coeff] = [{p['min_coeff']}, {p['max_coeff']}]")
    elif kind == "lion":
        name = "Lion"
    elif kind == "adagrad":
        name = "Adagrad"
        args["initial_accumulator_value"] = float(p["initial_accumulator_value"])
        if p["lr_decay"]:
            notes.append(f"lr_decay={p['lr_decay']} is not honoured (Keras's Adagrad has none; use a schedule)")
    else:  # SGD
        name = "SGD"
        args["momentum"], args["nesterov"] = float(p["momentum"]), bool(p["nesterov"])
        if p["dampening"]:
            notes.append(f"dampening={p['dampening']} is not honoured (Keras's SGD has none)")
    if p.get("bias_correction") is False:
        notes.append("bias_correction=false is not honoured (Keras's Adam-family optimizers always correct)")
    if p.get("eps_inside_sqrt"):
        notes.append("eps_inside_sqrt=true is not honoured (Keras adds epsilon outside the square root)")
    if p.get("maximize"):
        notes.append("maximize=true is not honoured (Keras minimizes the loss)")
    return name, args, notes


def build_optimizer(spec: OptimizerSpec, learning_rate: Any = None, source: str = "the config's optimizer block"):
    """The Keras optimizer for `spec`; `learning_rate` (e.g. a schedule) replaces params.lr.

    Warns once, in one message, about everything Keras's class does differently.
    """
    import keras

    name, args, notes = keras_arguments(spec)
    if learning_rate is not None:
        args["learning_rate"] = learning_rate
    if notes:
        warnings.warn(f"kmp builds keras.optimizers.{name} from {source}; it differs from DeepSpeed's: "
                      + "; ".join(notes) + ".", UserWarning, stacklevel=3)
    return getattr(keras.optimizers, name)(**args)


def differences(spec: OptimizerSpec, optimizer) -> list[str]:
    """The params the config's block wrote that `optimizer` (a Keras optimizer) does not match."""
    name, args, _ = keras_arguments(spec)
    out = []
    if type(optimizer).__name__.lower() != name.lower() and not (
            name == "Adam" and type(optimizer).__name__ == "AdamW" and not args["weight_decay"]):
        out.append(f"type {name} vs {type(optimizer).__name__}")
    own = {"learning_rate": getattr(optimizer, "_learning_rate", None), "weight_decay": optimizer.weight_decay}
    for key in ("beta_1", "beta_2", "epsilon", "momentum", "nesterov", "initial_accumulator_value", "amsgrad"):
        if hasattr(optimizer, key):
            own[key] = getattr(optimizer, key)
    written = {"lr": "learning_rate", "betas": ("beta_1", "beta_2"), "eps": "epsilon", "weight_decay": "weight_decay",
               "momentum": "momentum", "nesterov": "nesterov", "amsgrad": "amsgrad",
               "initial_accumulator_value": "initial_accumulator_value"}
    for param in spec.written:
        keys = written.get(param)
        for key in (keys,) if isinstance(keys, str) else keys or ():
            mine, theirs = args.get(key), own.get(key)
            if key == "learning_rate" and theirs is not None and hasattr(theirs, "numpy"):
                theirs = float(theirs.numpy())
            if key in own and not _same(mine, theirs):
                out.append(f"{param}: {_shown(mine)} in the config, {_shown(theirs)} in the optimizer")
                break
    return out


def _shown(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return (a or 0) == (b or 0)
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if values.is_number(a) and values.is_number(b):
        return abs(float(a) - float(b)) <= 1e-7 * max(abs(float(a)), abs(float(b)))
    return False


def check(spec_or_block: Any, prefix: str = "optimizer") -> OptimizerSpec:
    """`parse_optimizer` that raises one ConfigError."""
    spec, problems, _ = parse_optimizer(spec_or_block, prefix)
    if problems:
        raise ConfigError(problems, "DeepSpeed optimizer block")
    return spec
