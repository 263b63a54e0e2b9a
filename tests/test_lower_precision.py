"""kmp.engine.lower_precision: a config's torch_autocast block applied by kmp.prepare.

The layers whose class `lower_precision_safe_modules` does not map to compute in float32 (their inputs
reach their call as float32), hand their output on in the lower precision, keep float32 weights, and
the model trains: on a small model in float16 and on a keras-hub GPT-2 in bfloat16.
"""

import logging

import keras
import numpy as np
import pytest

import kmp
from kmp.engine import lower_precision

LOGGER = "kmp.engine.lower_precision"


class Probe(keras.layers.Layer):
    """A layer of no safe class: notes the dtype its call receives, each time it is traced."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x * 1.0


class Seen(keras.layers.Layer):
    """Notes the dtype handed to it by the layer before (it computes in float32 itself, so it must not cast)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []
        self.autocast = False  # Keras casts no inputs of this layer: it sees what it is handed

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x


def _config(dtype, modules=None):
    block = {"enabled": True, "dtype": dtype}
    if modules is not None:
        block["lower_precision_safe_modules"] = modules
    return {"train_micro_batch_size_per_gpu": 8, "torch_autocast": block}


def _small_model():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = Probe(name="probe")(x)
    x = Seen(name="seen")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(4, name="d2")(x)
    outputs = keras.layers.Softmax(name="softmax")(x)
    return keras.Model(inputs, outputs)


def _fit(model, steps=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * steps, 16)).astype("float32")
    y = rng.integers(0, 4, 8 * steps)
    return model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.fixture
def float16():
    with kmp.precision_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        yield


def test_float16_layers_not_in_the_safe_set_compute_in_float32(float16, caplog):
    model = _small_model()
    model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), _config("float16")), "sparse_categorical_crossentropy")
    before = [w.numpy().copy() for w in model.trainable_weights]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        kmp.prepare(model)
    policies = {layer.name: layer.dtype_policy.name for layer in model.layers[1:]}
    assert policies == {"d1": "mixed_float16", "probe": "float32", "seen": "float32", "norm": "float32",
                        "d2": "mixed_float16", "softmax": "float32"}
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [f"kmp: torch_autocast.lower_precision_safe_modules: 4 layers of {model.name} compute in float32 "
                     "(1 LayerNormalization, 1 Probe, 1 Seen, 1 Softmax); in float16: 2 Dense. Weights stay float32."]
    probe, seen = model.get_layer("probe"), model.get_layer("seen")
    probe.seen.clear(), seen.seen.clear()  # their symbolic calls, building the model
    history = _fit(model)
    assert probe.seen and set(probe.seen) == {"float32"}  # it computes in float32 ...
    assert set(seen.seen) == {"float16"}  # ... and hands its output on in float16
    # The model's own output stays float32 (what the loss reads).
    assert keras.backend.standardize_dtype(model(np.zeros((2, 16), "float32")).dtype) == "float32"
    assert all(w.dtype == "float32" for w in model.weights)
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))


def test_listed_classes_stay_low_and_prepare_again_moves_nothing_more(float16, caplog):
    model = _small_model()
    config = _config("fp16", ["torch.nn.Linear", "torch.nn.LayerNorm"])
    model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), config), "sparse_categorical_crossentropy")
    kmp.prepare(model)
    assert model.get_layer("norm").dtype_policy.name == "mixed_float16"
    assert model.get_layer("probe").dtype_policy.name == "float32"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        kmp.prepare(model)
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert np.isfinite(_fit(model).history["loss"]).all()


def test_without_the_block_every_layer_keeps_its_policy(float16):
    model = _small_model()
    model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), {"fp16": {"enabled": True}}),
                  "sparse_categorical_crossentropy")
    kmp.prepare(model)
    assert {layer.dtype_policy.name for layer in model.layers[1:]} == {"mixed_float16"}
    assert lower_precision.apply(model, None) == []


