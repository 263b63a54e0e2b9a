"""kmp.LossScaleOptimizer: Keras parity, the spec, serialization, replicas."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmp.config.settings import LossScaleConfig
from kmp.errors import ConfigError, LossScaleError
from kmp.scaling.optimizer import LossScaleOptimizer

INF = np.float32(np.inf)


def _grad_sequence(steps, seed=0, overflow_every=5):
    """Scaled gradients for two variables; every few steps one holds an inf."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        g1 = rng.normal(size=(3, 2)).astype("float32") * 100
        g2 = rng.normal(size=(2,)).astype("float32") * 100
        if i % overflow_every == overflow_every - 1:
            g1[0, 0] = INF if i % 2 else np.nan
        out.append([tf.constant(g1), tf.constant(g2)])
    return out


def _variables():
    return [keras.Variable(np.ones((3, 2), "float32"), name="k"), keras.Variable(np.zeros(2, "float32"), name="b")]


def _trajectory(optimizer, grads_seq, run=lambda f: f()):
    variables = _variables()
    optimizer.build(variables)
    scales, iterations = [], []
    for grads in grads_seq:
        run(lambda: optimizer.apply(grads, variables))
        scales.append(float(optimizer.dynamic_scale.numpy()))
        iterations.append(int(optimizer.iterations.numpy()))
    return scales, iterations, [v.numpy() for v in variables]


@pytest.mark.parametrize("fused", [False, True], ids=["keras_update", "fused"])
@pytest.mark.parametrize("inner", ["sgd", "adam", "adamw"])
def test_trajectory_matches_keras(inner, fused):
    """Defaults (H=1), scale never at the floor: same scale, weights, iterations.

    Bit for bit with Keras's update; fused, XLA contracts a*b+c into one FMA
    (kmp.engine.fused), so the weights agree to rounding.
    """
    grads_seq = _grad_sequence(23)
    make = lambda: keras.optimizers.get({"class_name": inner, "config": {"learning_rate": 0.01}})
    ours = _trajectory(
        LossScaleOptimizer(make(), initial_scale=2.0**10, dynamic_growth_steps=3, fused=fused), grads_seq
    )
    theirs = _trajectory(
        keras.optimizers.LossScaleOptimizer(make(), initial_scale=2.0**10, dynamic_growth_steps=3), grads_seq
    )
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    for a, b in zip(ours[2], theirs[2]):
        if fused:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        else:
            np.testing.assert_array_equal(a, b)
    assert ours[0][2:5] == [2.0**11, 2.0**11, 2.0**10]  # grew at step 3, step 5 overflowed
    assert ours[1][4] == ours[1][3]  # a skipped step does not advance iterations


def test_trajectory_matches_keras_inside_tf_function():
    grads_seq = _grad_sequence(12, seed=3)

    def in_function(opt):
        variables = _variables()
        opt.build(variables)
        step = tf.function(lambda g: opt.apply(g, variables))
        for g in grads_seq:
            step(g)
        return float(opt.dynamic_scale.numpy()), int(opt.iterations.numpy()), [v.numpy() for v in variables]

    ours = in_function(LossScaleOptimizer(keras.optimizers.Adam(0.01), dynamic_growth_steps=2))
    theirs = in_function(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), dynamic_growth_steps=2))
    assert ours[:2] == theirs[:2]
    for a, b in zip(ours[2], theirs[2]):
        np.testing.assert_array_equal(a, b)


