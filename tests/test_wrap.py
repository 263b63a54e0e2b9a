"""kmp.wrap: the optimizer right for the precision, configured."""

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.scaling.optimizer import LossScaleOptimizer


def test_float16_policy_gets_a_loss_scale_optimizer_with_python_defaults():
    keras.config.set_dtype_policy("mixed_float16")
    inner = keras.optimizers.AdamW(1e-3)
    opt = kmp.wrap(inner)
    assert type(opt) is LossScaleOptimizer
    assert opt.inner_optimizer is inner
    assert opt.loss_scale_config == kmp.LossScaleConfig()


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_no_loss_scaling_without_float16_compute(policy):
    keras.config.set_dtype_policy(policy)
    inner = keras.optimizers.SGD()
    assert kmp.wrap(inner) is inner


def test_bfloat16_weights_get_kmps_optimizer_at_a_static_scale_of_1():
    """kmp.prepare's flat buffers train them from float32 masters, with kmp's optimizer (docs/precision.md)."""
    keras.config.set_dtype_policy("bfloat16")
    inner = keras.optimizers.SGD()
    wrapped = kmp.wrap(inner)
    assert type(wrapped) is LossScaleOptimizer and wrapped.inner_optimizer is inner
    assert wrapped.loss_scale_config.static_scale == 1


def test_precision_argument_wins_and_leaves_the_global_policy_alone():
    keras.config.set_dtype_policy("float32")
    assert isinstance(kmp.wrap(keras.optimizers.SGD(), precision="16-mixed"), LossScaleOptimizer)
    assert keras.config.dtype_policy().name == "float32"
    keras.config.set_dtype_policy("mixed_float16")
    plain = keras.optimizers.SGD()
    assert kmp.wrap(plain, precision="bf16-mixed") is plain


def test_optimizer_by_name():
    opt = kmp.wrap("adamw", precision="mixed_float16")
    assert isinstance(opt.inner_optimizer, keras.optimizers.AdamW)
    with pytest.raises(kmp.ConfigError, match="Received: optimizer='adamz'"):
        kmp.wrap("adamz")
    with pytest.raises(kmp.ConfigError, match="already a LossScaleOptimizer"):
        kmp.wrap(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


def test_deepspeed_config_from_file_sets_deepspeed_defaults_and_clipping(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "hysteresis": 4}, "gradient_clipping": 1.0}))
    opt = kmp.wrap(keras.optimizers.Adam(), str(path))
    config = opt.loss_scale_config
    assert (config.initial_scale, config.dynamic_growth_steps, config.hysteresis) == (2.0**16, 1000, 4)
    assert config.growth_rule == "after_window"
    # kmp's optimizer clips (after the all-reduce); the user's Adam is untouched.
    assert opt.gradient_clipping == 1.0 and opt.inner_optimizer.global_clipnorm is None


def test_config_enables_fp16_but_the_policy_is_float32_warns():
    keras.config.set_dtype_policy("float32")
    with pytest.warns(UserWarning, match=r"kmp.set_precision\('mixed_float16'\)"):
        opt = kmp.wrap(keras.optimizers.SGD(), {"fp16": {"enabled": True}})
    assert isinstance(opt, LossScaleOptimizer)


@pytest.mark.parametrize("precision, policy", [("mixed_float16", "float32"), ("16-mixed", "mixed_bfloat16"),
                                               ("float32", "mixed_float16")])
