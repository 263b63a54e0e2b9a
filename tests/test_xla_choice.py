"""kmp.engine.xla_choice: a forward/backward whose trace predicts minutes of XLA compile runs without XLA.

The limits are lowered here so that a tiny model is past them: the measure is
checked on graphs of known shape, and the decision on fit() (flat buffers on
one device, the per-variable step under MirroredStrategy), against
prepare(jit_compile=False) and True.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import replica_step, xla_choice
from parity import assert_same_update, trainable

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 6)).astype("float32")
Y = (X[:, :1] - X[:, 1:2]).astype("float32")


def _graph(fn):
    return tf.function(fn).get_concrete_function(tf.TensorSpec([4], tf.float32)).graph


def _chain(x):
    for _ in range(30):
        x = tf.sin(x)
    return x


def _branches(x):
    return tf.add_n([tf.sin(tf.cos(x) * float(k)) for k in range(20)])  # 20 x (cos, mul, sin), then add_n


def test_a_chain_is_as_long_as_its_ops():
    assert xla_choice.cost(_graph(_chain)) == (30, 30)


def test_parallel_branches_are_wide():
    assert xla_choice.cost(_graph(_branches)) == (61, 4)


def test_only_a_wide_graph_past_the_limit_is_too_costly(monkeypatch):
    monkeypatch.setattr(xla_choice, "LIMIT", 61 * 61 / 4 - 1)
    assert xla_choice.too_costly(_graph(_branches)) == (61, 4)  # 15 wide
    assert xla_choice.too_costly(_graph(_chain)) is None  # 1 wide: compile time linear in its ops
    monkeypatch.setattr(xla_choice, "LIMIT", 61 * 61 / 4)
    assert xla_choice.too_costly(_graph(_branches)) is None


def _fit(strategy=None, jit_compile="auto", flat=True):
    model = _model(strategy)
    kmp.prepare(model, jit_compile=jit_compile, flat_buffers=flat)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


def _model(strategy=None):
    # Keras's global state (layer names) as fresh in every fit, whatever ran before in this process:
    # fits compared to 1e-6 then build the same model (otherwise 4e-5 apart after another test).
    keras.backend.clear_session()
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else keras.name_scope("one_device"):
        inputs = keras.Input((6,))
        branches = [keras.layers.Dense(4, activation="relu")(inputs) for _ in range(3)]
        outputs = kmp.float32_output(keras.layers.Dense(1)(keras.layers.Add()(branches)))
        model = keras.Model(inputs, outputs, name="branches")
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(0.01), log_overflows=False), loss="mse")
    return model


def _declines(caplog):
    return [r for r in caplog.records if "runs without XLA" in r.getMessage()]


@pytest.fixture
def low_limit(monkeypatch):
    monkeypatch.setattr(xla_choice, "LIMIT", 1)
    monkeypatch.setattr(xla_choice, "WIDE", 1)


def test_past_the_limit_the_flat_engine_trains_as_without_xla(low_limit, caplog):
    with caplog.at_level(logging.WARNING, logger="kmp"):
        model, losses = _fit()
    declines = _declines(caplog)
    assert len(declines) == 1, [r.getMessage() for r in caplog.records]
    assert "branches: the forward/backward runs without XLA: its graph (" in declines[0].getMessage()
    assert "kmp.prepare(model, jit_compile=True) compiles it anyway" in declines[0].getMessage()
    path = replica_step.describe_path(model)
    assert path.startswith("flat buffers, no XLA, overflow-layer finder (XLA off: its graph ("), path
    # The same step as prepare(jit_compile=False): the same ops, outside XLA.
    _, plain = _fit(jit_compile=False)
    np.testing.assert_array_equal(losses, plain)


def test_jit_compile_true_compiles_past_the_limit(two_replicas, low_limit, caplog):
    with caplog.at_level(logging.WARNING, logger="kmp"):
        model, _ = _fit(two_replicas, jit_compile=True, flat=False)
    assert not _declines(caplog)
    assert replica_step.describe_path(model) == "per-variable update, XLA per replica, overflow-layer finder"
    trained = trainable(model)
    plain = trainable(_fit(two_replicas, jit_compile=False, flat=False)[0])
    assert_same_update(trainable(_model(two_replicas)), plain, trained, rtol=1e-4)  # 2.4e-6 apart here


def test_under_the_limit_auto_compiles(caplog):
    with caplog.at_level(logging.WARNING, logger="kmp"):
        model, _ = _fit()
    assert not _declines(caplog)
    assert replica_step.describe_path(model) == "flat buffers, XLA per replica, overflow-layer finder"


def test_past_the_limit_each_replica_runs_without_xla_said_once(two_replicas, low_limit, caplog):
    caplog.set_level(logging.WARNING, logger="kmp")
    model, losses = _fit(two_replicas, flat=False)
    assert len(_declines(caplog)) == 1
    assert replica_step.describe_path(model).startswith("per-variable update, no XLA, overflow-layer finder (XLA off")
    _, plain = _fit(two_replicas, jit_compile=False, flat=False)
    np.testing.assert_allclose(losses, plain, rtol=1e-6)
    # What the warning offers: prepared again with jit_compile=True, the same model compiles.
    kmp.prepare(model, jit_compile=True, flat_buffers=False)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert replica_step.describe_path(model) == "per-variable update, XLA per replica, overflow-layer finder"
    assert len(_declines(caplog)) == 1
