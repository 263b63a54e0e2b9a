"""Nothing silently wrong: what a failing step, an odd value or a float8 layer gets from kmp.

Each test here failed on kmp before issue 10 (the issue's numbered defects).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.callbacks import LossScaleMonitor
from kmp.errors import LossScaleError
from kmp.scaling.gradients import clip_by_global_norm, global_norm
from kmp.scaling.optimizer import LossScaleOptimizer


class _InfLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_mean(y_pred) * tf.constant(np.inf, y_pred.dtype)


def _stuck_model(jit_compile=False):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0, log_overflows=False)
    model.compile(optimizer=opt, loss=_InfLoss(), jit_compile=jit_compile)
    return model


XY = (np.ones((32, 4), "float32"), np.ones((32, 1), "float32"))


# --- #7: the floor raises the type users catch, remedies first ---------------


def _assert_remedies_first(error):
    message = str(error)
    assert message.startswith("kmp: gradients overflowed with the loss scale already at its minimum"), message
    assert message.index("Remedies:") < 200, message


# Plain fit() (no monitor, no kmp.prepare): test_the_floor_raises_loss_scale_error_in_plain_fit_and_train_on_batch.
# With XLA the step cannot assert: the train function kmp's optimizer wraps reads the floor from the state.
@pytest.mark.parametrize("how", ["monitor", "prepare", "monitor+xla", "prepare+xla", "xla"])
def test_the_floor_raises_loss_scale_error_in_fit(how):
    model = _stuck_model(jit_compile=how.endswith("xla"))
    callbacks = [LossScaleMonitor()] if how.startswith("monitor") else []
    if how.startswith("prepare"):
        kmp.prepare(model)
    with pytest.raises(LossScaleError) as info:
        model.fit(*XY, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    _assert_remedies_first(info.value)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_the_floor_raises_loss_scale_error_under_mirrored_strategy(two_replicas):
    with two_replicas.scope():
        model = _stuck_model()
    kmp.prepare(model)  # XLA per replica; the optimizer step runs outside XLA
    with pytest.raises(LossScaleError, match="Remedies:"):
        model.fit(*XY, batch_size=8, epochs=3, verbose=0)


@pytest.mark.parametrize("distributed", [False, True])
def test_the_floor_raises_loss_scale_error_in_plain_fit_and_train_on_batch(two_replicas, distributed):
    """No kmp.prepare, no monitor: the optimizer makes its model's train function raise the type."""
    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    with strategy.scope():
        model = _stuck_model()
    with pytest.raises(LossScaleError) as info:
        model.fit(*XY, batch_size=8, epochs=3, verbose=0)
    _assert_remedies_first(info.value)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    with pytest.raises(LossScaleError, match="Remedies:"):
        model.train_on_batch(*XY)
    model.compile(optimizer=model.optimizer, loss=_InfLoss())  # a new train function: still raised as kmp's
    with pytest.raises(LossScaleError, match="Remedies:"):
        model.train_on_batch(*XY)
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("call", ["fit", "train_on_batch"])
def test_a_step_stuck_in_the_first_call_on_one_device_raises_loss_scale_error(call):
    """A mixed_float16 model on one device builds its optimizer inside its first train function call: the
    optimizer made that call raise kmp's type when the model was compiled (Keras's compile() of such a
    model asks the optimizer's truth value). The scale starts at the floor: the first step is stuck."""
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    finally:
        keras.config.set_dtype_policy(policy)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0, log_overflows=False)
    model.compile(optimizer=opt, loss=_InfLoss())
    assert model.train_function is None and not opt.built  # nothing traced or built before the call
    with pytest.raises(LossScaleError) as info:
        model.fit(*XY, batch_size=8, verbose=0) if call == "fit" else model.train_on_batch(*XY)
    _assert_remedies_first(info.value)
    assert int(opt.iterations.numpy()) == 0  # the stuck step was the first
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("batches", [1, 3])
def test_a_float32_model_stuck_in_its_first_call_raises_loss_scale_error(jit_compile, batches):
    """float32 and a kmp.LossScaleOptimizer made by hand: Keras's compile() asks the optimizer nothing, so
    the first train function call traces the step before the optimizer could wrap that call. The call runs
    without the in-graph assert (the stuck step is skipped), and kmp's wrapper reports it: before the next
    call, or when fit() ends (Keras's finalize_variable_values), with one call in all."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0, log_overflows=False)
    model.compile(optimizer=opt, loss=_InfLoss(), jit_compile=jit_compile)
    weights = model.get_weights()
    assert model.train_function is None and not opt.built
    with pytest.raises(LossScaleError) as info:
        model.fit(XY[0][:8 * batches], XY[1][:8 * batches], batch_size=8, verbose=0)
    _assert_remedies_first(info.value)
    assert int(opt.iterations.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 1  # one step ran, skipped
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(LossScaleError):  # and each later call, as any stuck step
        model.train_on_batch(*XY)


def test_a_float32_model_stuck_in_its_first_train_on_batch_raises_at_the_next_call():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0, log_overflows=False)
    model.compile(optimizer=opt, loss=_InfLoss())
    model.train_on_batch(*XY)  # Keras's train_on_batch asks the optimizer nothing after its call: skipped only
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 0
    with pytest.raises(LossScaleError):
        model.train_on_batch(*XY)
    assert int(opt.skipped_steps.numpy()) == 1  # raised before the second call ran


def test_no_false_alarm_when_the_first_call_is_clean_or_lifts_the_scale():
    """The same path, not stuck: an overflow above the floor, and clean steps that grow the scale."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0, dynamic_growth_steps=1,
                             log_overflows=False)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.ones((24, 4), "float32"), np.ones((24, 1), "float32")
    x[:8] = np.inf  # the first step overflows: 2 -> 1, at the floor but not stuck
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 2
    model.fit(x[8:], y[8:], batch_size=8, verbose=0)  # clean, from the floor: grows
    assert float(opt.dynamic_scale.numpy()) == 16.0


