"""Activation checkpointing: each block's activations recomputed in the backward pass, not kept.

    blocks = blocks_of(model, setting, problems)   # kmp.prepare's activation_checkpointing: layers, or None
    apply(model, blocks)                # each block's call, on its instance, through `recomputed` below;
                                        # the others' own calls back

A checkpointed block's call, under a gradient tape:

    values = the block's variables as the step reads them   # flat-buffer slices, or the variables' reads
    y = call(x) with the variables mapped to `values`       # keras.StatelessScope; nothing inside kept
    backward(dy):
        x' = x + 0 * dy[0]                                   # data-dependent: XLA cannot merge it with the forward
        y' = call(x') with the same `values`, recorded      # the same weights, the same dropout seeds
        dx, dvalues = gradients of y' against x', values, with dy

So a step holds each block's inputs and, during the backward pass, one
block's activations at a time, instead of every block's. The forward pass
runs twice (about a third more compute for a transformer).

The block's variables are explicit inputs. Keras's own remat
(`keras.RematScope`, tf.recompute_grad on TensorFlow) finds the variables
a block reads as tf.Variables, and kmp's step reads the weights as tensors
instead (the flat buffers' slices, in a StatelessScope): there the weights
would get no gradient. Its recomputation would also read the dropout seeds
after the forward pass advanced them, so the recomputed masks would not be
the forward pass's. Here both are inputs, mapped the same way twice.
"""

from __future__ import annotations

import logging
import types

import keras
import tensorflow as tf

from kmp import seams
from kmp.errors import Problem, did_you_mean

logger = logging.getLogger(__name__)

CHOICES = '"auto", True, False, or a list of layer names or classes'


def blocks_of(model, setting, problems: list) -> list | None:
    """The layers prepare's `activation_checkpointing=setting` checkpoints on `model` (None: off; []: asked
    for, none found), its problems appended to `problems`."""
    if setting == "auto":
        setting = bool(getattr(getattr(model, "optimizer", None), "kmp_activation_checkpointing", False))
    if setting is False:
        return None
    if setting is True:
        return find_blocks(model)
    if not isinstance(setting, (list, tuple)) or not setting:
        problems.append(Problem("activation_checkpointing", CHOICES, setting))
        return None
    layers = [layer for layer in _descendants(model) if layer is not model]
    names = [layer.name for layer in layers]
    blocks = []
    for item in setting:
        found = [layer for layer in layers if (isinstance(item, type) and isinstance(layer, item)) or layer.name == item]
        if not found:
            hint = did_you_mean(item, names) if isinstance(item, str) else ""
            problems.append(Problem("activation_checkpointing", f"names or classes of layers of {model.name}", item,
                                    hint or "model.summary(expand_nested=True) lists its layers."))
        blocks += [layer for layer in found if all(layer is not b for b in blocks)]
    return blocks


def apply(model, blocks: list | None) -> None:
    """`blocks` checkpointed and every other layer of `model` back to its own call; said in one line."""
    keep = {id(block) for block in blocks or ()}
    for layer in checkpointed(model):
        if id(layer) not in keep:
            _restore(layer)
            model.train_function = None
    if blocks is None:
        return
    if not blocks:
        logger.warning("kmp: activation checkpointing found no blocks in %s: no class of layers that hold layers "
                       "repeats in it (a transformer's blocks do), so its activations are kept; name the layers "
                       "to recompute with activation_checkpointing=[...].", model.name)
        return
    kinds = sorted({type(block).__name__ for block in blocks})
    if any(_MARK not in block.__dict__ for block in blocks):
        logger.info("kmp: activation checkpointing: %d %s layer%s of %s (%s) recompute%s activations in the "
                    "backward pass.", len(blocks), "/".join(kinds), "s" * (len(blocks) > 1), model.name,
                    ", ".join(b.name for b in blocks), "s its" if len(blocks) == 1 else " their")
    checkpoint(model, blocks)

# Set on a checkpointed block's instance: the instance's own call before (_NONE: the class's).
_MARK = "_kmp_recomputed"
_NONE = object()


def find_blocks(model) -> list:
    """The layers to checkpoint: every instance of the most repeated class of layers that hold layers, the
    outermost such (a transformer's blocks, not their attention layers). [] when no class repeats."""
    counts: dict[type, list] = {}
    for layer in _descendants(model):
        if layer is not model and not isinstance(layer, keras.Model) and _holds_layers(layer):
            counts.setdefault(type(layer), []).append(layer)
    repeated = {kind: layers for kind, layers in counts.items() if len(layers) >= 2}
    inside = set()  # layers inside a repeated layer: its parts, not blocks
    for layers in repeated.values():
        for layer in layers:
            inside.update(id(part) for part in _descendants(layer) if part is not layer)
    outer = {kind: layers for kind, layers in repeated.items() if not any(id(l) in inside for l in layers)}
    if not outer:
        return []
    return max(outer.values(), key=lambda layers: (len(layers), sum(_size(l) for l in layers)))


