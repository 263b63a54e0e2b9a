"""kmp.engine.replica_step: fit() with XLA per replica under MirroredStrategy (two logical CPUs).

The per-variable path (flat_buffers=False): tests/test_engine.py covers the flat buffers.
"""

import functools
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import replica_step, state
from kmp.errors import ConfigError
from parity import assert_same_update, trainable

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = (X[:, :1] * 2 - X[:, 1:2]).astype("float32")


def _model(extra_layers=(), regularizer=None, accumulation=None, jit_compile="auto", steps_per_execution=1):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer)(inputs)
    for layer in extra_layers:
        hidden = layer()(hidden)
    outputs = kmp.float32_output(keras.layers.Dense(1)(hidden))
    model = keras.Model(inputs, outputs)
    optimizer = kmp.wrap(keras.optimizers.Adam(0.01), log_overflows=False,
                         **({"gradient_accumulation_steps": accumulation} if accumulation else {}))
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model


def _fit(strategy, policy="mixed_float16", prepare=None, epochs=2, **kwargs):
    keras.config.set_dtype_policy(policy)
    with strategy.scope():
        model = _model(**kwargs)
    if prepare is not None:
        kmp.prepare(model, jit_compile=prepare, flat_buffers=False)
    history = model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def _replica_steps(model) -> dict:
    """The per-replica XLA functions kmp keeps for the model (kmp.engine.state), by replica."""
    prepared = state.of(model)
    return {} if prepared is None else prepared.replica_steps


def _replicas_identical(strategy, variables):
    for variable in variables:
        first, second = strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy(), err_msg=variable.path)


@pytest.fixture(scope="module")
def prepared(two_replicas):
    """(model, history): prepared with jit_compile=True, 2 epochs in mixed_float16 on two replicas. Read only."""
    policy = keras.config.dtype_policy()
    try:
        return _fit(two_replicas, prepare=True)
    finally:
        keras.config.set_dtype_policy(policy)


