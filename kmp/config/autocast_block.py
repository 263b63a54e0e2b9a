"""DeepSpeed's `torch_autocast` and `data_types` blocks: their keys checked, and what each means to kmp.

    precision, safe, notes = read_autocast(block, problems)   # ("fp16"/"bf16", torch names) or (None, None)
    notes = read_data_types(block, block_precision, problems)
    keras, why_not = keras_classes(safe)      # torch names -> Keras layer class names; the rest, with why

What DeepSpeed does (deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641:
deepspeed/runtime/config.py get_torch_autocast_*, DtypeEnum, get_data_types_params;
runtime/torch_autocast.py; runtime/engine.py get_data_types, _do_optimizer_sanity_check,
_assert_valid_mixed_precision_config; docs/code-docs/source/training.rst):

- `torch_autocast.enabled` (default false) runs the forward pass under
  `torch.autocast(dtype)`. It may stand beside an enabled fp16 or bf16 block
  (DeepSpeed dropped its check that the model be float32 in #7543). With
  float16 it scales the loss with `torch.amp.GradScaler()` when the fp16
  block does not.
- `lower_precision_safe_modules` (default Linear, Conv1d, Conv2d, Conv3d):
  DeepSpeed communicates the gradients of these modules' parameters in the
  autocast dtype; torch.autocast's own list of ops decides what computes in
  it (matmuls and convolutions low, normalizations, softmax and losses in
  float32).

kmp has no op list: it reads the module list as that list, by layer class.
Layers whose class does what a listed module does compute in the autocast
dtype; every other layer computing on its own (a layer with no layers inside)
computes in float32 (kmp.engine.lower_precision). With the default list that
is torch.autocast's split: Dense and convolutions low, the rest float32.
kmp all-reduces every gradient in `communication_data_type` (float32 unless
set), whatever the list.

Unknown keys in both blocks are errors with a did-you-mean. DeepSpeed reads
its known keys and ignores the others, but a misspelled
`lower_precision_safe_modules` would silently change which layers compute in
float32. Pure Python: the Keras classes are named here, looked up by
kmp.engine.lower_precision.
"""

from __future__ import annotations

from typing import Any, Mapping

from kmp.errors import Problem, did_you_mean
from kmp.values import key_name

# DeepSpeed's DtypeEnum: every spelling of each dtype it accepts.
DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "int8": ("torch.int8", "int8"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16"),
}
_DTYPE_OF = {spelling: name for name, spellings in DTYPE_SPELLINGS.items() for spelling in spellings}
# How to_deepspeed writes the autocast dtype (the spelling of DeepSpeed's documentation).
AUTOCAST_DTYPE_NAME = {"fp16": "float16", "bf16": "bfloat16"}

# DeepSpeed's LOWER_PRECISION_SAFE_MODULES, in its documentation's spelling.
DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")

# torch.nn classes -> the keras.layers classes that do the same job (a subclass counts as its class).
TORCH_TO_KERAS: dict[str, tuple[str, ...]] = {
    "Linear": ("Dense", "EinsumDense"),
    "LazyLinear": ("Dense", "EinsumDense"),
    **{f"{lazy}Conv{n}d": (f"Conv{n}D",) + ((f"DepthwiseConv{n}D", f"SeparableConv{n}D") if n < 3 else ())
       for lazy in ("", "Lazy") for n in (1, 2, 3)},
    **{f"{lazy}ConvTranspose{n}d": (f"Conv{n}DTranspose",) for lazy in ("", "Lazy") for n in (1, 2, 3)},
    "Embedding": ("Embedding",),
    "LayerNorm": ("LayerNormalization",),
    "RMSNorm": ("RMSNormalization",),
    "GroupNorm": ("GroupNormalization",),
    **{f"{lazy}BatchNorm{n}d": ("BatchNormalization",) for lazy in ("", "Lazy") for n in (1, 2, 3)},
    # A Keras RNN layer holds its cell, the layer that computes: both are named.
    "LSTM": ("LSTM", "LSTMCell"),
    "GRU": ("GRU", "GRUCell"),
    "RNN": ("SimpleRNN", "SimpleRNNCell"),
    "Softmax": ("Softmax",),
    "ReLU": ("ReLU",),
    "Dropout": ("Dropout",),
}
# torch.nn classes with a reason of their own; any other is said with the generic one (`keras_classes`).
NO_KERAS: dict[str, str] = {
    "MultiheadAttention": "Keras's MultiHeadAttention is a layer of layers (its EinsumDense projections, a "
                          "Softmax, a Dropout), each placed by its own class: list torch.nn.Linear for the "
                          "projections",
    "Bilinear": "Keras has no bilinear layer",
    "GELU": "Keras applies GELU as an activation function (activation='gelu', or an Activation layer of any "
            "function), not as a layer class of its own",
    "SiLU": "Keras applies SiLU as an activation function, not as a layer class of its own",
    "Tanh": "Keras applies tanh as an activation function, not as a layer class of its own",
    "Sigmoid": "Keras applies sigmoid as an activation function, not as a layer class of its own",
}


