"""TPU settings: bfloat16, steps per execution, and the sizes a TPU pads.

No TPU has run this code; its seams are unit-tested with fakes
(docs/distributed.md says what has and has not run).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import keras

from kmp.precision import Hardware, Precision, check_hardware, resolve_precision

# TPU matrix units multiply 128 x 128 tiles (v2-v5); other sizes are padded.
TPU_TILE = 128
# Steps per tf.function call on TPU. Each call is a host -> TPU round trip of
# a few milliseconds; a small model's step is shorter than that, so 32 steps a
# call spend most of the time computing, while callbacks and the progress bar
# still report often. Keras's and TensorFlow's TPU guides use 32-100.
TPU_STEPS_PER_EXECUTION = 32


@dataclass(frozen=True)
class TpuSettings:
    """What a TPU run should use. `advice` lists what the given model does differently."""

    precision: Precision
    steps_per_execution: int
    advice: tuple[str, ...] = ()


def is_tpu_strategy(strategy) -> bool:
    """Keras's own test: a class named TPUStrategy* anywhere among its bases."""
    return any(k.__name__.startswith("TPUStrategy") for k in type(strategy).__mro__)


def tpu_settings(strategy, model: keras.Model | None = None) -> TpuSettings | None:
    """TPU settings for `strategy`, or None when it is not a TPUStrategy.

    Nothing global is changed; apply them yourself, before building the model:

        settings = kmp.distribute.tpu_settings(strategy)
        if settings:
            kmp.set_precision(settings.precision)      # mixed_bfloat16
        ... model.compile(..., steps_per_execution=settings.steps_per_execution)
        kmp.distribute.tpu_settings(strategy, model)   # warns about padded sizes

    With `model`, one UserWarning lists the layer sizes that are not
    multiples of 128 (Dense units and input features, Conv filters and
    input channels, Embedding output_dim), a steps_per_execution below the
    recommendation, and a float16 policy (TPUs compute in bfloat16).
    """
    if not is_tpu_strategy(strategy):
        return None
    precision = resolve_precision("auto", hardware=Hardware("tpu"))
    advice: list[str] = []
    if model is not None:
        advice += padded_sizes(model)
        steps = getattr(model, "steps_per_execution", None)
        if steps is not None and steps < TPU_STEPS_PER_EXECUTION:
            advice.append(
                f"steps_per_execution={steps}: each step is a host -> TPU round trip. "
                f"Compile with steps_per_execution={TPU_STEPS_PER_EXECUTION}."
            )
        policy = keras.config.dtype_policy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_hardware(policy, Hardware("tpu"))
        advice += [str(w.message) for w in caught]
    if advice:
        lines = "\n".join(f"  - {a}" for a in advice)
        warnings.warn(f"On TPU, this model runs slower than it could:\n{lines}", UserWarning, stacklevel=2)
    return TpuSettings(precision, TPU_STEPS_PER_EXECUTION, tuple(advice))


def padded_sizes(model: keras.Model, tile: int = TPU_TILE) -> list[str]:
    """One line per Dense/Conv/Embedding size that is not a multiple of `tile`."""
    out = []
    for layer in _walk(model):
        for what, size in _sizes(layer):
            if size is not None and size % tile:
                out.append(f"{layer.name} ({type(layer).__name__}): {what}={size} is not a multiple of {tile}")
    return out


def _walk(layer):
    for child in getattr(layer, "layers", []):
        yield child
        yield from _walk(child)


def _sizes(layer) -> list[tuple[str, int | None]]:
    kernel = getattr(layer, "kernel", None) if layer.built else None
    if isinstance(layer, keras.layers.Dense):
        return [("units", layer.units), ("input features", None if kernel is None else int(kernel.shape[0]))]
    if isinstance(layer, _CONV):
        return [("filters", layer.filters), ("input channels", None if kernel is None else int(kernel.shape[-2]))]
    if isinstance(layer, keras.layers.Embedding):
        return [("output_dim", layer.output_dim)]
    return []


_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
