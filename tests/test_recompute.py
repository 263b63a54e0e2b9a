"""kmp.engine.recompute: kmp.prepare(model, activation_checkpointing=...).

A checkpointed block's activations are recomputed in the backward pass: the
training is the same (bit for bit at float32, dropout on: the recomputation
sees the forward pass's seeds), on one device and on two replicas, on the
flat buffers and per variable. The memory it saves is measured, not tested
(benchmarks/memory.py --checkpointing).
"""

import functools
import logging

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import recompute
from kmp.errors import ConfigError

ROWS, SEQ, VOCAB = 8, 8, 64
TOKENS = np.random.default_rng(0).integers(1, VOCAB, (ROWS, SEQ + 1)).astype("int32")
X = {"token_ids": TOKENS[:, :-1], "padding_mask": np.ones((ROWS, SEQ), "int32")}
Y = TOKENS[:, 1:]


def _gpt2(dropout=0.1, layers=2):
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=SEQ, dropout=dropout)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _train(strategy, checkpointing, flat):
    keras.backend.clear_session()
    keras.config.set_dtype_policy("float32")
    with strategy.scope():
        model = _gpt2()
        inner = keras.optimizers.AdamW(1e-2)
        model.compile(optimizer=kmp.LossScaleOptimizer(inner),  # kmp's optimizer: the flat buffers apply
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    kmp.prepare(model, flat_buffers=flat, activation_checkpointing=checkpointing)
    history = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    return model, history.history["loss"]


# Each path once: one device per variable, one device on the flat buffers, two replicas on the flat buffers
# (two replicas per variable take kmp's per-replica step, which the flat buffers' shares).
@pytest.mark.parametrize("replicas,flat", [(1, False), (1, True), (2, True)])
def test_a_checkpointed_gpt2_trains_as_the_plain_one_with_dropout(replicas, flat, two_replicas):
    strategy = two_replicas if replicas == 2 else tf.distribute.get_strategy()
    plain, plain_losses = _train(strategy, False, flat)
    start = _gpt2().get_weights()
    ours, losses = _train(strategy, True, flat)
    assert sorted(b.name for b in recompute.checkpointed(ours)) == ["transformer_layer_0", "transformer_layer_1"]
    assert (kmp.engine.engine.engine_of(ours) is not None) == flat
    assert losses == plain_losses
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(), start))
    assert moved > 1e-2  # the reference trained
    for mine, theirs in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


def test_the_blocks_run_twice_in_a_training_step_and_once_in_inference(monkeypatch):
    keras.backend.clear_session()
    calls = []
    own = keras_hub.layers.TransformerDecoder.call

    @functools.wraps(own)  # Keras reads the call's signature
    def counted(self, *args, **kwargs):
        calls.append(self.name)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(keras_hub.layers.TransformerDecoder, "call", counted)
    model = _gpt2(dropout=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True))
    x = {k: tf.constant(v[:2]) for k, v in X.items()}
    model(x)

    def traced(fn):
        calls.clear()
        tf.function(fn).get_concrete_function()
        return len(calls)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    assert (traced(step), traced(lambda: model(x))) == (2, 2)  # two blocks
    kmp.prepare(model, activation_checkpointing=True)
    assert (traced(step), traced(lambda: model(x))) == (4, 2)  # the backward pass calls each again


def test_blocks_are_the_outermost_repeated_layers_that_hold_layers():
    keras.backend.clear_session()
    gpt2 = _gpt2(layers=3)
    gpt2(X)
    assert sorted(b.name for b in recompute.find_blocks(gpt2)) == [f"transformer_layer_{k}" for k in range(3)]
    bert = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                         intermediate_dim=32, max_sequence_length=SEQ)
    assert {type(b).__name__ for b in recompute.find_blocks(bert)} == {"TransformerEncoder"}
    assert len(recompute.find_blocks(bert)) == 2
    convnet = keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None, classes=3)
    assert recompute.find_blocks(convnet) == []  # a flat graph of layers: no block to recompute


def test_no_blocks_is_said_once_and_changes_nothing(caplog):
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with caplog.at_level(logging.WARNING, logger="kmp.engine.recompute"):
        kmp.prepare(model, activation_checkpointing=True)
    assert caplog.text.count("activation checkpointing found no blocks in") == 1
    assert recompute.checkpointed(model) == []


def test_named_blocks_and_bad_names():
    keras.backend.clear_session()
    model = _gpt2()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    kmp.prepare(model, activation_checkpointing=["transformer_layer_1"])
    assert [b.name for b in recompute.checkpointed(model)] == ["transformer_layer_1"]
    with pytest.raises(ConfigError, match="Did you mean 'transformer_layer_0'"):
        kmp.prepare(model, activation_checkpointing=["transformer_layr_0"])
    with pytest.raises(ConfigError, match="activation_checkpointing: expected"):
        kmp.prepare(model, activation_checkpointing="yes")
    assert [b.name for b in recompute.checkpointed(model)] == ["transformer_layer_1"]  # nothing changed
    kmp.prepare(model, activation_checkpointing=[keras_hub.layers.TransformerDecoder])
    assert len(recompute.checkpointed(model)) == 2
    kmp.prepare(model, activation_checkpointing=False)
    assert recompute.checkpointed(model) == []
    assert not any("call" in layer.__dict__ for layer in model._flatten_layers())


def test_a_deepspeed_config_with_the_block_turns_it_on_at_prepare():
    keras.backend.clear_session()
    model = _gpt2()
    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3), {"activation_checkpointing": {}}),
                  loss=keras.losses.SparseCategoricalCrossentropy(True))
    kmp.prepare(model)
    assert len(recompute.checkpointed(model)) == 2
    kmp.prepare(model, activation_checkpointing=False)
    assert recompute.checkpointed(model) == []
    plain = _gpt2()
    plain.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), loss="mse")
    kmp.prepare(plain)
    assert recompute.checkpointed(plain) == []