def torch_class(name: str) -> str | None:
    """"Linear" for "torch.nn.Linear" or "torch.nn.modules.linear.Linear"; None for a name outside torch.nn."""
    parts = name.split(".")
    if parts[:2] != ["torch", "nn"] or len(parts) < 3:
        return None
    if len(parts) == 3 or (parts[2] == "modules" and len(parts) == 5):
        return parts[-1]
    return None


def keras_classes(names: tuple[str, ...]) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """({torch name: Keras layer class names}, {torch name: why it maps to none}) for `names`."""
    mapped: dict[str, tuple[str, ...]] = {}
    why_not: dict[str, str] = {}
    for name in names:
        short = torch_class(name)
        if short is None:
            why_not[name] = ("not a torch.nn class: a model's own PyTorch class has no Keras counterpart kmp can "
                             "know; its Keras layers compute in float32 unless their class is listed")
        elif short in TORCH_TO_KERAS:
            mapped[name] = TORCH_TO_KERAS[short]
        elif short in NO_KERAS:
            why_not[name] = NO_KERAS[short]
        else:
            hint = did_you_mean(short, [*TORCH_TO_KERAS, *NO_KERAS])
            why_not[name] = (f"kmp knows no Keras layer class doing the job of torch.nn.{short}" +
                             (f"; {hint[:-1]}" if hint else f"; it maps {', '.join(sorted(TORCH_TO_KERAS))}"))
    return mapped, why_not


def unmapped_note(names: tuple[str, ...]) -> str | None:
    """The one warning for the names of `lower_precision_safe_modules` that map to no Keras class, or None."""
    _, why_not = keras_classes(names)
    if not why_not:
        return None
    return ("torch_autocast.lower_precision_safe_modules: kmp cannot map these to Keras layer classes, so they "
            "name no layer that computes in the lower precision: " +
            "; ".join(f"{name} ({why})" for name, why in why_not.items()) + ".")


_LOW = DTYPE_SPELLINGS["fp16"] + DTYPE_SPELLINGS["bf16"]
_DATA_DTYPES = DTYPE_SPELLINGS["fp32"] + _LOW

# key -> (expected, default when left out, what kmp does): the readers' keys and docs/config.md's reference.
AUTOCAST_KEYS: dict[str, tuple[str, str, str]] = {
    "enabled": ("true or false", "false", "true: the model computes in `dtype` (an fp16 or bf16 block beside it "
                "must ask for the same); float16 without an enabled fp16 block scales the loss as "
                "torch.amp.GradScaler() does (initial 2^16, growth after 2000 steps without an overflow, no "
                "hysteresis)"),
    "dtype": ("one of " + ", ".join(f"`{s}`" for s in _LOW), '"bfloat16" (DeepSpeed\'s documentation)',
              "the precision; a float32 or int8 spelling is refused (torch.autocast computes in float16 or "
              "bfloat16 only)"),
    "lower_precision_safe_modules": ("a list of torch module names", "`" + ", ".join(DEFAULT_SAFE_MODULES) + "`",
                                     "the Keras layers of these classes (table below) compute in `dtype`; every "
                                     "other layer with no layers inside computes in float32 (`kmp.prepare`)"),
}
DATA_TYPES_KEYS: dict[str, tuple[str, str, str]] = {
    "grad_accum_dtype": ("one of " + ", ".join(f"`{s}`" for s in _DATA_DTYPES) + " or null", "null",
                         "kmp accumulates in float32 whatever it says; a bf16 or fp16 value is answered by a "
                         "warning"),
    "param_dtype": ("the same, matching the fp16/bf16 blocks (null, fp32 for neither)", "null",
                    "checked as DeepSpeed asserts it; kmp's weights are float32 masters cast per layer"),
    "buffer_dtype": ("the same", "null",
                     "kmp keeps non-trainable variables in float32; a bf16 or fp16 value is answered by a warning"),
}