def test_xla_per_replica_trains_like_keras_without_xla(two_replicas, prepared):
    plain, plain_history = _fit(two_replicas, prepare=False)
    xla, xla_history = prepared
    assert set(_replica_steps(xla)) == {(id(two_replicas), 0), (id(two_replicas), 1)}
    assert not _replica_steps(plain)
    # The overflow-layer finder wraps the XLA step: the path still names XLA.
    assert replica_step.describe_path(xla) == "per-variable update, XLA per replica, overflow-layer finder"
    assert replica_step.describe_path(plain) == "per-variable update, no XLA, overflow-layer finder"
    for a, b in zip(plain.get_weights(), xla.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(plain_history["loss"], xla_history["loss"], rtol=2e-3)
    np.testing.assert_allclose(plain_history["mae"], xla_history["mae"], rtol=2e-3)
    _replicas_identical(two_replicas, xla.variables)
    assert int(xla.optimizer.iterations.numpy()) == 8


def test_the_compiled_function_is_xla_and_captures_no_variable(prepared):
    model, _ = prepared
    for function in _replica_steps(model).values():
        assert function._jit_compile is True  # tf.function(jit_compile=True)
        traced = function._list_all_concrete_functions_for_serialization()
        assert traced
        for concrete in traced:
            # Values come in as arguments: nothing inside reads a distributed variable.
            assert not [t for t in concrete.captured_inputs if t.dtype == tf.resource]


def test_kerass_own_jit_compile_true_fails_under_a_strategy_and_works_prepared(two_replicas):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        stock = _model(jit_compile=True)
    with pytest.raises(Exception, match="located in device"):
        stock.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    model, _ = _fit(two_replicas, policy="float32", prepare="auto", jit_compile=True)
    assert len(_replica_steps(model)) == 2
    # As stock Keras trains without XLA (in float32 kmp.wrap gives the optimizer itself; not prepared): 6e-8 apart.
    stock, _ = _fit(two_replicas, policy="float32")
    assert not _replica_steps(stock)
    assert_same_update(trainable(_model()), trainable(stock), trainable(model), rtol=1e-4)


def test_batchnorm_statistics_are_written_back_as_keras_writes_them(two_replicas):
    plain, _ = _fit(two_replicas, policy="float32", prepare=False, extra_layers=[keras.layers.BatchNormalization])
    xla, _ = _fit(two_replicas, policy="float32", prepare="auto", extra_layers=[keras.layers.BatchNormalization])
    moving_mean = next(v for v in xla.non_trainable_variables if v.path.endswith("moving_mean"))
    assert np.abs(moving_mean.numpy()).max() > 0  # updated from 0
    # Keras keeps each replica's own statistics (its variables are not
    # synchronized); each replica's copy must match stock Keras's.
    local = lambda v: [t.numpy() for t in two_replicas.experimental_local_results(v.value)]
    for ours, theirs in zip(xla.non_trainable_variables, plain.non_trainable_variables, strict=True):
        for a, b in zip(local(ours), local(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=ours.path)


def test_dropout_seeds_advance_as_keras_advances_them(two_replicas):
    """XLA draws other random numbers from the same seed (TensorFlow does not promise
    equal streams across XLA), so only the seed state is compared."""
    dropout = [lambda: keras.layers.Dropout(0.3)]
    plain, _ = _fit(two_replicas, policy="float32", prepare=False, extra_layers=dropout)
    xla, history = _fit(two_replicas, policy="float32", prepare="auto", extra_layers=dropout)
    (seed,) = [v for v in xla.non_trainable_variables if "seed" in v.path]
    (stock_seed,) = [v for v in plain.non_trainable_variables if "seed" in v.path]
    np.testing.assert_array_equal(seed.numpy(), stock_seed.numpy())
    assert np.isfinite(history["loss"]).all()
    _replicas_identical(two_replicas, xla.trainable_variables)


def test_regularization_losses_reach_the_compiled_loss(two_replicas):
    l2 = keras.regularizers.L2(0.5)
    _, plain = _fit(two_replicas, policy="float32", prepare=False, regularizer=l2, epochs=1)
    _, xla = _fit(two_replicas, policy="float32", prepare="auto", regularizer=l2, epochs=1)
    _, unregularized = _fit(two_replicas, policy="float32", prepare="auto", epochs=1)
    np.testing.assert_allclose(plain["loss"], xla["loss"], rtol=1e-5)
    assert xla["loss"][0] > unregularized["loss"][0] + 0.1


def test_accumulation_with_xla_per_replica_equals_one_big_batch(two_replicas):
    """Issue 4 under XLA: 2 micro-batches of 16 per step vs batches of 32, SGD-free Adam in float32."""
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        big = _model()
    kmp.prepare(big, flat_buffers=False)
    big.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    accumulated, _ = _fit(two_replicas, policy="float32", prepare="auto", accumulation=2)
    assert int(accumulated.optimizer.iterations.numpy()) == int(big.optimizer.iterations.numpy()) == 4
    for a, b in zip(big.get_weights(), accumulated.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_several_steps_per_execution_train_as_one(two_replicas, prepared):
    """Stock Keras fails here (tests/test_distribute.py); prepared, 4 steps a call equal 1."""
    one, one_history = prepared
    four, four_history = _fit(two_replicas, prepare="auto", steps_per_execution=4)
    assert len(_replica_steps(four)) == 2
    assert int(four.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 8
    for a, b in zip(one.get_weights(), four.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_history["loss"], four_history["loss"], rtol=1e-5)
    _replicas_identical(two_replicas, four.variables)


def test_a_tpu_strategy_keeps_kerass_step():
    """TPUStrategy compiles the whole step itself; the per-replica split is for CPU/GPU strategies."""

    class TPUStrategyFake:  # a TPU strategy by Keras's own test (the class name)
        num_replicas_in_sync = 8

    keras.config.set_dtype_policy("float32")
    model = _model()
    model._distribute_strategy = TPUStrategyFake()
    assert model.distribute_strategy.num_replicas_in_sync == 8
    assert not replica_step.wants_replica_xla(model, True)
    assert not replica_step.wants_replica_xla(model, "auto")
    # Nor kmp's multi-step loop: Keras's own runs there (no merge_call on TPUs).
    model.steps_per_execution = 4
    kmp.prepare(model, flat_buffers=False)
    function = _under_kmps_wrappers(model._make_function(model.train_step))
    assert function.__qualname__ == "TensorFlowTrainer._make_function.<locals>.function"


def test_the_multi_step_loop_is_kmps_with_several_replicas(two_replicas):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        model = _model(steps_per_execution=4)
    kmp.prepare(model, flat_buffers=False)
    function = _under_kmps_wrappers(model._make_function(model.train_step))
    assert function.__qualname__ == "_own_loop.<locals>.function"


def test_switches(two_replicas):
    off, _ = _fit(two_replicas, policy="float32", prepare=False, epochs=1)
    assert not _replica_steps(off)
    kmp.prepare(off, jit_compile="auto", flat_buffers=False)  # after a fit: the next fit rebuilds its step
    off.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert len(_replica_steps(off)) == 2
    with pytest.raises(ConfigError, match='jit_compile: expected "auto", True or False'):
        kmp.prepare(off, jit_compile="yes", flat_buffers=False)


def test_a_custom_train_step_is_kept(two_replicas):
    class Custom(keras.Model):
        calls = 0

        def train_step(self, data):
            Custom.calls += 1
            return super().train_step(data)

    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        inputs = keras.Input((6,))
        model = Custom(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    kmp.prepare(model, flat_buffers=False)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert Custom.calls > 0 and not _replica_steps(model)


def test_one_device_leaves_keras_in_charge():
    keras.config.set_dtype_policy("float32")
    model = _model()
    assert not replica_step.wants_replica_xla(model, True)
    kmp.prepare(model, jit_compile=True, flat_buffers=False)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert not _replica_steps(model)


class _RecordsGraphs(keras.layers.Layer):
    """Records the graph each of its calls is traced in (Keras's step: "one_step_on_data")."""

    graphs = []

    def call(self, x):
        type(self).graphs.append("eager" if tf.executing_eagerly() else tf.compat.v1.get_default_graph().name)
        return x


@pytest.mark.parametrize("jit_compile", [False, True])
def test_one_device_traces_the_step_once(jit_compile):
    # Without a strategy Keras builds the optimizer and metrics inside the first step, and variables
    # made in a tf.function's first trace make TensorFlow trace it twice: kmp.prepare builds them first.
    keras.config.set_dtype_policy("mixed_float16")
    model = _model(extra_layers=[_RecordsGraphs])
    kmp.prepare(model, jit_compile=jit_compile, flat_buffers=False, find_overflow_layer=False)
    _RecordsGraphs.graphs = []
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert [g for g in _RecordsGraphs.graphs if g.startswith("one_step_on_data")] == ["one_step_on_data"]
    assert replica_step.path_of(model)["taken"].startswith("per-variable update")


class OwnCall(keras.Sequential):
    """Overrides __call__, as keras-hub's task models do: autograph converts such a method when the
    step that calls it is converted, into code that sees autograph's module `ag__`."""

    converted = []

    def __call__(self, *args, **kwargs):
        try:
            ag__  # noqa: F821,B018 - defined only where autograph converted the code
            type(self).converted.append(True)
        except NameError:
            type(self).converted.append(False)
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("flat_buffers", [False, True])
def test_the_step_runs_the_models_python_unconverted_as_keras_does(flat_buffers):
    # Keras never converts a model's Python with autograph (its step is do_not_convert). Converted, a
    # keras-hub model traces for seconds longer, and a Python `if` on a tensor acts otherwise than in Keras.
    keras.config.set_dtype_policy("mixed_float16")
    model = OwnCall([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(0.01), log_overflows=False), loss="mse")
    kmp.prepare(model, flat_buffers=flat_buffers, find_overflow_layer=False)
    OwnCall.converted = []
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert OwnCall.converted and not any(OwnCall.converted)
    assert replica_step.path_of(model)["taken"].startswith("flat buffers" if flat_buffers else "per-variable")


class OnlyTrains(keras.Model):
    """Builds only in training: Keras's build from shapes (which calls it with training=False) fails."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x, training=False):
        if not training:
            raise RuntimeError("this model only trains")
        return self.dense(x)


def test_a_model_keras_cannot_build_from_shapes_builds_in_its_first_step(caplog):
    keras.config.set_dtype_policy("float32")
    model = OnlyTrains()
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    kmp.prepare(model)
    with caplog.at_level(logging.INFO, logger="kmp.engine.prepare"):
        history = model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][1] < history.history["loss"][0]
    assert "is built in its first step, as Keras does without a strategy" in caplog.text


def test_a_model_stock_keras_cannot_train_fails_as_under_stock_keras():
    # TensorFlow refuses a name scope that starts with "_", after Keras has opened its own: the
    # failed build from shapes closes what it opened, and the first step fails as stock Keras's does.
    from keras.src.backend.common import global_state

    keras.config.set_dtype_policy("float32")
    stack = global_state.get_global_attribute("name_scope_stack", default=[], set_to_default=True)
    errors, left_open = [], []
    for prepared in (False, True):
        depth = len(stack)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)], name="_refused")
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1)), loss="mse")
        if prepared:
            kmp.prepare(model)
        with pytest.raises(ValueError, match="not a valid root scope name") as info:
            model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
        errors.append(str(info.value))
        left_open.append(len(stack) - depth)
        del stack[depth:]  # what Keras's own failed step leaves open, closed for the tests after this one
    assert errors[0] == errors[1]
    assert left_open[1] == left_open[0]


def test_recompiling_a_prepared_model_uses_the_new_loss(two_replicas):
    """Issue 10 #1: the per-replica XLA functions were cached across compile()."""
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        model = _model()
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.0)), loss="mse")
    kmp.prepare(model, flat_buffers=False)
    mse = model.fit(X, Y + 10, batch_size=16, verbose=0).history["loss"][0]
    with two_replicas.scope():
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.0)), loss="mae")
    mae = model.fit(X, Y + 10, batch_size=16, verbose=0).history["loss"][0]
    expected = float(np.mean(np.abs(model.predict(X, verbose=0) - (Y + 10))))
    assert mse > 50 and abs(mae - expected) < 1e-3 * expected


