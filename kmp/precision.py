"""Precision spellings -> Keras dtype policies; "auto"; hardware checks.

Users arrive with Keras policy names, Lightning strings, DeepSpeed configs or
kmp's own `Config`. `resolve_precision` maps all of them to one `Precision`,
whose printed form is the Keras policy name it stands for, so
`resolve_precision(str(p)) == p`. The accepted strings live only in the
`Literal` types below: they are the type hints, the validation and the error
text at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, Union, get_args

import keras
import tensorflow as tf

from kmp.config.deepspeed import precision_of
from kmp.config.settings import Config
from kmp.errors import ConfigError, Problem, did_you_mean, loose
from kmp.values import is_int

logger = logging.getLogger(__name__)

PolicyName = Literal["float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "float64"]
LightningPrecision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"]
LegacyPrecision = Literal[16, 32, 64, "16", "32", "64", "bf16"]
ShortPrecision = Literal["fp32", "fp16"]  # DeepSpeed/kmp; "bf16" is also Lightning legacy
HardwareKind = Literal["cpu", "gpu", "tpu"]

_LIGHTNING: dict[str, str] = {
    "32-true": "float32", "16-mixed": "mixed_float16", "bf16-mixed": "mixed_bfloat16",
    "16-true": "float16", "bf16-true": "bfloat16", "64-true": "float64",
}
# Lightning's own table (lightning.fabric.connector): legacy -> new spelling.
_LEGACY: dict[int | str, str] = {
    16: "16-mixed", "16": "16-mixed", 32: "32-true", "32": "32-true",
    64: "64-true", "64": "64-true", "bf16": "bf16-mixed",
}
# Keys are config.PrecisionName; "fp16" means mixed (float32 master weights) as in DeepSpeed.
_SHORT: dict[str, str] = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}

_STRINGS: tuple[str, ...] = (
    get_args(PolicyName) + get_args(LightningPrecision) + get_args(ShortPrecision) + ("auto",)
)
_ACCEPTED = (
    f"one of {', '.join(repr(s) for s in _STRINGS)}; legacy "
    f"{', '.join(repr(s) for s in get_args(LegacyPrecision))}; "
    "or a keras.DTypePolicy, kmp.Precision, kmp.Config or DeepSpeed-style dict"
)


def _hint(value: str, choices: tuple[str, ...]) -> str:
    """'Did you mean ...?' among the spellings of the same format, or ''.

    The same format: with a b (bfloat16) or without, and the same width, so a
    near-miss of a bfloat16 spelling is never pointed at float16.
    """
    lowered = value.lower()
    same = [c for c in choices
            if ("b" in c) == ("b" in lowered) and all(width in c for width in ("16", "32", "64") if width in lowered)]
    return did_you_mean(value, same)


def _error(received: Any, path: str = "precision", expected: str = _ACCEPTED, fix: str = "") -> ConfigError:
    return ConfigError([Problem(path, expected, received, fix)], "precision setting")


@dataclass(frozen=True)
class Precision:
    """A resolved precision: the canonical Keras dtype-policy name."""

    name: PolicyName

    def __post_init__(self) -> None:
        names = get_args(PolicyName)
        if self.name not in names:
            hint = _hint(str(self.name), names)
            raise _error(self.name, "Precision.name", f"one of {', '.join(map(repr, names))}", hint)

    def __str__(self) -> str:
        return self.name

    @property
    def is_mixed(self) -> bool:
        return self.name.startswith("mixed_")

    @property
    def compute_dtype(self) -> str:
        return self.name.removeprefix("mixed_")

    @property
    def variable_dtype(self) -> str:
        return "float32" if self.is_mixed else self.name

    @property
    def needs_loss_scaling(self) -> bool:
        # float16 has 5 exponent bits: small gradients underflow to zero
        # unless the loss is scaled up. bfloat16 has float32's exponent range.
        return self.compute_dtype == "float16"

    def policy(self) -> keras.DTypePolicy:
        return keras.DTypePolicy(self.name)


@dataclass(frozen=True)
class Hardware:
    """What the precision choice depends on. Tests build these by hand."""

    kind: HardwareKind = "cpu"
    compute_capability: tuple[int, int] | None = None  # GPUs only; None = unknown

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in get_args(HardwareKind):
            kinds = ", ".join(map(repr, get_args(HardwareKind)))
            raise _error(self.kind, "Hardware.kind", f"one of {kinds}")
        if self.compute_capability is not None:  # a list [8, 0] would not compare with tuples
            cc = self.compute_capability
            if not isinstance(cc, (tuple, list)) or len(cc) != 2 or not all(is_int(n) and n >= 0 for n in cc):
                raise _error(cc, "Hardware.compute_capability", "None or (major, minor), two integers >= 0",
                             "As TensorFlow reports it, e.g. (8, 0).")
            object.__setattr__(self, "compute_capability", tuple(int(n) for n in cc))

    @classmethod
    def detect(cls) -> "Hardware":
        """The accelerator TensorFlow sees now.

        TPUs appear as logical devices only after the TPU system is
        initialized (as TPUStrategy setup does), so detect after that. Listing
        logical devices initializes the TF runtime: configure logical devices
        first.
        """
        if tf.config.list_logical_devices("TPU"):
            return cls("tpu")
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return cls("cpu")
        caps = [tf.config.experimental.get_device_details(g).get("compute_capability") for g in gpus]
        # Synchronous data parallelism runs at the pace of the weakest GPU;
        # one GPU without a known capability (e.g. ROCm) makes the whole unknown.
        known = [tuple(c) for c in caps if c is not None]
        return cls("gpu", min(known) if len(known) == len(caps) else None)


def _auto(hardware: Hardware) -> str:
    cc = hardware.compute_capability
    gpu = f"GPU compute capability {cc}"
    if hardware.kind == "tpu":
        name, why = "mixed_bfloat16", "TPU matrix units compute in bfloat16"
    elif hardware.kind == "gpu" and cc is None:
        name, why = "float32", "GPU compute capability unknown, so fast fp16/bf16 is not certain"
    elif hardware.kind == "gpu" and cc >= (8, 0):
        name, why = "mixed_bfloat16", f"{gpu} has bfloat16 Tensor Cores; no loss scaling needed"
    elif hardware.kind == "gpu" and cc >= (7, 0):
        name, why = "mixed_float16", f"{gpu} has float16 Tensor Cores but no fast bfloat16"
    elif hardware.kind == "gpu":
        name, why = "float32", f"{gpu} has no Tensor Cores; mixed precision gains little"
    else:
        # bfloat16 is faster on CPUs with AVX512_BF16/AMX, but auto does not
        # change a CPU run's numerics for a speedup most CPUs do not have.
        name, why = "float32", "CPU only: no fast float16 math, and fast bfloat16 only on some CPUs"
    # INFO, not a warning: this is the right choice for the hardware, nothing
    # to fix. A warning on every CPU run (CI, laptops) would teach users to
    # ignore warnings; those are kept for check_hardware's real mismatches.
    logger.info("precision='auto' -> %s: %s.", name, why)
    return name


PrecisionLike = Union[
    PolicyName, LightningPrecision, LegacyPrecision, ShortPrecision, Literal["auto"],
    Precision, keras.DTypePolicy, Config, Mapping[str, Any],
]


def _is_config_text_or_path(value: str) -> bool:
    return value.lstrip().startswith(("{", "[")) or value.endswith(".json") or os.path.isfile(value)


def resolve_precision(value: PrecisionLike, *, hardware: Hardware | None = None) -> Precision:
    """Map any accepted precision spelling to a `Precision` (see docs/precision.md).

    A DeepSpeed config (a dict, a kmp.Config, a path to a JSON file or JSON
    text) gives the precision its fp16/bf16 blocks ask for.
    """
    if hardware is not None and not isinstance(hardware, Hardware):
        raise _error(hardware, "hardware", "None (detect it) or a kmp.Hardware", "E.g. kmp.Hardware('gpu', (8, 0)).")
    if isinstance(value, Precision):
        return value
    if isinstance(value, keras.DTypePolicy):
        value = value.name  # a quantized policy's name ("int8_from_...") fails below
    elif isinstance(value, Config):
        if value.precision not in _SHORT:
            raise _error(value.precision, "Config.precision", f"one of {', '.join(map(repr, _SHORT))}")
        return Precision(_SHORT[value.precision])
    elif isinstance(value, Mapping):
        # The one DeepSpeed reader: the same blocks, defaults and errors as kmp.load_config.
        return Precision(_SHORT[precision_of(value)])
    # `type is int`: True == 1 and 16.0 == 16 must not pass as spellings.
    if (type(value) is int or isinstance(value, str)) and value in _LEGACY:
        new = _LEGACY[value]
        warnings.warn(
            f"precision={value!r} is a legacy spelling; use precision={new!r} instead.",
            UserWarning, stacklevel=2,
        )
        value = new
    if isinstance(value, str):
        if value == "auto":
            return Precision(_auto(hardware or Hardware.detect()))
        if value in get_args(PolicyName):
            return Precision(value)
        if value in _LIGHTNING:
            return Precision(_LIGHTNING[value])
        if value in get_args(ShortPrecision):
            return Precision(_SHORT[value])
        if _is_config_text_or_path(value):  # what kmp.load_config accepts
            return Precision(_SHORT[precision_of(value)])
        new = _LEGACY.get(loose(value))  # "BF16", "bf-16": Lightning's legacy "bf16" spelled otherwise
        raise _error(value, fix=f"Did you mean {new!r}?" if new else _hint(value, _STRINGS))
    if isinstance(value, os.PathLike):
        return Precision(_SHORT[precision_of(value)])
    raise _error(value)


def check_hardware(precision: PrecisionLike, hardware: Hardware | None = None) -> None:
    """Warn once when `precision` is slow or unsupported on `hardware`."""
    p = resolve_precision(precision, hardware=hardware)
    if p.compute_dtype not in ("float16", "bfloat16"):
        return
    hw = hardware or Hardware.detect()
    cc = hw.compute_capability
    known_gpu = hw.kind == "gpu" and cc is not None
    message = None
    if p.compute_dtype == "float16" and hw.kind == "cpu":
        message = "CPUs have no fast float16 math; it runs slower than float32. Use 'float32'."
    elif p.compute_dtype == "float16" and hw.kind == "tpu":
        swap = p.name.replace("float16", "bfloat16")
        message = f"TPUs have no fast float16 math; their matrix units use bfloat16. Use '{swap}'."
    elif p.compute_dtype == "float16" and known_gpu and cc < (7, 0):
        message = f"compute capability {cc} has no Tensor Cores; float16 gains little. Use 'float32'."
    elif p.compute_dtype == "bfloat16" and known_gpu and cc < (8, 0):
        swap = p.name.replace("bfloat16", "float16") if cc >= (7, 0) else "float32"
        message = f"compute capability {cc} has no fast bfloat16; it is emulated and slow. Use '{swap}'."
    # bfloat16 on CPU stays silent: CPUs with AVX512_BF16 or AMX run it faster
    # than float32 (docs/precision.md has numbers), and we cannot tell here.
    if message:
        warnings.warn(f"precision '{p}' on {hw.kind.upper()}: {message}", UserWarning, stacklevel=2)


def set_precision(value: PrecisionLike, *, hardware: Hardware | None = None) -> Precision:
    """Resolve, check against the hardware, and set Keras's global dtype policy."""
    p = resolve_precision(value, hardware=hardware)
    check_hardware(p, hardware)
    if p.variable_dtype in ("bfloat16", "float16"):
        warnings.warn(f"precision '{p}' keeps the weights themselves in {p.variable_dtype}. kmp.prepare(model), with "
                      f"kmp.wrap's optimizer, trains them from float32 master weights; any other update (Keras's "
                      f"own) is made in {p.variable_dtype} and loses the small ones (Keras's Adam does not move them "
                      f"at all). 'mixed_{p.variable_dtype}' keeps float32 weights.", UserWarning, stacklevel=2)
    keras.config.set_dtype_policy(p.policy())
    return p


@contextlib.contextmanager
def precision_scope(value: PrecisionLike, *, hardware: Hardware | None = None) -> Iterator[Precision]:
    """`set_precision` for a `with` block; the previous policy is restored on exit."""
    previous = keras.config.dtype_policy()
    p = set_precision(value, hardware=hardware)
    try:
        yield p
    finally:
        keras.config.set_dtype_policy(previous)


def float32_output(x: Any, activation: str = "linear", *, name: str | None = None) -> Any:
    """Apply `activation` in float32 to the model's last tensor `x`.

    Under mixed precision the last layer computes in float16/bfloat16; a
    softmax there saturates and a loss computed from it loses precision.
    Keras's advice is a final float32 layer, which this is:
    `outputs = kmp.float32_output(logits, "softmax")`.
    """
    return keras.layers.Activation(activation, dtype="float32", name=name)(x)
