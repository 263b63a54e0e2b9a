"""A forward overflow, which no loss scale fixes: raised at once, or fixed in float32 (kmp/engine/forward_overflow.py).

The small float16 model is tests/test_overflow_layer.py's: its middle Dense `d2` outputs
8 * 100 * 100 = 80000 (inf in float16, finite in float32) on a row of 100s, whatever the scale. Its
float32 output layer weighs that by 1e-5, so that, with d2 in float32, the loss and the gradients
flowing back into float16 stay in range, and the steps train.
The keras-hub model is a tiny GPT-2 (tests/real_models.py's config) whose feed-forward Dense has a
bias of -70000 on one unit: -inf once cast to float16, so its gelu output is nan at any scale, while in
float32 that unit outputs 0 and the model trains.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import forward_overflow, overflow_layer

HOT = 100.0
STEPS = 4


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)


def _model(d2_dtype=None):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1", kernel_initializer=keras.initializers.Constant(0.25))(inputs)
    h = keras.layers.Dense(8, name="d2", kernel_initializer=keras.initializers.Constant(100.0), dtype=d2_dtype)(h)
    outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=keras.initializers.Constant(1e-5))(h)
    return keras.Model(inputs, outputs, name="net")


def _compiled(model, jit_compile=False, **optimizer_args):
    model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-7), **optimizer_args), loss="mse",
                  jit_compile=jit_compile)
    return model


def _data(steps=STEPS):
    x = np.random.default_rng(0).uniform(HOT - 1, HOT, (4 * steps, 4)).astype("float32")
    return x, np.full((4 * steps, 1), 6.0, "float32")


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, **kwargs)


def _made(how, strategy=None, **optimizer_args):
    with (strategy or tf.distribute.get_strategy()).scope():
        model = _compiled(_model(), jit_compile=how.endswith("xla"), **optimizer_args)
    if how.startswith("prepare"):
        kmp.prepare(model)
    return model


def _compute_dtypes(model):
    return {layer.name: layer.compute_dtype for layer in model.layers[1:]}


# --- "raise" (the default) -----------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "prepare", "plain+xla", "prepare+xla", "mirrored"])
def test_a_forward_overflow_raises_at_its_first_step_naming_the_layer(two_replicas, how):
    model = _made(how, two_replicas if how == "mirrored" else None)
    if how == "mirrored":
        kmp.prepare(model)
    initial = model.get_weights()
    with pytest.raises(kmp.LossScaleError) as info:
        _fit(model, *_data())
    message = str(info.value)
    assert message.startswith("kmp: the forward pass overflowed in layer 'd2' (Dense, computing in float16)"), message
    assert '    model.get_layer("d2").dtype_policy = "float32"\n' in message, message
    assert 'forward_overflow="float32"' in message and info.value.layer == "d2"
    # At the first step: skipped, and the scale not halved (it was never the cause).
    assert int(model.optimizer.skipped_steps.numpy()) == 1
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15
    for before, after in zip(initial, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_backoff_walks_the_scale_down_as_keras_and_deepspeed_do():
    model = _made("plain", forward_overflow="backoff")
    _fit(model, *_data())
    assert int(model.optimizer.skipped_steps.numpy()) == STEPS
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15 / 2**STEPS


def test_an_overflow_in_the_backward_pass_still_backs_off():
    model = _made("prepare")
    x, y = np.ones((8, 4), "float32"), np.full((8, 1), 60000.0, "float32")  # d2 outputs 800: forward finite
    _fit(model, x, y)
    assert int(model.optimizer.skipped_steps.numpy()) == 2
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**13


def test_the_error_gives_a_dtype_policy_map_for_a_layer_deep_in_a_keras_hub_backbone():
    model = _gpt2()
    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), loss=_lm_loss(), jit_compile=False)
    x, y = _lm_data(8)
    with pytest.raises(kmp.LossScaleError) as info:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    message = str(info.value)
    assert "in layer 'gpt2_backbone/transformer_layer_0/feedforward_intermediate_dense' (Dense" in message, message
    fix = ('    policies = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")\n'
           f'    policies["{PATH}"] = "float32"\n'
           "and build the GPT2Backbone with dtype=policies\n")
    assert fix in message, message
    # The fix as written: the layer computes in float32, and the model trains.
    policies = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
    policies[PATH] = "float32"
    fixed = _gpt2(dtype=policies)
    fixed.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), loss=_lm_loss(), jit_compile=False)
    fixed.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(fixed.optimizer.iterations.numpy()) == 1


# --- "float32" ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "prepare", "prepare+xla", "mirrored"])
def test_float32_moves_the_layer_and_trains_as_a_model_built_so(two_replicas, how, caplog):
    """kmp skips the overflowing first batch and trains on with d2 in float32: the same weights as a
    model built with d2 in float32 from the start and trained on the batches after the first."""
    strategy = two_replicas if how == "mirrored" else tf.distribute.get_strategy()
    # From 256: d1's float16 gradients overflow at the default 32768 (the backward pass: the scale backs off).
    model = _made("prepare" if how == "mirrored" else how, strategy, forward_overflow="float32", initial_scale=256.0)
    with strategy.scope():
        reference = _compiled(_model(d2_dtype="float32"), jit_compile=how.endswith("xla"), initial_scale=256.0)
    if how != "plain":
        kmp.prepare(reference)
    reference.set_weights(model.get_weights())
    x, y = _data(8)
    with caplog.at_level(logging.WARNING, logger="kmp.engine.forward_overflow"):
        _fit(model, x, y)
    _fit(reference, x[4:], y[4:])
    assert _compute_dtypes(model) == {"d1": "float16", "d2": "float32", "out": "float32"}
    lines = [r.getMessage() for r in caplog.records if r.name == "kmp.engine.forward_overflow"]
    assert len(lines) == 1 and lines[0].startswith(
        "kmp: forward overflow in layer 'd2' (Dense): it computes in float32 from now on"), lines
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) >= 4  # steps trained
    assert int(optimizer.skipped_steps.numpy()) == 1 + int(reference.optimizer.skipped_steps.numpy())
    assert float(optimizer.dynamic_scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy())
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_float32_is_kept_in_a_saved_model(tmp_path):
    model = _made("plain", forward_overflow="float32")
    _fit(model, *_data())
    model.save(tmp_path / "model.keras")
    assert _compute_dtypes(keras.saving.load_model(tmp_path / "model.keras"))["d2"] == "float32"


def test_float32_raises_past_its_bound(monkeypatch):
    monkeypatch.setattr(forward_overflow, "MAX_FLOAT32_LAYERS", 0)
    model = _made("prepare", forward_overflow="float32")
    with pytest.raises(kmp.LossScaleError, match='forward_overflow="float32" cannot fix it: kmp moved 0 layers'):
        _fit(model, *_data())
    assert _compute_dtypes(model)["d2"] == "float16"


def test_forward_overflow_is_checked_and_kept_in_the_config():
    with pytest.raises(kmp.ConfigError, match="forward_overflow"):
        kmp.wrap(keras.optimizers.SGD(), forward_overflow="fp32")
    optimizer = kmp.wrap(keras.optimizers.SGD(), forward_overflow="float32")
    assert type(optimizer).from_config(optimizer.get_config()).forward_overflow == "float32"
    assert overflow_layer.forward_mode(kmp.wrap(keras.optimizers.SGD(), precision="bf16-mixed")) == "backoff"


# --- A keras-hub GPT-2 whose feed-forward output overflows in float16 ------------------

SEQ = 16
PATH = "transformer_layer_0/feedforward_intermediate_dense"  # the feed-forward block's first Dense (gelu)


def _gpt2(ffn_float32=False, hot=True, dtype=None):
    import keras_hub

    keras.utils.set_random_seed(0)
    if ffn_float32:
        dtype = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
        dtype[PATH] = "float32"
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0, dtype=dtype)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if hot:
        # The first unit's bias is beyond float16's 65504: its pre-activation is -inf in float16 and
        # gelu(-inf) = nan, whatever the loss scale; in float32 gelu(-70000) = 0 (a dead unit).
        dense = next(layer for layer in model._flatten_layers() if layer.path == PATH)
        dense.bias[0].assign(-7e4)
    return model


def _lm_data(rows, seed=0):
    """Counting sequences (each token the one before plus 1, mod 64): learnable, so the loss falls."""
    start = np.random.default_rng(seed).integers(0, 64, (rows, 1))
    tokens = ((start + np.arange(SEQ + 1)) % 64).astype("int32")
    return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, SEQ), "int32")}, tokens[:, 1:]


def _lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _rows(x, start):
    return {k: v[start:] for k, v in x.items()} if isinstance(x, dict) else x[start:]


def test_a_keras_hub_gpt2_trains_on_with_its_feed_forward_layer_in_float32(tmp_path):
    """kmp trains on as the model built with that layer in float32 does (trained on the batches after the
    one kmp skipped); stock Keras's loss stays NaN; DeepSpeed's rule dies at the floor."""
    x, y = _lm_data(8 * 30)
    test_x, test_y = _lm_data(32, seed=1)
    losses = {}
    for name in ("kmp", "float32 layer", "stock keras"):
        model = _gpt2(ffn_float32=name == "float32 layer")
        optimizer = keras.optimizers.AdamW(1e-2)
        if name != "stock keras":
            optimizer = kmp.wrap(optimizer, forward_overflow="float32")
        model.compile(optimizer=optimizer, loss=_lm_loss(), jit_compile=False)
        if name != "stock keras":
            kmp.prepare(model, jit_compile=False)
        skip = 8 if name == "float32 layer" else 0
        history = model.fit(_rows(x, skip), y[skip:], batch_size=8, shuffle=False, verbose=0)
        losses[name] = (history.history["loss"][-1],
                        model.evaluate(test_x, test_y, verbose=0, return_dict=True)["loss"])
        if name == "kmp":
            trained = model
    deepspeed = _gpt2()
    deepspeed.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-2), {"fp16": {"enabled": True}},
                                         forward_overflow="backoff"), loss=_lm_loss(), jit_compile=False)
    with pytest.raises(kmp.LossScaleError, match="already at its minimum"):
        deepspeed.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(deepspeed.optimizer.skipped_steps.numpy()) == 18  # 2^16 to 1: 16 halvings, 1 absorbed, 1 stuck
    kmp_loss, reference = losses["kmp"][1], losses["float32 layer"][1]
    assert reference < 0.9 * np.log(64), losses  # it learned something
    assert abs(kmp_loss - reference) <= 0.1 * reference, losses
    assert np.isnan(losses["stock keras"][0]), losses  # Keras's scale halves and halves, the loss stays NaN
    # Only that layer moved, and a saved model keeps it (the backbone's dtype is a DTypePolicyMap).
    moved = [layer.path for layer in trained._flatten_layers() if layer.compute_dtype == "float32"
             and isinstance(layer, keras.layers.Dense)]
    assert moved == [PATH], moved
    trained.save(tmp_path / "gpt2.keras")
    loaded = keras.saving.load_model(tmp_path / "gpt2.keras", compile=False)
    again = [layer.path for layer in loaded._flatten_layers() if layer.compute_dtype == "float32"
             and isinstance(layer, keras.layers.Dense)]
    assert again == moved


def test_a_layer_with_no_path_in_a_backbone_moves_to_float32_live(caplog):
    """Layers made outside any layer's scope (a keras-hub block's Dropout) have no path: no map entry a
    load could find, so the live layer moves and kmp says that a saved model will not keep it."""
    import real_models

    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = real_models.gpt2()
    finally:
        keras.config.set_dtype_policy(policy)
    layer = next(l for l in model._flatten_layers(include_self=False)
                 if not l.path and not isinstance(l, keras.layers.InputLayer))
    with caplog.at_level(logging.WARNING):
        forward_overflow.to_float32(model, layer)
    assert layer.dtype_policy.name == "float32"
    assert "has no path" in caplog.text and layer.name in caplog.text