def test_a_users_tf_function_does_not_autograph_convert_kmps_step():
    """Keras's code is never autograph-converted (TensorFlow's DoNotConvert('keras')); neither is kmp's step
    when a user's tf.function calls it. Converted, it took several seconds of CPU on its first trace."""
    def converted():
        return {m for m in sys.modules if m.startswith("__autograph_generated_file")}

    variables = _variables()
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    opt.build(variables)
    before = converted()
    tf.function(lambda g: opt.apply(g, variables)).get_concrete_function(_grad_sequence(1)[0])
    assert len(converted() - before) <= 1  # the lambda itself


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dynamic=False), "no longer supports `dynamic=False`"),
        (dict(clipnorm=1.0), "does not support `clipnorm`"),
        (dict(use_ema=True), "does not support `use_ema`"),
        (dict(bogus=1), "does not support arguments: `bogus`"),
        (dict(foo=True, bar=3), "does not support arguments: `foo`, `bar`"),
    ],
)
def test_rejects_what_keras_rejects_with_the_same_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    with pytest.raises(ValueError, match=message):
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_invalid_settings_are_reported_together():
    with pytest.raises(ConfigError) as info:
        LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=0, min_scale=-1, growth_rule="always")
    paths = [p.path for p in info.value.problems]
    assert paths == ["min_scale", "hysteresis", "growth_rule"]
    assert "Received: hysteresis=0" in str(info.value)


@pytest.mark.parametrize("inner", ["adam", keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())])
def test_inner_must_be_a_plain_keras_optimizer(inner):
    with pytest.raises(ConfigError, match="inner_optimizer"):
        LossScaleOptimizer(inner)


def test_keras_scale_reaches_zero_and_writes_inf_kmp_floors():
    """The reproduction: 200 overflowing steps, then one finite step."""
    bad = [tf.constant([INF])]
    good = [tf.constant([1.0])]

    def run(opt):
        v = [keras.Variable(np.ones(1, "float32"))]
        opt.build(v)
        for _ in range(200):
            opt.apply(bad, v)
        opt.apply(good, v)
        return float(opt.dynamic_scale.numpy()), float(v[0].numpy()[0])

    keras_scale, keras_weight = run(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    assert keras_scale == 0.0 and np.isinf(keras_weight)  # Keras's defect, still present
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1), raise_at_min_scale=False, log_overflows=False)
    kmp_scale, kmp_weight = run(ours)
    assert kmp_scale == 1.0 and kmp_weight == pytest.approx(0.9)
    assert int(ours.overflows.numpy()) == 200 and int(ours.skipped_steps.numpy()) == 200


def test_scale_never_exceeds_the_ceiling():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=2.0**20, dynamic_growth_steps=1)
    v = [keras.Variable(np.ones(1, "float32"))]
    for _ in range(10):
        opt.apply([tf.constant([1.0])], v)
    assert float(opt.dynamic_scale.numpy()) == 2.0**24


def test_raises_at_the_floor_eagerly():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0, log_overflows=False)
    v = [keras.Variable(np.ones(1, "float32"))]
    for _ in range(2):
        opt.apply([tf.constant([INF])], v)
    assert float(opt.dynamic_scale.numpy()) == 1.0
    with pytest.raises(LossScaleError, match="minimum"):
        opt.apply([tf.constant([INF])], v)
    assert float(v[0].numpy()[0]) == 1.0


class _InfLoss(keras.losses.Loss):
    """A loss whose gradient overflows on every step."""

    def call(self, y_true, y_pred):
        return tf.reduce_mean(y_pred) * tf.constant(np.inf, y_pred.dtype)


def test_fit_stops_with_a_clear_error_at_the_floor():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0, log_overflows=False)
    model.compile(optimizer=opt, loss=_InfLoss())
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    with pytest.raises(Exception, match="gradients overflowed with the loss scale already at its minimum"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert float(opt.dynamic_scale.numpy()) == 1.0
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_overflow_log_line(capfd):
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0, hysteresis=2)
    v = [keras.Variable(np.ones(1, "float32"))]
    opt.apply([tf.constant([INF])], v)
    opt.apply([tf.constant([INF])], v)
    opt.apply([tf.constant([1.0])], v)
    err = capfd.readouterr().err
    assert "Loss scale stays 8 (hysteresis absorbed it; 1 left)" in err
    assert "Attempted loss scale: 8 , reducing to 4" in err
    assert err.count("kmp:") == 2  # nothing on the clean step


