"""Gradient accumulation in kmp.LossScaleOptimizer.

N micro-batches of size b end where one batch of N*b ends; one all-reduce
and one loss-scale decision per window; everything that ticks per optimizer
step (iterations, schedule, weight decay, EMA) ticks once per window.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.distribute import communication as kmp_communication
from kmp.callbacks import GradientAccumulationScheduler
from kmp.scaling.optimizer import LossScaleOptimizer

INF = np.float32(np.inf)
X = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
Y = (X @ np.linspace(-1, 1, 6).astype("float32"))[:, None]


def _train(strategy, policy, make_inner, batch, steps, epochs=2, **kwargs):
    keras.config.set_dtype_policy(policy)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(1)(hidden)))
        opt = LossScaleOptimizer(make_inner(), gradient_accumulation_steps=steps, log_overflows=False, **kwargs)
        model.compile(optimizer=opt, loss="mse")
    model.fit(X, Y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False)
    return model, opt


# Pairwise: each placement meets each precision and each inner optimizer, and each precision each optimizer.
@pytest.mark.parametrize("distributed, policy, atol, inner", [
    (False, "float32", 1e-6, "sgd"), (False, "mixed_float16", 2e-3, "adam"),
    (True, "float32", 1e-6, "adam"), (True, "mixed_float16", 2e-3, "sgd"),
])
def test_micro_batches_equal_one_big_batch(two_replicas, distributed, policy, atol, inner):
    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    make = lambda: keras.optimizers.get({"class_name": inner, "config": {"learning_rate": 0.05}})
    scale = dict(static_scale=1.0) if policy == "float32" else dict(initial_scale=2.0**8)
    small, small_opt = _train(strategy, policy, make, batch=8, steps=4, **scale)
    big, big_opt = _train(tf.distribute.get_strategy(), policy, make, batch=32, steps=None, **scale)
    assert int(small_opt.iterations.numpy()) == int(big_opt.iterations.numpy()) == 6
    for a, b in zip(small.get_weights(), big.get_weights()):
        np.testing.assert_allclose(a, b, atol=atol)


def test_an_overflow_in_any_micro_batch_skips_the_window_and_clears_it():
    v = [keras.Variable(np.ones(2, "float32"))]
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0, gradient_accumulation_steps=3,
                             log_overflows=False)
    for g in ([4.0, 4.0], [INF, 4.0], [4.0, 4.0]):
        opt.apply([tf.constant(g)], v)
    np.testing.assert_array_equal(v[0].numpy(), [1.0, 1.0])
    assert int(opt.iterations.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 1
    assert float(opt.dynamic_scale.numpy()) == 2.0  # one decision for the window
    np.testing.assert_array_equal(opt.accumulation.sums[0].numpy(), [0.0, 0.0])
    for g in ([2.0, 2.0], [4.0, 4.0], [6.0, 6.0]):  # scaled by 2: unscaled mean is 2
        opt.apply([tf.constant(g)], v)
    np.testing.assert_array_equal(v[0].numpy(), [-1.0, -1.0])
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("clip", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}, {"clipvalue": 1.0}])
def test_clipping_applies_once_to_the_window_mean(clip, fused):
    """Micro-gradients 3 and -1: their mean 1 is not clipped, so the weight moves by 1.
    Clipping each micro-batch (to 1 and -1) would average to 0 and not move it."""
    v = [keras.Variable(np.zeros(1, "float32"))]
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0, **clip), static_scale=1.0, gradient_accumulation_steps=2,
                             fused=fused)
    opt.apply([tf.constant([3.0])], v)
    np.testing.assert_array_equal(v[0].numpy(), [0.0])  # nothing moves inside the window
    opt.apply([tf.constant([-1.0])], v)
    np.testing.assert_allclose(v[0].numpy(), [-1.0])
    # And a window whose mean is above the norm is clipped once: mean 5 -> 1.
    opt.apply([tf.constant([6.0])], v)
    opt.apply([tf.constant([4.0])], v)
    np.testing.assert_allclose(v[0].numpy(), [-2.0])


def test_schedule_weight_decay_and_ema_tick_once_per_window():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.01])

    def run(steps, grads):
        inner = keras.optimizers.AdamW(schedule, weight_decay=0.1, use_ema=True, ema_momentum=0.5)
        v = [keras.Variable(np.ones(3, "float32"))]
        opt = LossScaleOptimizer(inner, static_scale=1.0, gradient_accumulation_steps=steps)
        for g in grads:
            opt.apply([tf.constant(g)], v)
        return v[0].numpy(), inner._model_variables_moving_average[0].numpy(), int(opt.iterations.numpy())

    micro = [np.full(3, x, "float32") for x in (1.0, 3.0, -2.0, 6.0)]
    accumulated = run(2, micro)
    big = run(None, [(micro[0] + micro[1]) / 2, (micro[2] + micro[3]) / 2])
    assert accumulated[2] == big[2] == 2
    np.testing.assert_allclose(accumulated[0], big[0], rtol=1e-6)
    np.testing.assert_allclose(accumulated[1], big[1], rtol=1e-6)


def test_one_all_reduce_per_window_under_mirrored(two_replicas, monkeypatch):
    with two_replicas.scope():
        calls = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.NONE, trainable=False)
    original = kmp_communication.all_reduce_sum

    def counting(grads, *args, **kwargs):
        calls.assign_add(1)  # replica context: each replica counts its own calls
        return original(grads, *args, **kwargs)

    monkeypatch.setattr(kmp_communication, "all_reduce_sum", counting)
    _, opt = _train(two_replicas, "float32", lambda: keras.optimizers.SGD(0.01), batch=8, steps=4,
                    static_scale=1.0)
    micro_steps = 2 * len(X) // 8
    assert [int(c.numpy()) for c in two_replicas.experimental_local_results(calls)] == [micro_steps // 4] * 2
    assert int(opt.iterations.numpy()) == micro_steps // 4


def test_token_weighted_mean_across_micro_batches():
    """Micro-batches of 1 and 3 tokens: the step uses sum(grads) / 4 tokens."""
    v = [keras.Variable(np.zeros(1, "float32"))]
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), static_scale=1.0, gradient_accumulation_steps=2)
    # Sum-reduced losses: per-token gradients 8 (one token) and 2, 2, 2 (three).
    opt.apply([tf.constant([8.0])], v, micro_batch_weight=1)
    opt.apply([tf.constant([6.0])], v, micro_batch_weight=3)
    np.testing.assert_allclose(v[0].numpy(), [-(8.0 + 6.0) / 4])


def test_scheduler_changes_the_window_by_epoch():
    sched = GradientAccumulationScheduler({0: 1, 1: 3}, batch_size=8)
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    opt = kmp.wrap(keras.optimizers.SGD(0.01), gradient_accumulation_steps=1)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[sched])
    assert int(opt.iterations.numpy()) == 12 + 4
    assert history.history["accumulation_steps"] == [1, 3]
    assert history.history["effective_batch_size"] == [8, 24]


def test_scheduler_rejects_bad_schedules_and_optimizers():
    with pytest.raises(kmp.ConfigError) as info:
        GradientAccumulationScheduler({-1: 2, 3: 0})
    assert len(info.value.problems) == 2
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(kmp.ConfigError, match="gradient_accumulation_steps=1"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[GradientAccumulationScheduler({0: 2})])


def test_inner_optimizer_must_not_accumulate_itself():
    with pytest.raises(kmp.ConfigError, match="inner_optimizer.gradient_accumulation_steps"):
        LossScaleOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))


def test_accumulators_round_trip_in_checkpoints(tmp_path):
    v = [keras.Variable(np.ones(2, "float32"))]
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), static_scale=1.0, gradient_accumulation_steps=3)
    opt.apply([tf.constant([1.0, 2.0])], v)
    prefix = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    opt.apply([tf.constant([5.0, 5.0])], v)
    tf.train.Checkpoint(optimizer=opt).restore(prefix)
    np.testing.assert_array_equal(opt.accumulation.sums[0].numpy(), [1.0, 2.0])
    assert int(opt.accumulation.micro_steps.numpy()) == 1
    assert LossScaleOptimizer.from_config(opt.get_config()).get_config()["gradient_accumulation_steps"] == 3


def test_keras_own_accumulation_still_fails_under_mirrored(two_replicas):
    """keras-team/keras#20582: if this starts passing, Keras fixed it."""
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)


