"""kmp.engine.wall_clock: DeepSpeed's wall_clock_breakdown for fit(), on one device and under MirroredStrategy."""

import math
import re
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import wall_clock

PART_KEYS = [f"wall_clock/{p}_ms" for p in wall_clock.PARTS]
LINE = re.compile(r"^kmp: steps (\d+)-(\d+) time \(ms\)((?: \| \w+: (?:n/a|-?\d+\.\d\d))+)$")


def _data(rows=64, features=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype("float32")
    return x, (x @ rng.normal(size=(features, 1))).astype("float32")


def _model(strategy=None, width=32, depth=1, optimizer=None, **compile_args):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        h = inputs
        for _ in range(depth):
            h = keras.layers.Dense(width, activation="tanh")(h)
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(h))
        model.compile(optimizer=optimizer or kmp.wrap(keras.optimizers.Adam(1e-3)), loss="mse", **compile_args)
    return model


def _lines(text):
    out = []
    for line in text.splitlines():
        if line.startswith("kmp: steps"):
            match = LINE.match(line)
            assert match, line
            cells = dict(c.split(": ") for c in match.group(3).strip(" |").split(" | "))
            out.append((int(match.group(1)), int(match.group(2)),
                        {k: math.nan if v == "n/a" else float(v) for k, v in cells.items()}))
    return out


def _check_sums(parts: dict):
    """The parts (n/a left out) add up to the total; none is negative beyond timer noise."""
    known = [v for k, v in parts.items() if k != "total" and not math.isnan(v)]
    assert sum(known) == pytest.approx(parts["total"], abs=0.05)
    assert all(v >= -0.05 for k, v in parts.items() if k != "other" and not math.isnan(v)), parts


def test_a_line_every_n_steps_as_deepspeed_prints_its_timers_and_the_means_in_the_logs(capsys):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = kmp.prepare(_model(), wall_clock_breakdown=3)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 8 steps
    lines = _lines(capsys.readouterr().out)
    assert [(a, b) for a, b, _ in lines] == [(1, 3), (4, 6)]  # steps 7-8 are the next window's
    for _, _, parts in lines:
        assert list(parts) == list(wall_clock.PARTS)
        _check_sums(parts)
        # kmp's optimizer and the flat engine: every part is separated.
        assert not any(math.isnan(v) for v in parts.values()), parts
    # The logs hold the latest window's means (steps 4-6), as printed to 2 decimals.
    logged = {k: history.history[k][-1] for k in PART_KEYS}
    assert [round(v, 2) for v in logged.values()] == pytest.approx(list(lines[-1][2].values()), abs=0.011)


class _Clock:
    """A clock that moves only when told: the host's time.time() and the step's tf.timestamp() both read it."""

    def __init__(self, monkeypatch):
        self.now = 1_000.0
        monkeypatch.setattr(wall_clock, "time", types.SimpleNamespace(time=lambda: self.now))
        monkeypatch.setattr(tf, "timestamp", lambda: tf.reshape(
            tf.numpy_function(lambda: np.float64(self.now), [], tf.float64, stateful=True), []))


def test_the_input_wait_lands_in_data_wait_and_nowhere_else(monkeypatch, capsys):
    """A pipeline that takes 30 ms per batch, by a clock that moves only there: all of it is data_wait."""
    keras.config.set_dtype_policy("mixed_float16")
    clock = _Clock(monkeypatch)
    x, y = _data(rows=8 * 30)

    def slow(a, b):
        clock.now += 0.03
        return a, b

    # Without prefetching, each batch is made inside the train function's call, as the step reads it.
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).map(
        lambda a, b: tf.numpy_function(slow, [a, b], [tf.float32, tf.float32], stateful=True))
    data = data.map(lambda a, b: (tf.ensure_shape(a, [8, 16]), tf.ensure_shape(b, [8, 1]))).with_options(options)
    model = kmp.prepare(_model(), wall_clock_breakdown=10)
    model.fit(data, epochs=1, verbose=0)
    lines = _lines(capsys.readouterr().out)
    assert [(a, b) for a, b, _ in lines] == [(1, 10), (11, 20), (21, 30)]
    for _, _, parts in lines:
        assert parts == {"data_wait": 30.0, "fwd_bwd": 0.0, "allreduce": 0.0, "loss_scale": 0.0, "step": 0.0,
                         "other": 0.0, "total": 30.0}


def test_under_mirrored_strategy_every_part_is_separated(two_replicas, capsys):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = kmp.prepare(_model(two_replicas, width=256, depth=3), wall_clock_breakdown=4)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    lines = _lines(capsys.readouterr().out)
    assert [(a, b) for a, b, _ in lines] == [(1, 4), (5, 8)]
    parts = lines[-1][2]
    _check_sums(parts)
    assert not any(math.isnan(v) for v in parts.values()), parts
    assert all(k in history.history for k in PART_KEYS)