def test_other_errors_pass_through_unchanged():
    model = kmp.prepare(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError):
        model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), verbose=0)


# --- #8: one overflow line per step, not one per replica --------------------


def test_an_overflow_is_logged_once_under_mirrored_strategy(two_replicas, capfd):
    with two_replicas.scope():
        weight = keras.Variable(np.zeros(2, "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=8.0)
        opt.build([weight])

    @tf.function
    def step():
        two_replicas.run(lambda: opt.apply([tf.constant([np.inf, 1.0])], [weight]))

    step()
    err = capfd.readouterr().err
    assert err.count("kmp: gradient overflow, step skipped.") == 1, err


# --- #4: no NaN through clipping ---------------------------------------------


def test_huge_finite_gradients_get_a_finite_norm_and_are_clipped():
    grads = [tf.constant([3e20, -4e20], tf.float32), tf.constant([[0.0]], tf.float32)]
    assert float(global_norm(grads)) == pytest.approx(5e20, rel=1e-6)
    clipped = clip_by_global_norm(grads, 1.0)
    np.testing.assert_allclose(clipped[0].numpy(), [0.6, -0.8], rtol=1e-6)
    assert np.isnan(clip_by_global_norm([tf.constant([np.inf, 1.0])], 1.0)[0].numpy()).all()
    assert np.isnan(clip_by_global_norm([tf.constant([np.nan, 1.0])], 1.0)[0].numpy()).all()


@pytest.mark.parametrize("fused", [True, False])
def test_clipping_huge_finite_gradients_applies_a_finite_step(fused):
    weight = keras.Variable(np.zeros(2, "float32"))
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3), static_scale=1.0, gradient_clipping=1.0, fused=fused,
                             log_overflows=False)
    opt.apply([tf.constant([1e20, -1e20])], [weight])
    assert np.isfinite(weight.numpy()).all() and int(opt.skipped_steps.numpy()) == 0
    np.testing.assert_allclose(weight.numpy(), [-1e-3, 1e-3], rtol=1e-3)