def test_overflow_log_line_at_the_floor(capfd):
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0, raise_at_min_scale=False)
    v = [keras.Variable(np.ones(1, "float32"))]
    for _ in range(2):
        opt.apply([tf.constant([INF])], v)
    err = capfd.readouterr().err
    assert "reducing to 1" in err and "Loss scale stays at its minimum 1" in err
    assert "absorbed" not in err


def test_config_round_trip_keeps_every_setting():
    settings = LossScaleConfig(
        initial_scale=2.0**12, dynamic_growth_steps=7, hysteresis=3, consecutive_hysteresis=True,
        min_scale=0.25, max_scale=2.0**20, raise_at_min_scale=False, growth_rule="after_window",
        growth_factor=4.0, backoff_factor=0.25,
    )
    opt = LossScaleOptimizer.from_loss_scale_config(keras.optimizers.AdamW(0.003), settings, log_overflows=False)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert type(restored) is LossScaleOptimizer
    assert restored.loss_scale_config == settings
    assert restored.log_overflows is False
    assert restored.get_config() == opt.get_config()
    assert restored.inner_optimizer.get_config() == opt.inner_optimizer.get_config()
    static = LossScaleOptimizer(keras.optimizers.SGD(), static_scale=128.0)
    assert LossScaleOptimizer.from_config(static.get_config()).loss_scale_config.static_scale == 128.0


STATE = ("dynamic_scale", "hysteresis_left", "good_steps", "overflows", "skipped_steps", "step_counter")


def _state(opt):
    return {name: getattr(opt, name).numpy().item() for name in STATE} | {"iterations": int(opt.iterations.numpy())}


def _trained_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=64.0, hysteresis=3, dynamic_growth_steps=2,
                             log_overflows=False)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    opt.apply([tf.fill(v.shape, INF) for v in model.trainable_variables], model.trainable_variables)
    return model, opt


def test_keras_file_round_trip_restores_the_state(tmp_path):
    model, opt = _trained_model()
    before = _state(opt)
    assert before["overflows"] == 1 and before["hysteresis_left"] == 2 and before["iterations"] == 5
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"_InfLoss": _InfLoss})
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert loaded.optimizer.loss_scale_config == opt.loss_scale_config
    assert _state(loaded.optimizer) == before


def test_checkpoint_round_trip_restores_the_state(tmp_path):
    model, opt = _trained_model()
    before = _state(opt)
    prefix = tf.train.Checkpoint(optimizer=opt, model=model).save(str(tmp_path / "ckpt"))
    opt.apply([tf.ones(v.shape) for v in model.trainable_variables], model.trainable_variables)
    assert _state(opt) != before
    tf.train.Checkpoint(optimizer=opt, model=model).restore(prefix).assert_consumed()
    assert _state(opt) == before


def test_fit_in_mixed_float16_reaches_float32_accuracy():
    from kmp.data.datasets import load_digits

    (x, y), (xt, yt) = load_digits()

    def train(policy, optimizer):
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10), keras.layers.Activation("softmax", dtype="float32"),
        ])
        # An epoch's 45 steps in one call: the same updates, without 45 Python round trips an epoch.
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=45)
        model.fit(x, y, batch_size=32, epochs=8, verbose=0)
        return model.evaluate(xt, yt, verbose=0)[1]

    fp32 = train("float32", keras.optimizers.Adam(3e-3))
    opt = LossScaleOptimizer(keras.optimizers.Adam(3e-3), log_overflows=False)
    fp16 = train("mixed_float16", opt)
    assert fp32 > 0.93
    assert fp16 >= fp32 - 0.02
    assert int(opt.iterations.numpy()) + int(opt.skipped_steps.numpy()) == 8 * 45


# --- Replicas: two logical CPU devices -------------------------------------