def _descendants(layer) -> list:
    return [layer, *layer._flatten_layers(include_self=False, recursive=True)]


def _holds_layers(layer) -> bool:
    return any(True for _ in layer._flatten_layers(include_self=False, recursive=False))


def _size(layer) -> int:
    return sum(int(tf.size(v)) for v in layer.trainable_variables) if layer.built else 0


def checkpoint(model, blocks) -> None:
    """Each of `blocks` (layers of `model`) recomputed in the backward pass; the model's step is traced again."""
    for block in blocks:
        if _MARK not in block.__dict__:
            # In the instance's __dict__: Keras's __setattr__ would track it.
            before = block.__dict__.get("call", _NONE)  # a call of the instance's own is wrapped, and kept
            block.__dict__[_MARK] = before
            call = type(block).call if before is _NONE else before.__func__
            block.__dict__["call"] = types.MethodType(_recomputing(call), block)
            model.train_function = None


def _restore(layer) -> None:
    before = layer.__dict__.pop(_MARK)
    if before is _NONE:
        del layer.__dict__["call"]
    else:
        layer.__dict__["call"] = before


def checkpointed(model) -> list:
    """The layers of `model` whose activations are recomputed."""
    return [layer for layer in _descendants(model) if _MARK in layer.__dict__]


def _recomputing(call):
    def recomputed_call(self, *args, **kwargs):
        return recomputed(self, call.__get__(self), args, kwargs)
    recomputed_call.__wrapped__ = call  # Keras reads the call's signature through it
    return recomputed_call


def recomputed(layer, call, args, kwargs):
    """call(*args, **kwargs), its activations recomputed in the backward pass (see the module docstring)."""
    flat = tf.nest.flatten((args, kwargs))
    # The floating tensors are the differentiable inputs; masks, flags and None are closed over.
    where = [k for k, item in enumerate(flat) if tf.is_tensor(item) and item.dtype.is_floating]
    if not where or not tf.inside_function():
        return call(*args, **kwargs)
    autocast = seams.get("get_autocast_scope")()
    dtype = None if autocast is None else autocast.dtype
    variables = list({id(v): v for v in layer.variables}.values())
    # Read once, as stored (float32 masters; each read inside casts, both times). A tensor, not the
    # variable: the recomputation must see the seeds the forward pass saw, not the ones it advanced them to.
    with seams.get("AutocastScope")(None):
        values = [tf.convert_to_tensor(v.value) for v in variables]
    floating = [k for k, v in enumerate(values) if v.dtype.is_floating]
    inputs = [flat[k] for k in where]
    count = len(inputs)

    def run(inputs, weights):
        items = list(flat)
        for k, tensor in zip(where, inputs):
            items[k] = tensor
        state = list(values)  # the seeds and counters: the forward pass's values, both times
        for k, weight in zip(floating, weights):
            state[k] = weight
        with seams.get("AutocastScope")(dtype), keras.StatelessScope(state_mapping=list(zip(variables, state))) as scope:
            args_, kwargs_ = tf.nest.pack_sequence_as((args, kwargs), items)
            outputs = call(*args_, **kwargs_)
        return outputs, [scope.get_current_value(v) for v in variables]

    kept = {}

    @tf.custom_gradient
    def forward(*tensors):
        outputs, writes = run(tensors[:count], tensors[count:])
        flat_out = tf.nest.flatten(outputs)
        out_where = [k for k, item in enumerate(flat_out) if tf.is_tensor(item) and item.dtype.is_floating]
        kept.update(outputs=outputs, flat_out=flat_out, out_where=out_where,
                    writes=[(v, w) for v, w, old in zip(variables, writes, values) if w is not None and w is not old])

        def backward(*dys):
            dys = [tf.zeros_like(flat_out[k]) if dy is None else dy for k, dy in zip(out_where, dys)]
            # A data dependency on the incoming gradient: XLA then cannot merge the recomputation with the
            # forward pass (its CSE), which would keep every activation as before.
            zero = tf.reduce_sum(tf.cast(tf.reshape(dys[0], [-1])[:1], tf.float32)) * 0.0
            again = [x + tf.cast(zero, x.dtype) for x in tensors[:count]]
            weights = list(tensors[count:])
            with tf.GradientTape() as tape:
                tape.watch(again + weights)
                outputs_again, _ = run(again, weights)
            flat_again = tf.nest.flatten(outputs_again)
            return tape.gradient([flat_again[k] for k in out_where], again + weights, output_gradients=dys,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)

        return [flat_out[k] for k in out_where], backward

    differentiable = forward(*inputs, *[values[k] for k in floating])
    items = list(kept["flat_out"])
    for k, tensor in zip(kept["out_where"], differentiable):
        items[k] = tensor
    for variable, value in kept["writes"]:  # the block's writes (dropout seeds, statistics), as its call makes them
        variable.assign(value)
    return tf.nest.pack_sequence_as(kept["outputs"], items)