def test_a_clip_that_float32_cannot_hold_is_refused():
    with pytest.raises(kmp.ConfigError, match="gradient_clipping"):
        kmp.wrap(keras.optimizers.Adam(1e-3), gradient_clipping=1e39, precision="mixed_float16")
    with pytest.raises(kmp.ConfigError, match="gradient_clipping"):
        kmp.load_config({"gradient_clipping": 3.5e38})


# --- #3: float8 layers' overwritten values stay per replica ------------------


def _float8_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.quantize("float8")
    return model


def test_float8_amax_history_stays_per_replica_as_in_keras(two_replicas):
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    y = np.ones((16, 1), "float32")
    histories = {}
    for name, make in (("keras", lambda: keras.optimizers.SGD(0.01)),
                       ("kmp", lambda: LossScaleOptimizer(keras.optimizers.SGD(0.01), static_scale=1.0))):
        with two_replicas.scope():
            model = _float8_model()
            model.compile(optimizer=make(), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        layer = model.layers[0]
        histories[name] = [v.numpy() for v in two_replicas.experimental_local_results(layer.kernel_amax_history.value)]
    for ours, theirs in zip(histories["kmp"], histories["keras"]):
        np.testing.assert_array_equal(ours, theirs)


# --- #8: an inf batch does not poison BatchNormalization's statistics -------


def test_an_inf_batch_keeps_batchnorm_statistics_finite_when_prepared(two_replicas):
    keras.config.set_dtype_policy("mixed_float16")
    with two_replicas.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), log_overflows=False), loss="mse")
    kmp.prepare(model)
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    x[8:16] = np.inf  # the second batch of 8
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(model.optimizer.skipped_steps.numpy()) == 1
    for variable in model.layers[1].non_trainable_variables:
        for value in two_replicas.experimental_local_results(variable.value):
            assert np.isfinite(value.numpy()).all(), variable.path


# --- The overflow line names where the overflow is ---------------------------


def test_the_overflow_line_names_the_variables_whose_gradients_overflowed(capfd):
    variables = [keras.Variable(np.ones(2, "float32"), name=f"w{i}") for i in range(5)]
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    grads = [tf.constant([1.0, 1.0]), tf.constant([np.inf, 1.0]), tf.constant([1.0, 1.0]),
             tf.constant([np.nan, 0.0]), tf.constant([-np.inf, 0.0])]
    opt.apply(grads, variables)
    err = capfd.readouterr().err
    assert "| non-finite gradients: w1, w3, w4\n" in err, err

    many = [keras.Variable(np.ones(1, "float32"), name=f"v{i}") for i in range(6)]
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    opt.apply([tf.constant([np.inf])] * 6, many)
    assert "| non-finite gradients: v0, v1, v2, and 3 more\n" in capfd.readouterr().err


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_monitor_logs_where_the_last_overflow_was(jit_compile, capfd):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="first"), keras.layers.Dense(1)],
                             name="net")
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64.0), loss="mse",
                  jit_compile=jit_compile)
    x, y = np.ones((16, 2), "float32"), np.zeros((16, 1), "float32")
    x[8:12] = np.inf  # batch 2 of 4
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[LossScaleMonitor()])
    assert history.history["overflow_variable"] == [0.0]  # dense/kernel: first in model.trainable_variables
    assert history.history["overflows"] == [1.0]
    err = capfd.readouterr().err
    if jit_compile:
        assert "XLA-compiled step, step skipped. First non-finite gradient: net/first/kernel" in err, err
    else:
        assert "| non-finite gradients: net/first/kernel, net/first/bias" in err, err


def test_a_second_clean_fit_reports_no_old_overflow_under_xla(capfd):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64.0), loss="mse",
                  jit_compile=True)
    x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")
    x[:4] = np.inf
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[LossScaleMonitor()])
    assert "First non-finite gradient" in capfd.readouterr().err
    model.fit(x[4:], y[4:], batch_size=4, verbose=0, callbacks=[LossScaleMonitor()])
    assert "First non-finite gradient" not in capfd.readouterr().err