def _mirrored_step(strategy, opt, weight, grads_for_replica):
    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = tf.switch_case(rid, [lambda g=g: tf.constant(g) for g in grads_for_replica])
            opt.apply([grads], [weight])

        strategy.run(fn)

    step()
    return [v.numpy() for v in strategy.experimental_local_results(weight.value)]


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_an_inf_on_either_replica_skips_the_step_on_every_replica(two_replicas, bad_replica):
    with two_replicas.scope():
        weight = keras.Variable(np.ones(2, "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0, log_overflows=False)
        opt.build([weight])
    grads = [[1.0, 1.0], [1.0, 1.0]]
    grads[bad_replica] = [INF, 1.0]
    values = _mirrored_step(two_replicas, opt, weight, grads)
    for v in values:
        np.testing.assert_array_equal(v, [1.0, 1.0])
    assert float(opt.dynamic_scale.numpy()) == 1.0
    assert int(opt.iterations.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 1
    # Keras's own class applies the inf when it sits on replica 1 only.
    with two_replicas.scope():
        keras_weight = keras.Variable(np.ones(2, "float32"))
        keras_opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0)
        keras_opt.build([keras_weight])
    keras_values = _mirrored_step(two_replicas, keras_opt, keras_weight, grads)
    assert np.isfinite(keras_values[0]).all() == (bad_replica == 0)


def test_replicas_reduce_once_and_match_one_device(two_replicas):
    """Gradients reach the inner optimizer summed once, not once per layer of code."""
    with two_replicas.scope():
        weight = keras.Variable(np.ones(2, "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0, log_overflows=False)
        opt.build([weight])
    values = _mirrored_step(two_replicas, opt, weight, [[1.0, 2.0], [3.0, 4.0]])
    # sum = [4, 6]; unscaled by 2 -> [2, 3]; SGD(1.0) from 1.
    for v in values:
        np.testing.assert_array_equal(v, [-1.0, -2.0])
    assert int(opt.iterations.numpy()) == 1


def test_fit_under_mirrored_strategy_keeps_replicas_identical(two_replicas):
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    with two_replicas.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), dynamic_growth_steps=3, log_overflows=False)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(opt.iterations.numpy()) + int(opt.skipped_steps.numpy()) == 8
    for variable in model.trainable_variables:
        first, second = two_replicas.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy())


@pytest.mark.parametrize("accumulation", [None, 2])
def test_no_merge_call_path_for_tpu_like_strategies(two_replicas, monkeypatch, accumulation):
    """TPUStrategy (and MirroredStrategy on NCCL GPUs) run without merge_call. This
    machine has neither, so MirroredStrategy is switched to its own no-merge-call
    mode for this test: kmp's step must then never call merge_call, and still
    reduce once, skip overflows everywhere and keep the replicas identical."""
    from tensorflow.python.distribute import distribute_lib

    monkeypatch.setattr(two_replicas.extended, "_use_merge_call", lambda: False)
    merges = []
    real_merge_call = distribute_lib.ReplicaContext.merge_call
    monkeypatch.setattr(distribute_lib.ReplicaContext, "merge_call",
                        lambda self, *a, **k: merges.append(1) or real_merge_call(self, *a, **k))
    with two_replicas.scope():
        weight = keras.Variable(np.zeros(2, "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0, global_clipnorm=10.0), initial_scale=4.0,
                                 gradient_accumulation_steps=accumulation, log_overflows=False)
        opt.build([weight])
    with two_replicas.scope():
        assert tf.__internal__.distribute.strategy_supports_no_merge_call()  # the switched mode

    @tf.function
    def step(per_replica):  # a tensor: every step runs one trace (Python lists would each trace anew)
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply([tf.switch_case(rid, [lambda i=i: per_replica[i] for i in range(2)])], [weight])

        two_replicas.run(fn)

    windows = accumulation or 1
    for _ in range(windows):
        step(tf.constant([[4.0, 8.0], [12.0, 0.0]]))  # summed (16, 8), unscaled by 4: (4, 2)
    for _ in range(windows):
        step(tf.constant([[float("inf"), 8.0], [12.0, 0.0]]))  # an inf on replica 0 only
    assert merges == []
    for value in two_replicas.experimental_local_results(weight.value):
        np.testing.assert_array_equal(value.numpy(), [-4.0, -2.0])
    assert int(opt.iterations.numpy()) == 1 and int(opt.skipped_steps.numpy()) == 1
    assert float(opt.dynamic_scale.numpy()) == 2.0
