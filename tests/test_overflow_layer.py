"""Which layer overflowed: kmp.find_overflow (eager) and the prepared fit() step (kmp/engine/overflow_layer.py).

The float16 models here have one middle Dense layer, `d2`, whose output
exceeds float16's 65504 on a crafted batch while its inputs are finite:
d1's kernel is 0.25 everywhere, so a row of 100s gives d1 outputs of 100;
d2's kernel is 100 everywhere, so d2 outputs 8 * 100 * 100 = 80000 (inf in
float16). A row of 1s gives 800: clean.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import overflow_layer
from kmp.callbacks import LossScaleMonitor

HOT, COLD = 100.0, 1.0


def _craft(model):
    """The weights the module docstring describes (d1, d2 found by name at any depth)."""
    layers = {layer.name: layer for layer in model._flatten_layers()}
    layers["d1"].kernel.assign(np.full(layers["d1"].kernel.shape, 0.25, "float32"))
    layers["d2"].kernel.assign(np.full(layers["d2"].kernel.shape, 100.0, "float32"))
    return model


def _functional(dropout=True):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inputs)
    h = keras.layers.Dense(8, name="d2")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    if dropout:
        h = keras.layers.Dropout(0.5, seed=1, name="drop")(h)
    outputs = keras.layers.Dense(1, name="out", dtype="float32")(h)
    return keras.Model(inputs, outputs, name="net")


def _sequential():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d1"), keras.layers.Dense(8, name="d2"),
                             keras.layers.BatchNormalization(name="bn"),
                             keras.layers.Dense(1, name="out", dtype="float32")], name="net")


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(8, name="d1")
        self.second = keras.layers.Dense(8, name="d2")

    def call(self, x):
        return self.second(self.first(x))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.block = _Block(name="block")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.out = keras.layers.Dense(1, name="out", dtype="float32")

    def call(self, x, training=False):
        return self.out(self.bn(self.block(x), training=training))


def _subclassed():
    model = _Subclassed()
    model(np.ones((2, 4), "float32"))
    return model


def _compiled(model, jit_compile=False, **optimizer_args):
    # Back off as any overflow: these tests follow the diagnosis over several overflows. What a forward
    # overflow does otherwise is tests/test_forward_overflow.py's.
    optimizer_args.setdefault("forward_overflow", "backoff")
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), **optimizer_args), loss="mse",
                  jit_compile=jit_compile)
    return model


def _batch(rows=4, hot=()):
    x = np.full((rows, 4), COLD, "float32")
    x[list(hot)] = HOT
    return x, np.zeros((rows, 1), "float32")


def _state(model):
    return [np.array(v.numpy()) for v in model.variables]


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)


# --- kmp.find_overflow ---------------------------------------------------------


@pytest.mark.parametrize("make, name, number", [
    (_functional, "d2", 2),   # model.layers: the InputLayer, d1, d2, ...
    (_sequential, "d2", 1),   # a Sequential's layers hold no InputLayer
    (_subclassed, "block/d2", None),
])
def test_find_overflow_names_the_layer_whose_output_overflowed(make, name, number):
    model = _compiled(_craft(make()))
    before = _state(model)
    report = kmp.find_overflow(model, *_batch(hot=[1]))
    assert (report.layer, report.layer_class, report.what) == (name, "Dense", "output inf")
    assert report.output_max == np.inf
    assert report.inputs_max == pytest.approx(100.0)  # d1's output on a row of 100s
    assert report.loss_scale == 2.0**15
    assert report.nonfinite_gradients and report.nonfinite_gradients[0].endswith("d1/kernel")
    assert str(report).startswith(
        f"forward overflow in layer '{name}' (Dense): output inf, inputs finite; max |output| inf, "
        "max |inputs| 100 (float16 max 65504). Loss nan at loss scale 32768: non-finite gradients: ")
    table = overflow_layer.layer_table(model)
    if number is not None:
        assert model.layers[number].name == name == table[number][1]
    assert [n for _, n in table][-1] == "net"  # the model itself comes last
    # Nothing written: weights, BatchNormalization statistics, seed generators.
    for a, b in zip(before, _state(model)):
        np.testing.assert_array_equal(a, b)


def test_find_overflow_on_a_clean_batch_and_without_y():
    model = _compiled(_craft(_functional()))
    report = kmp.find_overflow(model, *_batch())
    assert (report.layer, report.what, report.nonfinite_gradients) == (None, None, ())
    assert str(report) == "forward pass finite. Loss 0 at loss scale 32768: gradients finite"
    report = kmp.find_overflow(model, _batch(hot=[0])[0])
    assert report.layer == "d2" and report.loss is None and report.loss_scale is None
    assert str(report).endswith("(float16 max 65504)")


def test_find_overflow_names_a_cast_overflow_at_a_layers_inputs():
    # d1 computes in float32 (1e5 is fine there); d2 casts its inputs to float16: inf.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="d1", dtype="float32"),
                              keras.layers.Dense(8, name="d2")])
    model.layers[0].kernel.assign(np.full((4, 8), 250.0, "float32"))
    report = kmp.find_overflow(model, np.full((2, 4), 100.0, "float32"))
    assert (report.layer, report.what, report.inputs_max) == ("d2", "inputs not finite", np.inf)
    assert str(report).startswith("forward overflow entering layer 'd2' (Dense): inputs not finite")


def test_find_overflow_on_a_batch_that_is_not_finite():
    model = _compiled(_craft(_functional()))
    x, y = _batch()
    x[0, 0] = np.nan
    report = kmp.find_overflow(model, x, y)
    assert (report.layer, report.what) == (None, "batch not finite")
    assert str(report).startswith("the batch itself is not finite. Loss nan")


def test_a_gradient_only_overflow_names_no_layer_but_the_variables():
    # Forward finite; the loss's gradient times the scale exceeds float16 in
    # the backward pass through the float16 layers.
    model = _compiled(_craft(_functional(dropout=False)))
    x, _ = _batch()
    y = np.full((4, 1), 60000.0, "float32")
    report = kmp.find_overflow(model, x, y)
    assert (report.layer, report.what) == (None, None)
    assert report.nonfinite_gradients and np.isfinite(report.loss)


# --- In fit() --------------------------------------------------------------------


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[LossScaleMonitor()],
                     **kwargs)


_LINE = ("kmp: gradient overflow, step skipped. Attempted loss scale: 32768 , reducing to 16384 "
         "| non-finite gradients: d1/kernel, d1/bias, d2/kernel, and 5 more "
         "| forward overflow in layer 'd2' (Dense): output inf, inputs finite\n")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_names_the_layer_on_one_device(jit_compile, capfd):
    x, y = (np.concatenate(parts) for parts in zip(_batch(hot=[2]), _batch()))
    runs = {}
    for find in (True, False):
        keras.utils.set_random_seed(0)
        model = kmp.prepare(_compiled(_craft(_functional()), jit_compile), find_overflow_layer=find)
        initial = [w.copy() for w in model.get_weights()]
        history = _fit(model, x[:4], y[:4])  # the overflowing batch alone: the weights must not move
        runs[find] = (model, history.history)
        for a, b in zip(initial, model.get_weights()):
            if a.ndim == 2:  # kernels (BatchNormalization's statistics are Keras's step's to write)
                np.testing.assert_array_equal(a, b)
    model, logs = runs[True]
    assert logs["overflows"] == [1.0] and logs["overflow_variable"] == [0.0]
    assert model.layers[int(logs["overflow_layer"][0])].name == "d2"
    assert "overflow_layer" not in runs[False][1]
    # The diagnosis wrote nothing the step itself did not: every variable of the
    # model (weights, statistics, the dropout seed) and of the optimizer agrees.
    for a, b in zip(_state(model) + _state(model.optimizer), _state(runs[False][0]) + _state(runs[False][0].optimizer)):
        np.testing.assert_array_equal(a, b)
    err = capfd.readouterr().err
    if jit_compile:  # the step cannot print: the monitor does
        assert ("XLA-compiled step, step skipped. First non-finite gradient: d1/kernel "
                "| forward overflow in layer 'd2' (Dense): output inf, inputs finite\n") in err, err
    else:
        assert err.count("kmp: gradient overflow") == 2, err
        assert _LINE in err, err  # find_overflow_layer=True
        assert "and 5 more\n" in err, err  # find_overflow_layer=False: the line as before


def test_fit_then_trains_on_and_reports_each_overflow(capfd):
    model = kmp.prepare(_compiled(_craft(_functional())))
    x, y = (np.concatenate(parts) for parts in zip(_batch(), _batch(hot=[3]), _batch()))
    history = _fit(model, x, y)
    assert history.history["overflows"] == [1.0]
    assert int(model.optimizer.iterations.numpy()) == 2  # the clean steps were applied
    assert capfd.readouterr().err.count("forward overflow in layer 'd2'") == 1
    # The next overflow, in the backward pass only, resets the layer.
    y[:] = 60000.0
    model.layers[1].kernel.assign(np.full((4, 8), 0.25, "float32"))
    history = _fit(model, x[:4], y[:4])
    assert history.history["overflow_layer"] == [-1.0]
    assert "| non-finite gradients: d1/kernel" in capfd.readouterr().err
    assert overflow_layer.state_of(model).text() == " | forward pass finite"


def test_a_failing_diagnosis_warns_and_training_goes_on(monkeypatch, caplog):
    def broken(*_, **__):
        raise RuntimeError("a layer that cannot run eagerly")

    monkeypatch.setattr(overflow_layer, "forward_notes", broken)
    model = kmp.prepare(_compiled(_craft(_functional())))
    x, y = (np.concatenate(parts) for parts in zip(_batch(), _batch(hot=[3]), _batch()))
    with caplog.at_level("WARNING", logger="kmp.engine.overflow_layer"):
        history = _fit(model, x, y)
    assert history.history["overflows"] == [1.0] and history.history["overflow_layer"] == [-1.0]
    assert int(model.optimizer.iterations.numpy()) == 2
    assert "naming the overflowing layer failed (RuntimeError: a layer that cannot run eagerly)" in caplog.text


def test_fit_names_the_layer_inside_a_subclassed_model(capfd):
    model = kmp.prepare(_compiled(_craft(_subclassed())))
    history = _fit(model, *_batch(hot=[0]))
    table = [name for _, name in overflow_layer.layer_table(model)]
    assert table[int(history.history["overflow_layer"][0])] == "block/d2"
    assert "| forward overflow in layer 'block/d2' (Dense): output inf, inputs finite\n" in capfd.readouterr().err


def test_fit_says_when_the_batch_itself_is_not_finite(capfd):
    model = kmp.prepare(_compiled(_craft(_functional())))
    x, y = _batch()
    x[1, 2] = np.inf
    history = _fit(model, x, y)
    assert history.history["overflow_layer"] == [-1.0]
    assert re.search(r"non-finite gradients: .* \| the batch itself is not finite\n", capfd.readouterr().err)


@pytest.mark.parametrize("jit_compile", ["auto", False])
def test_fit_names_the_layer_under_mirrored_strategy(two_replicas, jit_compile, capfd):
    # Only the second replica's half of the batch overflows.
    x, y = (np.concatenate(parts) for parts in zip(_batch(hot=[3]), _batch()))
    models = {}
    for find in (True, False):
        with two_replicas.scope():
            keras.utils.set_random_seed(0)
            models[find] = kmp.prepare(_compiled(_craft(_functional())), jit_compile=jit_compile,
                                       find_overflow_layer=find)
        initial = [w.copy() for w in models[find].get_weights()]
        history = _fit(models[find], x[:4], y[:4])
        for a, b in zip(initial, models[find].get_weights()):
            if a.ndim == 2:
                np.testing.assert_array_equal(a, b)
    assert history.history["overflows"] == [1.0]
    assert "overflow_layer" not in history.history  # find_overflow_layer=False
    state = overflow_layer.state_of(models[True])
    for layer in two_replicas.experimental_local_results(state.layer.value):
        assert models[True].layers[int(layer.numpy())].name == "d2"
    for variable, other in zip(models[True].variables + models[True].optimizer.variables,
                               models[False].variables + models[False].optimizer.variables):
        for a, b in zip(two_replicas.experimental_local_results(variable.value),
                        two_replicas.experimental_local_results(other.value)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    err = capfd.readouterr().err
    assert err.count("kmp: gradient overflow") == 2, err  # one line per step, not per replica
    assert _LINE in err, err


def test_prepare_checks_find_overflow_layer():
    with pytest.raises(kmp.ConfigError, match="find_overflow_layer"):
        kmp.prepare(_functional(), find_overflow_layer="yes")


def test_a_custom_train_step_is_left_alone():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((4,))
    model = Custom(inputs, keras.layers.Dense(1)(inputs))
    model = kmp.prepare(_compiled(model))
    history = _fit(model, *_batch())
    assert "overflow_layer" not in history.history
    assert overflow_layer.state_of(model) is None


def test_a_layer_with_its_own_loop_is_diagnosed_in_fit(capfd):
    # An LSTM calls its cell inside a tf.while_loop: the cell's calls stay
    # inside the loop; the layers around it are still named.
    model = keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(8, name="d1"), keras.layers.Dense(8, name="d2"),
                              keras.layers.LSTM(4, name="lstm"), keras.layers.Dense(1, name="out", dtype="float32")])
    model = kmp.prepare(_compiled(_craft(model)))
    x = np.full((4, 3, 4), COLD, "float32")
    x[1] = HOT
    history = _fit(model, x, np.zeros((4, 1), "float32"))
    assert model.layers[int(history.history["overflow_layer"][0])].name == "d2"
    assert "| forward overflow in layer 'd2' (Dense): output inf, inputs finite\n" in capfd.readouterr().err


def test_fit_names_the_layer_when_run_eagerly(capfd):
    model = _craft(_functional())
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), forward_overflow="backoff"), loss="mse",
                  run_eagerly=True)
    history = _fit(kmp.prepare(model), *_batch(hot=[0]))
    assert model.layers[int(history.history["overflow_layer"][0])].name == "d2"
    assert _LINE in capfd.readouterr().err