def _accumulating_model(strategy):
    keras.config.set_dtype_policy("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(0.01), gradient_accumulation_steps=3), loss="mse")
    return model


@pytest.fixture(scope="module")
def two_replica_cut(two_replicas):
    """An accumulating model on two replicas cut after 2 micro-batches of 8: its window is open.

    Saving does not change it, so the tests that save and restore it share it; none may train or change it.
    """
    cut = _accumulating_model(two_replicas)
    cut.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    return cut


@pytest.fixture(scope="module")
def uncut_on_two_replicas(two_replicas):
    """The run the cut one resumes to: the same 2 micro-batches, then 4 more in a second fit()."""
    whole = _accumulating_model(two_replicas)
    whole.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    whole.fit(X[16:48], Y[16:48], batch_size=8, shuffle=False, verbose=0)
    return whole.get_weights(), int(whole.optimizer.iterations.numpy())


# The tests that share the module's cut models run on one xdist worker, so each model is trained once.
SHARES_THE_CUTS = pytest.mark.xdist_group("accumulate_cuts")


@SHARES_THE_CUTS
@pytest.mark.parametrize("save", ["weights", "keras"])
def test_resume_mid_window_under_mirrored_is_exact(two_replicas, two_replica_cut, uncut_on_two_replicas, tmp_path,
                                                   save):
    """Issue 10 #2: each replica's partial sums come back to that replica (Keras saves replica 0's)."""
    rest = X[16:48], Y[16:48]
    whole_weights, whole_iterations = uncut_on_two_replicas
    cut = two_replica_cut
    sums = cut.optimizer.accumulation.sums[0].value.values
    assert int(cut.optimizer.accumulation.micro_steps.numpy()) == 2
    assert not np.array_equal(sums[0].numpy(), sums[1].numpy())  # the replicas saw different halves
    path = str(tmp_path / ("model.weights.h5" if save == "weights" else "model.keras"))
    cut.save_weights(path) if save == "weights" else cut.save(path)

    resumed = _accumulating_model(two_replicas)
    with two_replicas.scope():
        if save == "weights":
            resumed.optimizer.build(resumed.trainable_variables)
            resumed.load_weights(path)
        else:
            resumed = keras.models.load_model(path)
    for ours, theirs in zip(resumed.optimizer.accumulation.sums[0].value.values, sums):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    resumed.fit(*rest, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(whole_weights, resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations.numpy()) == whole_iterations == 2


def _save(model, method, path):
    if method == "weights":
        model.save_weights(str(path / "m.weights.h5"))
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(path / "ckpt"))


def _load(model, strategy, method, path):
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
        if method == "weights":
            model.load_weights(str(path / "m.weights.h5"))
        else:
            prefix = tf.train.latest_checkpoint(str(path))
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(prefix).assert_existing_objects_matched()


def _replica_sums(model):
    """Each local replica's accumulation sums (one row on one device)."""
    value = model.optimizer.accumulation.sums[0].value
    return [c.numpy() for c in (value.values if isinstance(value, tf.distribute.DistributedValues) else [value])]


@pytest.mark.parametrize("distributed", [False, True])
def test_load_weights_into_a_fresh_model_restores_the_optimizer_and_trains_on_alike(two_replicas, tmp_path,
                                                                                   distributed):
    """A fresh model's optimizer is not built yet; Keras would skip its state (ModelCheckpoint files too)."""
    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    x = X[:24].copy()
    x[0, 0] = INF  # the first window overflows: the loss-scale state moves

    def make():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
            model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(0.01), precision="mixed_float16",
                                             gradient_accumulation_steps=2, log_overflows=False), loss="mse")
        return model

    saved = make()
    saved.fit(x, Y[:24], batch_size=8, shuffle=False, verbose=0)  # a skipped window, then an open one
    assert int(saved.optimizer.skipped_steps.numpy()) == 1 and int(saved.optimizer.accumulation.micro_steps.numpy()) == 1
    path = str(tmp_path / "w.weights.h5")
    saved.save_weights(path)
    loaded = make()
    assert not loaded.optimizer.built
    loaded.load_weights(path)
    for ours, theirs in zip(loaded.optimizer.variables, saved.optimizer.variables, strict=True):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=ours.path)
    np.testing.assert_array_equal(_replica_sums(loaded), _replica_sums(saved))
    for model in (saved, loaded):  # closes the open window: one update
        model.fit(X[24:32], Y[24:32], batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(saved.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.iterations.numpy()) == int(saved.optimizer.iterations.numpy()) == 1  # one skipped


@SHARES_THE_CUTS
@pytest.mark.parametrize("method", ["weights", "checkpoint"])
def test_per_replica_sums_saved_on_two_replicas_load_on_one_as_their_total(two_replica_cut, tmp_path, method):
    first, second = _replica_sums(two_replica_cut)
    _save(two_replica_cut, method, tmp_path)
    one = _accumulating_model(tf.distribute.get_strategy())
    _load(one, tf.distribute.get_strategy(), method, tmp_path)
    assert int(one.optimizer.accumulation.micro_steps.numpy()) == 2
    np.testing.assert_array_equal(_replica_sums(one), [first + second])  # float32, summed as saved


@pytest.fixture(scope="module")
def one_device_cut():
    """The same cut on one device, shared the same way."""
    cut = _accumulating_model(tf.distribute.get_strategy())
    cut.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    return cut


@SHARES_THE_CUTS
@pytest.mark.parametrize("method", ["weights", "checkpoint"])
def test_sums_saved_on_one_device_load_on_two_replicas_into_the_first(two_replicas, one_device_cut, tmp_path, method):
    cut = one_device_cut
    (total,) = _replica_sums(cut)
    assert np.abs(total).max() > 0
    _save(cut, method, tmp_path)
    two = _accumulating_model(two_replicas)
    _load(two, two_replicas, method, tmp_path)
    np.testing.assert_array_equal(_replica_sums(two), [total, np.zeros_like(total)])


@SHARES_THE_CUTS
def test_checkpoint_restored_before_the_optimizer_is_built_gives_each_replica_its_sums(two_replicas, two_replica_cut,
                                                                                      tmp_path):
    """A deferred restore: the variables are restored as build() creates them,
    the per-replica rows when build() tracks them, last."""
    cut = two_replica_cut
    prefix = tf.train.Checkpoint(model=cut, optimizer=cut.optimizer).save(str(tmp_path / "ckpt"))
    resumed = _accumulating_model(two_replicas)
    assert not resumed.optimizer.built
    status = tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(prefix)
    with two_replicas.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    status.assert_existing_objects_matched()
    for ours, theirs in zip(_replica_sums(resumed), _replica_sums(cut), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_checkpoint_without_per_replica_rows_restores_as_before(two_replicas, tmp_path):
    """A checkpoint written before `per_replica_window` existed (simulated by
    untracking it: the rest of the layout is unchanged) restores replica 0's
    sums into every replica, as it did, and matches every object."""
    cut = _accumulating_model(two_replicas)
    cut.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    new = tf.train.Checkpoint(model=cut, optimizer=cut.optimizer).save(str(tmp_path / "new" / "ckpt"))
    del cut.optimizer.per_replica_window
    old = tf.train.Checkpoint(model=cut, optimizer=cut.optimizer).save(str(tmp_path / "old" / "ckpt"))
    new_keys, old_keys = ({k for k, _ in tf.train.list_variables(p)} for p in (new, old))
    assert new_keys - old_keys == {f"optimizer/per_replica_window/.PER_REPLICA/{i}" for i in range(5)}
    assert old_keys <= new_keys
    resumed = _accumulating_model(two_replicas)
    with two_replicas.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(old).assert_existing_objects_matched()
    first = _replica_sums(cut)[0]
    np.testing.assert_array_equal(_replica_sums(resumed), [first, first])
