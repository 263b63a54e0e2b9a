"""Interrupted and resumed, a run ends bit-identical to an uninterrupted one.

A run of 8 steps (mixed float16, dynamic loss scaling, an inf batch at step
2, so an overflow falls inside the interrupted span) is cut after step 5,
saved, restored into a new model, and finished. Weights and the whole
loss-scale state must equal the uninterrupted run's exactly: on one device
and under MirroredStrategy, with and without an accumulation window left open
at the cut, through `.keras`, `.weights.h5` (what Keras's BackupAndRestore and
ModelCheckpoint write) and `tf.train.Checkpoint`.

The cases are pairwise, not the full product: each format meets each
placement and each accumulation setting once, and each placement meets each
accumulation setting. The uninterrupted and the cut runs depend only on
placement and accumulation, so each is trained once per module.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

BATCH, STEPS, CUT = 8, 8, 5
RNG = np.random.default_rng(0)
X = RNG.normal(size=(BATCH * STEPS, 6)).astype("float32")
Y = (X @ np.linspace(-1, 1, 6).astype("float32"))[:, None]
X[2 * BATCH:3 * BATCH] = np.inf  # step 2 overflows
STATE = ("dynamic_scale", "hysteresis_left", "good_steps", "skipped_steps", "iterations")
# One xdist worker runs them all, so the module-scoped runs are trained once in the suite too.
pytestmark = pytest.mark.xdist_group("resume")


def _model(strategy, accumulation):
    keras.config.set_dtype_policy("mixed_float16")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(16, activation="tanh")(inputs)
        model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(1)(hidden)))
        extra = {"gradient_accumulation_steps": accumulation} if accumulation else {}
        optimizer = kmp.wrap(keras.optimizers.Adam(0.01), initial_scale=2.0**10, dynamic_growth_steps=2,
                             hysteresis=2, log_overflows=False, **extra)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, start, stop):
    model.fit(X[start * BATCH:stop * BATCH], Y[start * BATCH:stop * BATCH], batch_size=BATCH, shuffle=False, verbose=0)


def _state(model):
    return [model.get_weights(), [getattr(model.optimizer, name).numpy() for name in STATE]]


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_array_equal(x, y)


def _save_and_restore(method, model, strategy, accumulation, tmp_path):
    if method == "keras":
        path = str(tmp_path / "run.keras")
        model.save(path)
        with strategy.scope():
            return keras.models.load_model(path)
    fresh = _model(strategy, accumulation)
    with strategy.scope():
        fresh.optimizer.build(fresh.trainable_variables)
        if method == "weights":
            path = str(tmp_path / "run.weights.h5")
            model.save_weights(path)
            fresh.load_weights(path)
        else:
            prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
            tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(prefix).assert_existing_objects_matched()
    return fresh


@pytest.fixture(scope="module")
def runs(two_replicas):
    """(distributed, accumulation) -> (the uninterrupted run's state, the run cut after step CUT).

    Saving does not change the cut model, so the cases that restore it in other formats share it.
    """
    cache = {}

    def get(distributed, accumulation):
        if (distributed, accumulation) not in cache:
            strategy = two_replicas if distributed else tf.distribute.get_strategy()
            whole = _model(strategy, accumulation)
            _fit(whole, 0, STEPS)
            cut = _model(strategy, accumulation)
            _fit(cut, 0, CUT)
            cache[distributed, accumulation] = _state(whole), cut
        return cache[distributed, accumulation]

    return get


@pytest.mark.parametrize("method, accumulation, distributed", [
    ("keras", None, False), ("keras", 3, True),
    ("weights", None, True), ("weights", 3, False),
    ("checkpoint", None, False), ("checkpoint", 3, True),
])
def test_resumed_run_is_bit_identical(two_replicas, runs, tmp_path, method, accumulation, distributed):
    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    whole, cut = runs(distributed, accumulation)
    assert int(cut.optimizer.skipped_steps.numpy()) == 1  # the overflow is inside the saved span
    if accumulation:
        assert int(cut.optimizer.accumulation.micro_steps.numpy()) == CUT % accumulation  # a window is open
    resumed = _save_and_restore(method, cut, strategy, accumulation, tmp_path)
    _fit(resumed, CUT, STEPS)
    _assert_same(_state(resumed), whole)
    assert all(np.isfinite(w).all() for w in resumed.get_weights())
