"""DeepSpeed's `torch_autocast.lower_precision_safe_modules` on a Keras model: which layers compute in float32.

    safe = safe_classes(names)             # torch module names -> the keras.layers classes they map to
    moved = to_float32_layers(model, safe) # the layers computing on their own whose class is not safe
    apply(model, names)                    # kmp.prepare: those layers to float32, said in one line

A layer computing on its own is one with no layers inside (a Dense, a
LayerNormalization, a Softmax); a layer holding layers (a transformer block,
a keras-hub backbone, MultiHeadAttention) keeps its policy, and the code
between its inner layers runs in the dtype of the tensors it is handed.
A subclass counts as its class (keras-hub's ReversibleEmbedding is an
Embedding). Each moved layer gets a float32 dtype policy, as
forward_overflow="float32" gives one (kmp.engine.forward_overflow.to_float32),
but on the live layer only: not in a keras-hub backbone's DTypePolicyMap,
since the cast below is not saved, and a reloaded backbone whose float32
layers hand float32 on would meet bfloat16 in its residual sums. A saved
model reloads in its one policy; kmp.prepare with the config moves the
layers again. Weights do not move: under a mixed policy they are float32
already, and only the compute dtype changes.

A moved layer hands its float outputs on in the dtype it computed in
before (a cast after its call, on its instance), except a Functional model's own
outputs: TensorFlow adds no float32 to a bfloat16 tensor, and a
transformer's residual sums (`x + residual`) and attention's einsums would
meet both. torch.autocast promotes such a sum to float32 instead; in kmp
the stream between layers stays in the lower precision.
"""

from __future__ import annotations

import functools
import logging
import types
from collections import Counter

import keras

from kmp.config import autocast_block

logger = logging.getLogger(__name__)


def safe_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    """The keras.layers classes that the torch module `names` map to (kmp.config.autocast_block)."""
    mapped, _ = autocast_block.keras_classes(names)
    found = {getattr(keras.layers, keras_name) for classes in mapped.values() for keras_name in classes
             if hasattr(keras.layers, keras_name)}
    return tuple(sorted(found, key=lambda c: c.__name__))


def _leaves(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's layers that hold no layers, each once, InputLayers left out (they compute nothing)."""
    out, seen = [], set()
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
            continue
        seen.add(id(layer))
        if not any(True for _ in layer._flatten_layers(include_self=False, recursive=False)):
            out.append(layer)
    return out


def to_float32_layers(model: keras.Model, safe: tuple[type, ...]) -> list[keras.layers.Layer]:
    """The layers of `model` that `safe` moves to float32: computing on their own, not of a safe class,
    computing in a lower precision now."""
    return [layer for layer in _leaves(model) if not isinstance(layer, safe)
            and keras.backend.standardize_dtype(layer.compute_dtype) in ("float16", "bfloat16")]


def apply(model: keras.Model, names: tuple[str, ...] | None) -> list[str]:
    """Moves the layers `names` does not mark safe to float32; the classes moved, in the one line it logs."""
    if names is None:
        return []
    safe = safe_classes(names)
    moved = to_float32_layers(model, safe)
    if not moved:
        return []
    low = keras.backend.standardize_dtype(moved[0].compute_dtype)
    ends = _output_layers(model)
    for layer in moved:
        layer.dtype_policy = keras.dtype_policies.get("float32")
        if all(layer is not end for end in ends):
            _hand_on_in(layer, low)
    model.train_function = None  # traced with the old dtypes
    counts = Counter(type(layer).__name__ for layer in moved)
    kept = Counter(type(layer).__name__ for layer in _leaves(model)
                   if keras.backend.standardize_dtype(layer.compute_dtype) == low)
    logger.warning("kmp: torch_autocast.lower_precision_safe_modules: %d layers of %s compute in float32 (%s); "
                   "in %s: %s. Weights stay float32.", len(moved), model.name, _listed(counts), low,
                   _listed(kept) or "no layer")
    return sorted(counts)


_MARK = "_kmp_hands_on_in"


def _hand_on_in(layer: keras.layers.Layer, dtype: str) -> None:
    """`layer`'s call, on its instance, casts its float32 outputs to `dtype` (once per layer)."""
    if _MARK in layer.__dict__:
        return
    # In the instance's __dict__: Keras's __setattr__ would track it (as kmp.engine.recompute does).
    call = layer.__dict__.get("call") or types.MethodType(type(layer).call, layer)

    @functools.wraps(call)  # Keras reads the call signature through __wrapped__
    def cast_after(*args, **kwargs):
        return keras.tree.map_structure(lambda t: _cast(t, dtype), call(*args, **kwargs))

    layer.__dict__[_MARK] = dtype
    layer.__dict__["call"] = cast_after


def _cast(value, dtype):
    if hasattr(value, "dtype") and keras.backend.standardize_dtype(value.dtype) == "float32":
        return keras.ops.cast(value, dtype)
    return value


def _output_layers(model: keras.Model) -> list:
    """The layers whose outputs are a Functional model's outputs (their float32 is what the loss reads)."""
    found = []
    for name in getattr(model, "output_names", None) or []:  # a Functional model's: its output layers' names
        try:
            found.append(model.get_layer(name))
        except ValueError:  # an output no layer of the model's own makes
            pass
    return found


def _listed(counts: Counter) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
