"""A forward overflow: a layer's float16 output not finite, which no loss scale fixes.

The loss scale multiplies the loss after the forward pass, so a layer whose
float16 output is inf or nan stays so at any scale; backing off only walks
the scale to its floor, skipping a step each time. kmp.engine.overflow_layer
re-runs an overflowing step's batch layer by layer; when that names a layer
(its output not finite while its inputs were, or its inputs not finite while
every earlier output was) the step is a forward overflow, and the optimizer's
`forward_overflow` says what happens:

    in the step (kmp.engine.overflow_layer, cross-replica):
        scale, hysteresis_left <- what the step started from   # the step is still skipped
        state.forward += 1
        "raise", outside XLA: an assert, raised as kmp.LossScaleError (`watching`)
    after each train function call (`after_call`, on the host, where the step cannot act itself):
        "raise" (XLA: no assert compiles): kmp.LossScaleError
        "float32": the layer computes in float32 from now on (`to_float32`): the train
                   function is made again and training goes on from the next batch;
                   at most MAX_FLOAT32_LAYERS layers, a layer once only
    "backoff": a step like any overflow (Keras's and DeepSpeed's behaviour)

On a model kmp.prepare did not take, kmp's optimizer installs the layer
finder itself (`make_with_finder`) unless forward_overflow="backoff".
"""

from __future__ import annotations

import logging

import keras
import tensorflow as tf

from kmp import seams
from kmp.engine import engine, overflow_layer, replica_step
from kmp.engine import state as kmp_state
from kmp.errors import LossScaleError
from kmp.scaling import overflow

logger = logging.getLogger(__name__)

# How many layers "float32" moves before it raises: a forward pass that overflows in more places
# than that is not one hot layer (a diverged model, or a float16 model that should be bfloat16).
MAX_FLOAT32_LAYERS = 8
mode = overflow_layer.forward_mode


# --- The train function ---------------------------------------------------------


def watching(model: keras.Model, make):
    """The train function `make()` returns, acting on forward overflows: the assert's error raised as
    kmp.LossScaleError, the state read after each call where the step cannot act itself, and the
    function made again by `make()` when a layer moved to float32. Every wrapper above it (the floor's,
    the monitor's) stays in place."""
    current = [make()]

    def call(iterator):
        try:
            result = current[0](iterator)
        except tf.errors.InvalidArgumentError as e:
            if overflow.FORWARD_MARKER not in str(e):
                raise
            raise error(model) from None
        if after_call(model):
            current[0] = make()
        return result

    call.__wrapped__ = current[0]
    return call


def make_with_finder(model: keras.Model, force: bool) -> bool:
    """Makes the train function of a model kmp.prepare did not take with the layer finder in its step,
    where a forward overflow is to be recognised. Whether it did (else Keras's make_train_function must)."""
    prepared = kmp_state.of(model)
    stock = getattr(model.train_step, "__func__", None) is seams.get("TensorFlowTrainer").train_step
    if (prepared is not None and prepared.prepared) or not stock or mode(model.optimizer) == "backoff" or (
            not overflow_layer.can_diagnose(model)):
        return False
    if model.train_function is None or force:
        model.train_function = watching(
            model, lambda: model._make_function(overflow_layer.diagnosing_step(model, model.train_step)))
    return True


def after_call(model: keras.Model) -> bool:
    """After a train function call: raises kmp.LossScaleError, or moves the named layer to float32, for a
    forward overflow the step found and could not act on itself. Whether the train function must be made
    again. Reads one counter from the device, only where the step cannot act itself (XLA, "float32")."""
    state = overflow_layer.state_of(model)
    if state is None or not state.host_checks:
        return False
    count = int(state.forward.numpy())
    if count <= state.forward_seen:
        return False
    state.forward_seen = count
    if mode(model.optimizer) != "float32":
        raise error(model)
    layer, name = _named(state)
    reason = _why_not_float32(state, layer)
    if reason is not None:
        raise error(model, reason)
    to_float32(model, layer)
    state.moved.append(name)
    logger.warning("kmp: forward overflow in layer '%s' (%s): it computes in float32 from now on (its weights are "
                   "float32 already); the step was skipped, the loss scale kept at %g, and training goes on from "
                   "the next batch (layers in float32: %d of at most %d).", name, type(layer).__name__,
                   float(model.optimizer.dynamic_scale.numpy()), len(state.moved), MAX_FLOAT32_LAYERS)
    # The new train function traces the forward pass again: no cached per-replica function may keep the old one.
    replica_step.forget(model)
    flat_engine = engine.engine_of(model)
    if flat_engine is not None:
        flat_engine.forget_steps()
    return True


def _named(state) -> tuple[keras.layers.Layer, str]:
    number = int(state.layer.numpy())
    return state.table[number]