def test_freezing_layers_and_recompiling_a_prepared_model_trains_as_unprepared(two_replicas):
    keras.config.set_dtype_policy("float32")
    weights = []
    for prepare in (False, True):
        with two_replicas.scope():
            model = _model()
        if prepare:
            kmp.prepare(model, flat_buffers=False)
        model.fit(X, Y, batch_size=16, verbose=0, shuffle=False)
        model.layers[1].trainable = False
        with two_replicas.scope():
            model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(0.01)), loss="mse")
        model.fit(X, Y, batch_size=16, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for plain, prepared in zip(*weights):
        np.testing.assert_allclose(plain, prepared, rtol=1e-5, atol=1e-6)


@functools.cache
def _on_one_device(batch_size, weighted, accumulation, loss):
    """_sgd_trajectory on one device: the same for the per-variable and the flat cases. Read only."""
    return _sgd_trajectory(None, batch_size, False, _row_weights() if weighted else None, accumulation, loss)


def _row_weights():
    return np.linspace(0.5, 2.0, 7).astype("float32")


def _sgd_trajectory(strategy, batch_size, flat, sample_weight=None, accumulation=None, loss="mse"):
    """(weights, losses per epoch) after 2 epochs of SGD on 7 rows, on one device (strategy None) or prepared."""
    keras.config.set_dtype_policy("float32")
    with strategy.scope() if strategy else keras.name_scope("one_device"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        inner = keras.optimizers.SGD(0.1, momentum=0.5)
        model.compile(optimizer=kmp.LossScaleOptimizer(inner, gradient_accumulation_steps=accumulation), loss=loss)
    if strategy:
        kmp.prepare(model, flat_buffers=flat)
    history = model.fit(X[:7], Y[:7], batch_size=batch_size, epochs=2, sample_weight=sample_weight, shuffle=False,
                        verbose=0)
    assert flat == (strategy is not None and kmp.engine.engine.engine_of(model) is not None)
    return model.get_weights(), history.history["loss"]


# Each path (per-variable, flat) with an empty share in every step and with weighted uneven shares;
# both call replica_step.row_weight, and the weighted cases have an empty share in each epoch's last batch.
@pytest.mark.parametrize("flat, batch_size, weighted, accumulation, loss", [
    (True, 1, False, None, "mse"),  # each batch's second share is empty
    (False, 3, True, None, "mse"),   # shares of 2 and 1 rows, then the epoch's last batch of 1: 1 and 0
    (True, 3, True, None, "mse"),
    (True, 4, False, 2, "mse"),      # 2 and 2, then 2 and 1: accumulation averages per micro-batch, as one device
    (False, 3, False, None, keras.losses.MeanSquaredError(reduction="sum")),  # a sum per row: not weighted
])
def test_uneven_shares_train_as_one_device(two_replicas, caplog, flat, batch_size, weighted, accumulation, loss):
    """Keras's mean losses averaged each replica's mean: an empty share halved the step (batch 1)."""
    one = _on_one_device(batch_size, weighted, accumulation, loss)
    two = _sgd_trajectory(two_replicas, batch_size, flat, _row_weights() if weighted else None, accumulation, loss)
    for a, b in zip(one[0], two[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6)  # XLA's FMA contraction over 14 steps
    if loss == "mse":  # (Keras reports a summed loss times the replicas)
        np.testing.assert_allclose(one[1], two[1], rtol=1e-5)
    assert "weighted per replica" not in caplog.text


def test_which_losses_are_weighted_by_rows(caplog):
    class OwnLoss(keras.Sequential):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    def mean_per_row(loss, kind=keras.Sequential):
        model = kind([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss=loss)
        return replica_step._mean_per_row(model)

    mse = keras.losses.MeanSquaredError
    assert mean_per_row("mse") and mean_per_row(keras.losses.mean_squared_error) and mean_per_row(mse())
    assert not mean_per_row(mse(reduction="sum")) and not caplog.text  # exact unweighted
    assert not mean_per_row("mse", OwnLoss)
    assert "weighted per replica, as Keras does, not per row: the model has its own compute_loss" in caplog.text
    assert not mean_per_row([mse(), mse(reduction="sum")])  # one weight cannot fit both
    assert "its losses reduce by ['sum', 'sum_over_batch_size']" in caplog.text


def _under_kmps_wrappers(function):
    """The train function under kmp's floor-error translation, first-step fallback, iterator release, check of
    the strategy and forward-overflow watch."""
    while function.__qualname__ in ("raising_loss_scale_errors.<locals>.call", "_falling_back.<locals>.call",
                                    "releasing.<locals>.call", "_in_its_own_strategy.<locals>.call",
                                    "watching.<locals>.call"):
        function = function.__wrapped__
    return function


@pytest.mark.parametrize("flat_buffers", [False, True])
def test_replicas_on_cpus_run_their_passes_in_turn_only_for_a_large_model(two_replicas, monkeypatch, flat_buffers):
    real, seen = replica_step.in_turn, []

    def spy(model, scale):
        out = real(model, scale)
        seen.append((scale, out, state.ensure(model).last_pass))
        return out

    monkeypatch.setattr(replica_step, "in_turn", spy)
    for threshold, waits in ((replica_step.IN_TURN_PARAMETERS, False), (0, True)):
        monkeypatch.setattr(replica_step, "IN_TURN_PARAMETERS", threshold)
        seen.clear()
        with two_replicas.scope():
            model = _model()
        kmp.prepare(model, flat_buffers=flat_buffers)
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        second = [(scale, out, previous) for scale, out, previous in seen
                  if previous is not None and previous.graph is out.graph]
        assert len(seen) >= 2 and second, seen  # the second replica is traced after the first's pass
        for scale, out, previous in second:  # tiny model (97 parameters): together; threshold 0: in turn
            assert (out is not scale and previous.op in out.op.control_inputs) == waits