def test_a_subclass_counts_as_its_class():
    import keras_hub

    safe = lower_precision.safe_classes(("torch.nn.Embedding",))
    assert safe == (keras.layers.Embedding,)
    assert isinstance(keras_hub.layers.ReversibleEmbedding(8, 4), safe)


def test_keras_hub_gpt2_in_bfloat16_moves_its_layers_and_trains(caplog, tmp_path):
    import real_models

    case = real_models.CASES["gpt2"]
    with kmp.precision_scope("mixed_bfloat16"):
        keras.utils.set_random_seed(0)
        model = case.build()
        model.compile(kmp.wrap(keras.optimizers.AdamW(1e-3), _config("torch.bfloat16")), loss=case.loss)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            kmp.prepare(model)
        x, y = case.data(16)
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # The line docs/precision.md shows.
    assert lines == [f"kmp: torch_autocast.lower_precision_safe_modules: 11 layers of {model.name} compute in "
                     "float32 (1 Add, 4 Dropout, 3 LayerNormalization, 1 PositionEmbedding, 1 ReversibleEmbedding, "
                     "1 Softmax); in bfloat16: 2 Dense, 4 EinsumDense. Weights stay float32."]
    backbone = model.backbone
    block = backbone.get_layer("transformer_layer_0")
    assert block._feedforward_layer_norm.compute_dtype == "float32"
    assert block._feedforward_intermediate_dense.compute_dtype == "bfloat16"
    assert block._self_attention_layer._softmax.compute_dtype == "float32"
    assert backbone.token_embedding.compute_dtype == "float32"
    # Only the live layers: the backbone's policy (what a saved model reloads with) is its one policy.
    assert backbone.dtype_policy.name == "mixed_bfloat16"
    assert all(w.dtype == "float32" for w in model.weights)
    assert np.isfinite(history.history["loss"]).all()
    # A saved model reloads in its one policy, and runs.
    model.save(tmp_path / "gpt2.keras")
    with kmp.precision_scope("mixed_bfloat16"):
        loaded = keras.models.load_model(tmp_path / "gpt2.keras")
    norm = loaded.backbone.get_layer("transformer_layer_0")._feedforward_layer_norm
    assert norm.compute_dtype == "bfloat16"
    assert np.isfinite(loaded.predict(x, verbose=0)).all()


def test_on_two_replicas_the_moved_layers_compute_in_float32_and_train(two_replicas):
    with kmp.precision_scope("mixed_bfloat16"), two_replicas.scope():
        keras.utils.set_random_seed(0)
        model = _small_model()
        model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), _config("bf16")), "sparse_categorical_crossentropy")
        kmp.prepare(model)
        probe, seen = model.get_layer("probe"), model.get_layer("seen")
        probe.seen.clear(), seen.seen.clear()
        before = [w.numpy().copy() for w in model.trainable_weights]
        history = _fit(model)
    assert probe.seen and set(probe.seen) == {"float32"}
    assert set(seen.seen) == {"bfloat16"}
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights))


def test_a_listed_rnn_computes_low_through_its_cell(float16):
    inputs = keras.Input((5, 3))
    x = keras.layers.LSTM(4, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x))
    model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), _config("fp16", ["torch.nn.LSTM", "torch.nn.Linear"])),
                  "mse")
    assert lower_precision.to_float32_layers(model, lower_precision.safe_classes(("torch.nn.LSTM",))) == [
        model.get_layer("out")]
    kmp.prepare(model)
    assert model.get_layer("lstm").cell.compute_dtype == "float16"
    model.compile(kmp.wrap(keras.optimizers.Adam(1e-3), _config("fp16", ["torch.nn.Linear"])), "mse")
    kmp.prepare(model)
    assert model.get_layer("lstm").cell.compute_dtype == "float32"
    assert model.get_layer("out").compute_dtype == "float16"