def _why_not_float32(state, layer) -> str | None:
    if keras.backend.standardize_dtype(layer.compute_dtype) == "float32":
        return "it computes in float32 already"
    if getattr(layer, "quantization_mode", None) is not None:
        return f"it is quantized ({layer.quantization_mode}), and kmp does not undo a quantization"
    if len(state.moved) >= MAX_FLOAT32_LAYERS:
        return (f"kmp moved {MAX_FLOAT32_LAYERS} layers to float32 already ({', '.join(state.moved)}), its bound: "
                "a forward pass that overflows in more places is not one hot layer")
    return None


# --- The fix ---------------------------------------------------------------------


def to_float32(model: keras.Model, layer: keras.layers.Layer) -> None:
    """`layer` computes in float32 from now on, and a saved `.keras` model keeps it.

    A layer of the model itself keeps its policy in its own config. A layer inside a keras-hub backbone
    is made again from the backbone's `dtype` on load, so the backbone's policy becomes a
    keras.dtype_policies.DTypePolicyMap with an entry for the layer's path (the policy it had stays
    the default)."""
    float32 = keras.dtype_policies.get("float32")
    backbone = _backbone_of(model, layer)
    if backbone is not None:
        policies = backbone.dtype_policy
        if not isinstance(policies, keras.dtype_policies.DTypePolicyMap):
            policies = keras.dtype_policies.DTypePolicyMap(default_policy=policies)
            backbone.dtype_policy = policies  # its own compute dtype stays the default
        # (`dtype_policy` is the map itself where a layer holds one; the setter below writes into it.)
        if not isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap):
            if layer.path:
                policies[layer.path] = float32
            else:  # made outside any layer's scope (a keras-hub block's Dropout): no key a load finds
                logger.warning("kmp: %s has no path in %s: it computes in float32 now, but a saved model "
                               "reloads it in %s.", layer.name, backbone.name, policies.default_policy.name)
    layer.dtype_policy = float32  # writes into the map where the layer holds one (Keras's setter)


def _backbone_of(model, layer):
    """The keras-hub Backbone `layer` is inside (not itself a layer of `model.layers`), or None."""
    if layer in model.layers:
        return None
    try:
        from keras_hub.models import Backbone
    except ImportError:
        return None
    for outer in model._flatten_layers():
        if isinstance(outer, Backbone) and outer is not layer and any(
                inner is layer for inner in outer._flatten_layers(include_self=False)):
            return outer
    return None


def fix_text(model: keras.Model, layer: keras.layers.Layer, name: str) -> str:
    """The lines a user writes to compute `layer` in float32 (`name`: its name in layer_table)."""
    policy = model.dtype_policy.name
    if any(layer is top for top in model.layers):
        return (f'    model.get_layer("{layer.name}").dtype_policy = "float32"\n'
                "before compile() (after it, compile() again)")
    backbone = _backbone_of(model, layer)
    # A DTypePolicyMap made with policy_map={...} keeps a string value as it is; its `[]=` converts.
    policies = (f'    policies = keras.dtype_policies.DTypePolicyMap(default_policy="{policy}")\n'
                f'    policies["{layer.path}"] = "float32"\n')
    if backbone is not None:
        return f"{policies}and build the {type(backbone).__name__} with dtype=policies"
    return (f"{policies}and pass dtype=policies to the layer that makes it ('{name.rpartition('/')[0]}'), if it "
            "hands its dtype to the layers it makes; or make the layer with dtype=\"float32\" there")


def error(model: keras.Model, reason: str | None = None) -> LossScaleError:
    """The error for the forward overflow the model's state names. `reason`: why "float32" cannot fix it."""
    state = overflow_layer.state_of(model)
    layer, name = _named(state)
    what = int(state.what.numpy())
    how = ("its output was not finite while its inputs were" if what != overflow_layer.INPUTS else
           "its inputs were not finite while every earlier layer's output was (a cast to float16 at its input, "
           "or code between layers)")
    scale = float(model.optimizer.dynamic_scale.numpy())
    dtype = keras.backend.standardize_dtype(layer.compute_dtype)
    if reason is None and dtype == "float32":
        reason = "it computes in float32 already"
    text = (f"kmp: the forward pass overflowed in layer '{name}' ({type(layer).__name__}, computing in {dtype}): "
            f"{how}. No loss scale fixes that (the scale multiplies the loss after the forward pass), so kmp "
            f"stopped at the first such step instead of halving the scale to its floor; the step was skipped and "
            f"the scale stays {scale:g}.")
    if reason is None:
        text += (f"\nFix: compute that layer in float32 (its weights are float32 already):\n"
                 f"{fix_text(model, layer, name)}\n"
                 'or let kmp do it while training: kmp.wrap(optimizer, forward_overflow="float32"). '
                 'forward_overflow="backoff" treats it as any overflow (as Keras and DeepSpeed do).')
    else:
        text += (f'\nforward_overflow="float32" cannot fix it: {reason}. Look at the batch and the weights '
                 "(kmp.find_overflow(model, x, y) reports the largest values), or train in bfloat16.")
    found = LossScaleError(text)
    found.layer = name
    return found