def read_autocast(block: Any, problems: list[Problem]) -> tuple[str | None, tuple[str, ...] | None, list[str]]:
    """(precision "fp16"/"bf16", the safe module names, warnings) of a `torch_autocast` block; (None, None, ...)
    when it is off. Its problems are appended to `problems`."""
    if not isinstance(block, Mapping):
        problems.append(Problem("torch_autocast", "a JSON object {...}", block))
        return None, None, []
    found = len(problems)
    known = tuple(AUTOCAST_KEYS)
    for key, value in block.items():
        if key not in known:
            problems.append(Problem(f"torch_autocast.{key_name(key)}", "a key of torch_autocast that kmp or "
                                    "DeepSpeed knows", value, did_you_mean(str(key), known) or
                                    f"torch_autocast accepts: {', '.join(known)}."))
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        problems.append(Problem("torch_autocast.enabled", "true or false", enabled))
    dtype = block.get("dtype")
    if "dtype" in block and not (isinstance(dtype, str) and dtype in _LOW):
        fix = ""
        if isinstance(dtype, str) and _DTYPE_OF.get(dtype) in ("fp32", "int8"):
            fix = ("torch.autocast computes in float16 or bfloat16 only; for float32, set enabled to false "
                   "(or leave the block out).")
        problems.append(Problem("torch_autocast.dtype", "one of " + ", ".join(repr(s) for s in _LOW), dtype, fix))
    safe = block.get("lower_precision_safe_modules")
    if "lower_precision_safe_modules" in block and not (
            isinstance(safe, list) and all(isinstance(name, str) for name in safe)):
        problems.append(Problem("torch_autocast.lower_precision_safe_modules",
                                'a list of torch module names, e.g. ["torch.nn.Linear", "torch.nn.Conv2d"]', safe))
    if len(problems) > found or not enabled:
        return None, None, []
    notes = []
    if dtype is None:
        notes.append("torch_autocast.dtype is not given: kmp computes in bf16, the default DeepSpeed's "
                     "documentation gives (its code leaves the choice to torch.autocast, whose CUDA default is "
                     "float16). Set it to say which.")
    safe = DEFAULT_SAFE_MODULES if safe is None else tuple(safe)
    note = unmapped_note(safe)
    if note:
        notes.append(note)
    return ("bf16" if dtype is None else _DTYPE_OF[dtype]), safe, notes


_DATA_TYPES_KEYS = tuple(DATA_TYPES_KEYS)


def read_data_types(block: Any, block_precision: str, problems: list[Problem]) -> list[str]:
    """The warnings of a `data_types` block; its problems appended to `problems`.

    `block_precision`: what the fp16/bf16 blocks ask for ("fp32" for neither), which DeepSpeed's
    `param_dtype` must match (its torch_autocast dtype does not count there).
    """
    if not isinstance(block, Mapping):
        problems.append(Problem("data_types", "a JSON object {...}", block))
        return []
    notes = []
    for key, value in block.items():
        path = f"data_types.{key_name(key)}"
        if key not in _DATA_TYPES_KEYS:
            problems.append(Problem(path, "a key of data_types that kmp or DeepSpeed knows", value,
                                    did_you_mean(str(key), _DATA_TYPES_KEYS) or
                                    f"data_types accepts: {', '.join(_DATA_TYPES_KEYS)}."))
            continue
        if value is None:  # DeepSpeed's default: follow the model's dtype
            continue
        if not (isinstance(value, str) and value in _DATA_DTYPES):
            fix = ("DeepSpeed refuses it too: an 'unsupported mix' with the model's dtype."
                   if key == "grad_accum_dtype" and value in DTYPE_SPELLINGS["int8"] else "")
            problems.append(Problem(path, "one of " + ", ".join(repr(s) for s in _DATA_DTYPES) + " or null",
                                    value, fix))
            continue
        dtype = _DTYPE_OF[value]
        if key == "grad_accum_dtype" and dtype != "fp32":
            notes.append(f"data_types.grad_accum_dtype is {value!r}: kmp accumulates gradients in float32 (one "
                         "float32 sum per weight, as its master weights), which rounds less than a "
                         f"{dtype} sum would, over any number of micro-batches.")
        elif key == "param_dtype" and dtype != block_precision:
            problems.append(Problem(path, f"{block_precision!r}, the dtype the fp16/bf16 blocks give the model "
                                    "(or null)", value, "DeepSpeed asserts the same: set the matching fp16/bf16 "
                                    "'enabled' flag, or leave data_types.param_dtype out."))
        elif key == "buffer_dtype" and dtype != "fp32":
            notes.append(f"data_types.buffer_dtype is {value!r}: kmp keeps a model's non-trainable variables "
                         "(BatchNormalization's moving statistics) in float32, as Keras's mixed policies do.")
    return notes
