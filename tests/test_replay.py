"""overflow="replay" (kmp/scaling/replay.py): an overflowing step recomputed on its batch at the lowered scale.

The parity used throughout: a run that replays its first step from a scale too high ends exactly where
a run with "skip" started at the scale the replays reached ends, step for step: the same batches,
each applied once, and `iterations` counting every one. Powers of two scale float16 gradients exactly,
so the weights agree bit for bit.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.config.deepspeed import load_config
from kmp.engine.replica_step import describe_path
from kmp.scaling import replay

STEPS = 3
TOO_HIGH = 2.0**17  # the first step's gradients overflow float16 here; 4 or 5 halvings make them finite


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")


def _data(rows, hot_rows=(), hot=8.0):
    x = np.random.default_rng(0).normal(size=(rows, 4)).astype("float32")
    x[list(hot_rows)] *= hot  # these rows' gradients overflow where the others' do not
    return x, np.full((rows, 1), 10.0, "float32")


def _trained(overflow, initial_scale, flat=False, jit=False, strategy=None, batch=8, steps=STEPS, hot_rows=(),
             hot=8.0, **extra):
    keras.utils.set_random_seed(1)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        optimizer = kmp.wrap(keras.optimizers.SGD(0.01), initial_scale=initial_scale, overflow=overflow,
                             log_overflows=False, **extra)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
    kmp.prepare(model, flat_buffers=flat)
    x, y = _data(batch * steps, hot_rows, hot)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    # The path asked for, not a fallback from it.
    assert describe_path(model).startswith("flat buffers" if flat else "per-variable update"), describe_path(model)
    return model


def _state(model):
    o = model.optimizer
    return {"iterations": int(o.iterations.numpy()), "skipped": int(o.skipped_steps.numpy()),
            "replayed": int(o.replayed_steps.numpy()) if hasattr(o, "replayed_steps") else None,
            "scale": float(o.dynamic_scale.numpy())}


def _same_weights(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))


PATHS = ["per-variable", "flat", "per-variable+xla", "flat+xla", "mirrored per-variable", "mirrored flat"]


@pytest.mark.parametrize("path", PATHS)
def test_a_replayed_step_is_applied_once_as_if_it_had_started_at_the_lowered_scale(two_replicas, path):
    kwargs = dict(flat="flat" in path, jit=path.endswith("xla"), strategy=two_replicas if "mirrored" in path else None)
    replayed = _trained("replay", TOO_HIGH, **kwargs)
    state = _state(replayed)
    assert state["scale"] < TOO_HIGH  # the first step overflowed and was recomputed lower
    assert state == {"iterations": STEPS, "skipped": 0, "replayed": 1, "scale": state["scale"]}
    started_there = _trained("skip", state["scale"], **kwargs)
    assert _state(started_there)["iterations"] == STEPS
    assert _same_weights(replayed, started_there)


def test_skip_loses_the_batch_that_replay_keeps():
    skipped = _state(_trained("skip", TOO_HIGH))
    assert skipped["skipped"] >= 1 and skipped["iterations"] == STEPS - skipped["skipped"]
    assert skipped["replayed"] is None  # "skip" keeps Keras's and DeepSpeed's optimizer variables


@pytest.mark.parametrize("strategy", ["one device", "mirrored"])
@pytest.mark.parametrize("flat", [False, True], ids=["per-variable", "flat"])
def test_accumulation_replays_the_overflowing_micro_batch_only(two_replicas, strategy, flat):
    # Micro-batch 2 of each window of 3 holds hot rows: only it overflows at the first scale.
    strategy = two_replicas if strategy == "mirrored" else None
    kwargs = dict(flat=flat, strategy=strategy, steps=3, hot_rows=range(8, 16), gradient_accumulation_steps=3)
    replayed = _trained("replay", 2.0**10, **kwargs)
    state = _state(replayed)
    assert state["iterations"] == 1 and state["skipped"] == 0 and state["replayed"] == 1
    assert state["scale"] < 2.0**10
    # Micro-batch 1 at the first scale, 2 and 3 at the lowered one: scaled by powers of two, the same sums.
    started_there = _trained("skip", state["scale"], **kwargs)
    assert _state(started_there)["iterations"] == 1
    assert _same_weights(replayed, started_there)


def test_the_retries_are_bounded_and_an_unfixable_step_is_skipped():
    # 2**24 with hot rows: still inf after MAX_REPLAYS halvings; skipped, and the next step goes on lower.
    model = _trained("replay", 2.0**24, steps=1, hot_rows=range(8))
    state = _state(model)
    assert state["replayed"] == 1 and state["skipped"] == 1 and state["iterations"] == 0
    # MAX_REPLAYS halvings in the replays, one more by the skipped step's own backoff.
    assert state["scale"] == 2.0**24 * 0.5 ** (replay.MAX_REPLAYS + 1)


def test_the_floor_ends_the_replays(two_replicas):
    # Rows so hot that the gradients overflow at any scale, while the loss (float32) stays finite.
    model = _trained("replay", 8.0, steps=1, hot_rows=range(8), hot=3000.0, min_scale=2.0, raise_at_min_scale=False,
                     strategy=two_replicas)
    state = _state(model)
    assert state == {"iterations": 0, "skipped": 1, "replayed": 1, "scale": 2.0}


def test_a_forward_overflow_is_not_replayed():
    # A layer whose float16 output is inf makes the loss inf at any scale: skipped at once, as with "skip".
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(100.0))(inputs)
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(100.0))(h)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(h))
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), overflow="replay", forward_overflow="backoff",
                                     log_overflows=False), loss="mse")
    kmp.prepare(model)
    x = np.full((8, 4), 100.0, "float32")
    model.fit(x, np.ones((8, 1), "float32"), batch_size=8, verbose=0)
    state = _state(model)
    assert state == {"iterations": 0, "skipped": 1, "replayed": 0, "scale": 2.0**14}


def test_without_prepare_the_step_cannot_replay_and_says_so(caplog):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), initial_scale=TOO_HIGH, overflow="replay",
                                     log_overflows=False), loss="mse")
    x, y = _data(8, hot_rows=range(8))
    with caplog.at_level("WARNING", logger="kmp.scaling.optimizer"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert "needs the step of kmp.prepare(model)" in caplog.text
    assert _state(model)["skipped"] == 1


def test_the_setting_in_python_in_a_deepspeed_config_and_in_the_saved_config():
    assert kmp.LossScaleConfig().overflow == "skip"
    # DeepSpeed skips an overflowing step; its configs keep that unless the kmp block says otherwise.
    assert load_config({"fp16": {"enabled": True}}).loss_scale.overflow == "skip"
    assert load_config({"fp16": {"enabled": True}, "kmp": {"overflow": "replay"}}).loss_scale.overflow == "replay"
    with pytest.raises(kmp.ConfigError, match=r"kmp\.overflow.*'skip', 'replay'"):
        load_config({"fp16": {"enabled": True}, "kmp": {"overflow": "retry"}})
    with pytest.raises(kmp.ConfigError, match="overflow"):
        kmp.wrap(keras.optimizers.SGD(), overflow="again")
    optimizer = kmp.wrap(keras.optimizers.SGD(), overflow="replay")
    again = kmp.LossScaleOptimizer.from_config(optimizer.get_config())
    assert again.loss_scale_config.overflow == "replay" and again.replays
    assert not kmp.wrap(keras.optimizers.SGD(), static_scale=4.0, overflow="replay").replays  # nothing to lower