def test_a_precision_argument_the_policy_does_not_compute_in_warns_as_a_configs_does(precision, policy):
    keras.config.set_dtype_policy(policy)
    chosen = kmp.resolve_precision(precision)
    with pytest.warns(UserWarning) as record:
        kmp.wrap(keras.optimizers.SGD(), precision=precision)
    assert [str(r.message) for r in record] == [
        f"kmp.wrap was given precision {chosen} but the global Keras policy computes in "
        f"{policy.removeprefix('mixed_')}, so layers built now will not use {chosen.compute_dtype}. Set the policy "
        f"before building the model: kmp.set_precision('{chosen}')."]
    keras.config.set_dtype_policy(chosen.name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmp.wrap(keras.optimizers.SGD(), precision=precision)  # they agree: nothing to say


def test_config_without_precision_follows_the_policy():
    keras.config.set_dtype_policy("mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = kmp.wrap(keras.optimizers.SGD(), {"gradient_clipping": 0.5})
    assert isinstance(opt, LossScaleOptimizer) and opt.gradient_clipping == 0.5


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_clipping_without_loss_scaling_gets_kmps_optimizer_and_the_original_is_untouched(policy):
    keras.config.set_dtype_policy(policy)
    inner = keras.optimizers.SGD(0.25, momentum=0.5)
    before = inner.get_config()
    opt = kmp.wrap(inner, {"gradient_clipping": 2.0})
    assert type(opt) is LossScaleOptimizer and opt.inner_optimizer is inner
    assert opt.gradient_clipping == 2.0 and opt.loss_scale_config.static_scale == 1.0
    assert inner.get_config() == before
    # Clipping the optimizer already does is not added twice: it is used as it is.
    same = keras.optimizers.SGD(global_clipnorm=2.0)
    assert kmp.wrap(same, {"gradient_clipping": 2.0}) is same


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_clipping_on_one_device_skips_a_non_finite_step(policy):
    """Keras's global_clipnorm turns an inf gradient into NaN in every weight; kmp's optimizer skips the step."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1), gradient_clipping=1.0, log_overflows=False),
                  loss="mse")
    x = np.ones((8, 4), "float32")
    model.fit(x, np.ones((8, 1), "float32"), batch_size=8, verbose=0)
    before = model.get_weights()
    model.fit(x, np.full((8, 1), np.inf, "float32"), batch_size=8, verbose=0)  # the loss is inf
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.skipped_steps.numpy()) == 1 and int(model.optimizer.iterations.numpy()) == 1


def test_clipping_asked_outside_the_scope_clips_the_all_reduced_gradient(two_replicas):
    """Wrapped outside strategy.scope(), compiled inside: as one device, not each replica's own clip."""
    keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32") * 10

    def train(strategy):
        opt = kmp.wrap(keras.optimizers.SGD(0.1), gradient_clipping=0.1)  # outside any scope
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    for a, b in zip(train(two_replicas), train(tf.distribute.get_strategy()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)


@pytest.mark.parametrize("prepared", [None, False, True])
def test_an_optimizer_made_outside_the_scope_trains_as_one_made_inside(two_replicas, prepared, caplog, tmp_path):
    """Keras makes an optimizer's step counter and learning rate where the optimizer is made. Made outside the
    scope, on one device: each replica counted every step (a schedule ran twice as fast), Adam's build raised
    ("Mixing different tf.distribute.Strategy objects"), kmp.prepare's flat buffers failed their first step (its
    batch lost) and train_on_batch's retry crashed. kmp's build makes them again in the scope, and says so."""
    keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32") * 10

    def train(outside):
        def make():
            schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
            return kmp.wrap(keras.optimizers.Adam(schedule), gradient_clipping=1.0)

        opt = make() if outside else None
        with two_replicas.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh", name="a"),
                                      keras.layers.Dense(1, name="b")], name="net")
            model.compile(optimizer=opt if outside else make(), loss="mse")
        if prepared is not None:
            kmp.prepare(model, flat_buffers=prepared)
        model.train_on_batch(x[:16], y[:16])  # the first call: nothing to retry it with, were it to fail
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    with caplog.at_level("WARNING"):
        outside = train(True)
    assert caplog.text.count("made outside the strategy's scope") == 1, caplog.text
    assert "falling back" not in caplog.text
    caplog.clear()
    inside = train(False)
    assert "made outside the strategy's scope" not in caplog.text
    assert int(outside.optimizer.iterations.numpy()) == 5 == int(inside.optimizer.iterations.numpy())
    assert [v.name for v in outside.optimizer.variables] == [v.name for v in inside.optimizer.variables]
    # Mirrored, as made in the scope; but on the flat buffers, on these replicas of one process, Keras's copy of
    # the slots is held once in host memory (kmp.engine.zero).
    inner = outside.optimizer.inner_optimizer
    on_host = {id(v) for v in inner._momentums + inner._velocities} if prepared else set()
    assert all(isinstance(v.value, tf.distribute.DistributedValues) == (id(v) not in on_host)
               for v in outside.optimizer.variables)
    for a, b in zip(outside.get_weights(), inside.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # Its state saves and restores as any optimizer's: TensorFlow's checkpoint, and Keras's file.
    saved = tf.train.Checkpoint(optimizer=outside.optimizer).save(str(tmp_path / "ckpt"))
    outside.optimizer.iterations.assign(0)
    tf.train.Checkpoint(optimizer=outside.optimizer).restore(saved)
    assert int(outside.optimizer.iterations.numpy()) == 5
    outside.save(tmp_path / "model.keras")
    with two_replicas.scope():
        loaded = keras.models.load_model(tmp_path / "model.keras")
    for a, b in zip(outside.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_wrap_leaves_the_users_optimizer_as_it_was(two_replicas, policy):
    """After wrapping and training, the optimizer has no kmp attribute, and used
    alone under MirroredStrategy it still all-reduces its gradients."""
    import tensorflow as tf

    keras.config.set_dtype_policy(policy)
    with two_replicas.scope():
        inner = keras.optimizers.SGD(1.0)
        config = inner.get_config()
        wrapped = kmp.wrap(inner, {"gradient_clipping": 10.0}, log_overflows=False)
        weight = keras.Variable(np.zeros(1, "float32"))
        wrapped.build([weight])  # builds inner too: its own slots, as Keras's wrapper does
    assert wrapped.inner_optimizer is inner and inner.get_config() == config
    attributes = set(vars(inner))

    def run(opt, var, scale=1.0):
        @tf.function
        def step():
            def fn():
                rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
                opt.apply([tf.reshape((rid + 1.0) * scale, (1,))], [var])  # local grads 1 and 2
            two_replicas.run(fn)
        step()
        return [v.numpy() for v in two_replicas.experimental_local_results(var.value)]

    scale = float(wrapped.dynamic_scale.numpy())
    assert [list(v) for v in run(wrapped, weight, scale)] == [[-3.0], [-3.0]]
    assert "_all_reduce_sum_gradients" not in vars(inner)
    assert set(vars(inner)) == attributes and inner.get_config() == config
    # Alone, its update sums the local gradients across replicas: 1 + 2 more.
    assert [list(v) for v in run(inner, weight)] == [[-6.0], [-6.0]]


def test_overrides_and_their_errors():
    opt = kmp.wrap(keras.optimizers.SGD(), precision="mixed_float16", hysteresis=3, min_scale=2.0,
                   log_overflows=False)
    assert opt.loss_scale_config.hysteresis == 3 and opt.log_overflows is False
    with pytest.raises(kmp.ConfigError) as info:
        kmp.wrap(keras.optimizers.SGD(), precision="mixed_float16", hysterisis=3, min_scale=-1)
    text = str(info.value)
    assert "Did you mean 'hysteresis'?" in text


def test_communication_and_fused_reach_the_optimizer():
    config = {"fp16": {"enabled": True}, "communication_data_type": "bf16", "kmp": {"allreduce_bytes_per_pack": 4096}}
    opt = kmp.wrap(keras.optimizers.SGD(), config, precision="mixed_float16")
    assert opt.communication == kmp.Communication("bfloat16", 4096, None)
    assert opt.fused is True
    mine = kmp.Communication(dtype="float16")
    opt = kmp.wrap(keras.optimizers.SGD(), config, precision="mixed_float16", communication=mine, fused=False)
    assert opt.communication == mine and opt.fused is False  # arguments win over the config


def test_clipping_in_two_places_is_an_error():
    with pytest.raises(kmp.ConfigError, match=r"optimizer already clips \(clipnorm=1.0\)"):
        kmp.wrap(keras.optimizers.SGD(clipnorm=1.0), {"gradient_clipping": 0.5})


@pytest.mark.parametrize("policy, static", [("mixed_float16", None), ("float32", 1.0)])
def test_accumulation_from_deepspeed_batch_sizes(policy, static):
    keras.config.set_dtype_policy(policy)
    opt = kmp.wrap(keras.optimizers.SGD(), {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16})
    assert isinstance(opt, LossScaleOptimizer)
    assert opt.get_config()["gradient_accumulation_steps"] == 4
    assert opt.loss_scale_config.static_scale == static


def test_accumulation_batch_sizes_are_checked_with_the_replica_count(two_replicas):
    with two_replicas.scope():
        opt = kmp.wrap(keras.optimizers.SGD(), {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8},
                       precision="float32")
        assert opt.get_config()["gradient_accumulation_steps"] == 4  # 64 = 8 x 4 x 2 replicas
        with pytest.raises(kmp.ConfigError, match="train_batch_size is not equal to"):
            kmp.wrap(keras.optimizers.SGD(), {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                              "gradient_accumulation_steps": 8})


def test_no_accumulation_machinery_when_one_micro_batch():
    keras.config.set_dtype_policy("float32")
    inner = keras.optimizers.SGD()
    assert kmp.wrap(inner, {"train_batch_size": 32}) is inner
    # Spelled out as 1 (11 of the corpus's loaded files do) is no accumulation
    # either: no extra float32 copy of every parameter.
    assert kmp.wrap(inner, {"train_batch_size": 32, "gradient_accumulation_steps": 1}) is inner
    # Asked for by keyword, at any value, the machinery is on (GradientAccumulationScheduler needs it).
    assert kmp.wrap(keras.optimizers.SGD(), gradient_accumulation_steps=1).accumulation.initial_steps == 1
    keras.config.set_dtype_policy("mixed_float16")
    assert kmp.wrap(keras.optimizers.SGD(), {"gradient_accumulation_steps": 1}).accumulation is None


def test_compiled_model_trains_with_wrap_in_fit():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(1)(hidden)))
    model.compile(optimizer=kmp.wrap("adam", {"fp16": {"enabled": True, "initial_scale_power": 8}}), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    history = model.fit(x, x[:, :1], batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.optimizer.iterations.numpy() == 12


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_clipping_sees_the_all_reduced_gradient(two_replicas, policy):
    """Local gradients 5 and 1, global_clipnorm 1: the weight moves by 1, not 2.

    Keras 3.15 clips each replica's local gradient before the all-reduce
    (each becomes 1, summed to 2).
    """
    import tensorflow as tf

    keras.config.set_dtype_policy(policy)
    with two_replicas.scope():
        weight = keras.Variable(np.zeros(1, "float32"))
        opt = kmp.wrap(keras.optimizers.SGD(1.0), {"gradient_clipping": 1.0}, log_overflows=False)
        opt.build([weight])
    assert isinstance(opt, LossScaleOptimizer)
    scale = float(opt.dynamic_scale.numpy())

    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            local = tf.where(rid == 0, 5.0, 1.0) * scale
            opt.apply([tf.reshape(local, (1,))], [weight])

        two_replicas.run(fn)

    step()
    for value in two_replicas.experimental_local_results(weight.value):
        np.testing.assert_allclose(value.numpy(), [-1.0], rtol=1e-6)
