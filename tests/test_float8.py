"""Float8 layers (Keras's model.quantize("float8")) under kmp: trained as under stock Keras.

Such a layer keeps delayed-scaling state beside its kernel: `*_scale` and `*_amax_history`
variables whose "gradient" is their new value (overwrite_with_gradient), which the optimizer
writes as it is. kmp must never unscale, sum across replicas, average, clip, accumulate or shard
them; the overflow line names real gradients only.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

ROWS = 16


def _model(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="d1"), keras.layers.Dense(8, name="d2"),
                              keras.layers.Dense(1, name="out", dtype="float32")])
    model.quantize("float8")
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(ROWS, 8)).astype("float32")
    x[ROWS // 2:] *= 4.0  # the second replica's rows (one batch): its amax histories differ from the first's
    return x, np.ones((ROWS, 1), "float32")


def _state(model):
    return {v.path.split("/", 1)[1]: v.numpy() for v in model.variables}


def _float8_state(variable) -> bool:
    return variable.path.endswith(("_scale", "_amax_history"))


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_float8_layers_train_as_under_stock_keras(policy):
    runs = {}
    for name in ("keras", "kmp"):
        model = _model(policy)
        optimizer = keras.optimizers.Adam(1e-2)
        if policy == "mixed_float16":  # from 256: no step overflows, and each writes its amax history
            optimizer = (kmp.wrap(optimizer, initial_scale=256.0) if name == "kmp"
                         else keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=256.0))
        elif name == "kmp":  # kmp.wrap hands a bfloat16 model's optimizer back as it is: kmp's, explicitly
            optimizer = kmp.LossScaleOptimizer(optimizer, static_scale=1.0)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(*_data(), batch_size=4, shuffle=False, verbose=0)
        if name == "kmp":
            assert int(model.optimizer.skipped_steps.numpy()) == 0
        runs[name] = _state(model)
    assert np.any(runs["kmp"]["d1/outputs_grad_amax_history"])
    for key, theirs in runs["keras"].items():
        np.testing.assert_array_equal(runs["kmp"][key], theirs, err_msg=key)


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
@pytest.mark.filterwarnings("ignore:kmp. zero_stage=1 shards")
@pytest.mark.parametrize("wrap", [{}, {"zero_stage": 1}], ids=["flat buffers", "zero 1"])
def test_float8_state_stays_each_replicas_own_on_the_flat_path_and_at_zero_1(two_replicas, wrap, caplog):
    """Asked for the flat buffers (or ZeRO stage 1, which needs them), kmp says why they are off and
    updates per variable; each replica's amax histories are its own (not averaged), equal to stock Keras's."""
    runs = {}
    for name in ("keras", "kmp"):
        with two_replicas.scope():
            model = _model("mixed_float16")
            optimizer = keras.optimizers.SGD(0.01)
            # From 256: the first steps do not overflow (an overflowing step writes no amax history).
            optimizer = (kmp.wrap(optimizer, initial_scale=256.0, **wrap) if name == "kmp"
                         else keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=256.0))
            model.compile(optimizer=optimizer, loss="mse")
        if name == "kmp":
            with caplog.at_level(logging.WARNING, logger="kmp.engine.prepare"):
                kmp.prepare(model, flat_buffers=True, jit_compile=False)
        model.fit(*_data(), batch_size=ROWS, shuffle=False, verbose=0)
        if name == "kmp":
            assert int(model.optimizer.skipped_steps.numpy()) == 0
        runs[name] = {v.path.split("/", 1)[1]: [r.numpy() for r in two_replicas.experimental_local_results(v.value)]
                      for v in model.variables if _float8_state(v)}
    assert "overwrite_with_gradient=True (float8)" in caplog.text
    history = runs["kmp"]["d1/inputs_amax_history"]
    assert not np.array_equal(history[0], history[1])  # each replica's own inputs, never averaged
    for key, theirs in runs["keras"].items():
        for ours, replica in zip(runs["kmp"][key], theirs):
            np.testing.assert_allclose(ours, replica, rtol=1e-6, err_msg=key)


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_gradient_accumulation_is_refused_for_float8_layers():
    model = _model("mixed_float16")
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(kmp.ConfigError, match="overwrite_with_gradient variables .float8."):
        model.fit(*_data(), batch_size=4, verbose=0)


def _variables():
    weight = keras.Variable(np.ones(2, "float32"), name="w")
    history = keras.Variable(np.zeros(2, "float32"), name="outputs_grad_amax_history")
    history.overwrite_with_gradient = True
    return [weight, history]


def test_the_overflow_line_names_real_gradients_only(capfd):
    inf = tf.constant([np.inf, 1.0])
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.apply([inf, inf], _variables())
    err = capfd.readouterr().err
    assert err.endswith("| non-finite gradients: w\n"), err
    assert int(optimizer.overflow_variable.numpy()) == 0
    # Only the float8 state was not finite: the step is still skipped (as in Keras), and no gradient is named.
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.apply([tf.ones(2), inf], _variables())
    err = capfd.readouterr().err
    assert err.endswith("| non-finite gradients: none (float8 scaling state only: amax history, scales)\n"), err
    assert int(optimizer.overflow_variable.numpy()) == -1 and int(optimizer.skipped_steps.numpy()) == 1