def test_off_by_default_nothing_is_traced_and_the_logs_are_unchanged(monkeypatch, capsys):
    stamps = []
    real = tf.timestamp
    monkeypatch.setattr(tf, "timestamp", lambda *a, **k: stamps.append(1) or real(*a, **k))
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = kmp.prepare(_model())
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert stamps == [] and "kmp: steps" not in capsys.readouterr().out
    assert not [k for k in history.history if k.startswith("wall_clock/")]
    # On: six stamps in the traced step (start, gradients, reduced, checked, updated, adjusted).
    kmp.prepare(model, wall_clock_breakdown=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(stamps) == len(wall_clock.STAMPS)


def test_the_config_key_reaches_prepare_through_wrap(capsys):
    """DeepSpeed's `"wall_clock_breakdown": true` with its `steps_per_print`."""
    keras.config.set_dtype_policy("mixed_float16")
    config = {"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True},
              "wall_clock_breakdown": True, "steps_per_print": 2}
    x, y = _data(rows=32)
    model = kmp.prepare(_model(optimizer=kmp.wrap(keras.optimizers.Adam(1e-3), config)))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [(a, b) for a, b, _ in _lines(capsys.readouterr().out)] == [(1, 2), (3, 4)]
    # prepare's own argument wins over the config's.
    kmp.prepare(model, wall_clock_breakdown=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert _lines(capsys.readouterr().out) == []


def test_wrap_marks_a_copy_never_the_given_optimizer():
    given = keras.optimizers.Adam(1e-3)
    wrapped = kmp.wrap(given, precision="float32", wall_clock_breakdown=True, steps_per_print=5)
    assert wrapped is not given and wrapped.kmp_wall_clock_breakdown == 5
    assert not hasattr(given, "kmp_wall_clock_breakdown")
    assert kmp.wrap(given, precision="float32") is given  # off: nothing copied


@pytest.mark.parametrize("setting", [-1, 0.5, "yes"])
def test_a_bad_setting_is_a_clear_error(setting):
    model = _model()
    with pytest.raises(kmp.ConfigError, match=r"wall_clock_breakdown: expected .*Received: wall_clock_breakdown="):
        kmp.prepare(model, wall_clock_breakdown=setting)


def test_what_cannot_be_cut_is_said_once_and_shown_as_na(capsys):
    """Keras's own step with a Keras optimizer (bf16 on one device, no XLA),
    accumulation, and steps_per_execution > 1."""
    x, y = _data()
    keras.config.set_dtype_policy("mixed_bfloat16")
    plain = kmp.prepare(_model(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False), wall_clock_breakdown=4)
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out = capsys.readouterr().out
    assert out.count("kmp: wall-clock breakdown: Keras's own train step") == 1
    parts = _lines(out)[-1][2]
    assert math.isnan(parts["fwd_bwd"]) and math.isnan(parts["step"]) and not math.isnan(parts["other"])
    _check_sums(parts)

    keras.config.set_dtype_policy("mixed_float16")
    accumulating = kmp.prepare(_model(optimizer=kmp.wrap(keras.optimizers.Adam(1e-3), gradient_accumulation_steps=2)),
                               wall_clock_breakdown=4)
    accumulating.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out = capsys.readouterr().out
    assert "with gradient accumulation the all-reduce" in out
    parts = _lines(out)[-1][2]
    assert not math.isnan(parts["fwd_bwd"]) and math.isnan(parts["allreduce"]) and math.isnan(parts["step"])

    several = kmp.prepare(_model(steps_per_execution=2), wall_clock_breakdown=4)
    several.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out = capsys.readouterr().out
    assert "steps_per_execution=2" in out
    lines = _lines(out)
    assert [(a, b) for a, b, _ in lines] == [(1, 4), (5, 8)]
    assert math.isnan(lines[-1][2]["data_wait"]) and not math.isnan(lines[-1][2]["fwd_bwd"])


def test_the_arithmetic_of_a_window():
    """Host times around a call and in-graph stamps make the parts; golden line."""
    breakdown = wall_clock.Breakdown(every=2, steps_per_execution=1, chief=False)
    begin = 1_000.0
    # start 1 ms after the call, then fwd_bwd 5, allreduce 2, loss_scale 0.5, step 1.5 (ms); the call took 12 ms.
    breakdown.add(begin, begin + 0.012, np.array([begin + 0.001, 5.0, 2.0, 0.5, 1.5]))
    breakdown.add(begin, begin + 0.014, np.array([begin + 0.003, 5.0, 2.0, 0.5, 1.5]))
    assert breakdown.first == 3 and breakdown.steps == 2
    means = [breakdown.means[k] for k in PART_KEYS]
    assert means == pytest.approx([2.0, 5.0, 2.0, 0.5, 1.5, 2.0, 13.0], abs=1e-6)
    assert wall_clock.line(1, 2, np.array(means)) == (
        "kmp: steps 1-2 time (ms) | data_wait: 2.00 | fwd_bwd: 5.00 | allreduce: 2.00 | loss_scale: 0.50"
        " | step: 1.50 | other: 2.00 | total: 13.00")


def test_keras_tensorboard_callback_writes_the_parts(tmp_path, capsys):
    """The real `tensorboard` package (the extra): epoch_ and batch_ scalars of every part."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = kmp.prepare(_model(), wall_clock_breakdown=4)
    board = keras.callbacks.TensorBoard(str(tmp_path), update_freq=4, write_graph=False, profile_batch=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[board])
    lines = _lines(capsys.readouterr().out)
    written = {}
    for path in sorted((tmp_path / "train").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                written.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    for part in wall_clock.PARTS:
        # Batches 4 and 8 (TensorBoard counts from 1), each the window just closed; the epoch's the last.
        batch = written[f"batch_wall_clock/{part}_ms"]
        assert batch == pytest.approx([lines[0][2][part], lines[1][2][part]], abs=0.006)
        assert written[f"epoch_wall_clock/{part}_ms"] == pytest.approx([lines[1][2][part]], abs=0.006)
