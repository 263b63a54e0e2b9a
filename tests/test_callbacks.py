"""kmp.callbacks.LossScaleMonitor: logs in every callback position, TensorBoard,
Keras's and plain optimizers, and the floor check under XLA."""

import itertools
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmp.scaling import floor as kmp_floor
from kmp.scaling import state as loss_scale
from kmp.callbacks import LossScaleMonitor
from kmp.scaling.state import WindowState, steps_clear_of_floor, stuck_in_window
from kmp.config.settings import LossScaleConfig
from kmp.errors import LossScaleError
from kmp.scaling.optimizer import LossScaleOptimizer

BATCH = 4
# Per epoch: four batches, the second holds an inf, so flags are C O C C.
EPOCH_FLAGS = [True, False, True, True]
# initial 256, W=2, H=2 (see the spec): the overflow is absorbed, growth at good_steps 2.
SETTINGS = dict(initial_scale=256.0, dynamic_growth_steps=2, hysteresis=2)
BATCH_SCALES = [256, 256, 256, 512, 512, 512, 512, 1024]
BATCH_HYSTERESIS = [2, 1, 1, 2, 2, 1, 1, 2]


class Recorder(keras.callbacks.Callback):
    """Keeps the logs it is given; placed before or after the monitor."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def _data(inf_batches=(1,), batches=4, batch_size=BATCH):
    x = np.full((batches * batch_size, 2), 0.5, "float32")
    for b in inf_batches:
        x[b * batch_size:(b + 1) * batch_size] = np.inf
    return x, np.zeros((len(x), 1), "float32")


def _model(optimizer, **compile_kwargs):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def _kmp(**kwargs):
    return LossScaleOptimizer(keras.optimizers.SGD(0.01), log_overflows=False, **kwargs)


def _column(logs, key):
    return [entry[key] for entry in logs]


def test_the_batch_trajectory_is_the_state_machine_of_the_spec():
    states = loss_scale.run(LossScaleConfig(**SETTINGS), EPOCH_FLAGS * 2)
    assert [s.scale for s in states] == BATCH_SCALES
    assert [s.hysteresis_left for s in states] == BATCH_HYSTERESIS


@pytest.mark.parametrize("order", ["monitor_first", "monitor_last"])
def test_every_callback_sees_the_state_wherever_the_monitor_is(order):
    keras.config.set_dtype_policy("mixed_float16")
    optimizer = _kmp(**SETTINGS)
    model = _model(optimizer)
    history, first, last = keras.callbacks.History(), Recorder(), Recorder()
    monitor = LossScaleMonitor()
    # Every other callback after the monitor, or every one before it. A History
    # given by the user replaces the one Keras would append after them all.
    others = [first, history, last]
    cbs = [monitor, *others] if order == "monitor_first" else [*others, monitor]
    assert not optimizer.built  # TensorFlow builds it inside the first step
    model.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=cbs)

    assert model.history is history
    for recorder in (first, last):
        assert _column(recorder.batches, "loss_scale") == BATCH_SCALES
        assert _column(recorder.batches, "hysteresis_left") == BATCH_HYSTERESIS
        assert _column(recorder.batches, "overflows") == [0, 1, 1, 1, 1, 2, 2, 2]
        assert _column(recorder.batches, "skipped_steps") == [0, 1, 1, 1, 1, 2, 2, 2]
    # Per epoch: the state after the epoch's last step.
    for logs in (history.history, model.history.history):
        assert logs["loss_scale"] == [512.0, 1024.0]
        assert logs["hysteresis_left"] == [2.0, 2.0]
        assert logs["overflows"] == [1.0, 2.0]
        assert logs["skipped_steps"] == [1.0, 2.0]
    for recorder in (first, last):
        assert _column(recorder.epochs, "loss_scale") == [512.0, 1024.0]
        assert _column(recorder.epochs, "overflows") == [1.0, 2.0]


def test_the_monitor_changes_no_weight_and_no_metric():
    keras.config.set_dtype_policy("mixed_float16")
    runs = []
    for cbs in ([], [LossScaleMonitor()]):
        model = _model(_kmp(initial_scale=256.0, dynamic_growth_steps=2), metrics=["mae"])
        fit = model.fit(*_data(inf_batches=()), batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=cbs)
        runs.append((fit.history, model.get_weights()))
    (plain, plain_weights), (monitored, monitored_weights) = runs
    assert {k: monitored[k] for k in plain} == plain
    # overflow_layer: kmp's optimizer puts the layer finder in the step (a forward overflow is recognised).
    assert set(monitored) - set(plain) == {"loss_scale", "hysteresis_left", "overflows", "skipped_steps",
                                           "overflow_variable", "overflow_layer"}
    for a, b in zip(plain_weights, monitored_weights):
        np.testing.assert_array_equal(a, b)


def test_the_progress_bar_shows_the_state(capsys):
    model = _model(_kmp(**SETTINGS))
    model.fit(*_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=1, callbacks=[LossScaleMonitor()])
    out = capsys.readouterr().out
    for text in ("loss_scale: 512.0000", "overflows: 1.0000", "skipped_steps: 1.0000", "hysteresis_left: 2.0000"):
        assert text in out


def _scalars(log_dir: pathlib.Path) -> dict[str, list[float]]:
    """tag -> values, in step order, from the event files under `log_dir`."""
    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return {tag: [v for _, v in sorted(points)] for tag, points in found.items()}


def _tensorboard(log_dir, update_freq):
    # The real package (the `tensorboard` extra, in the test extras): no stand-in.
    return keras.callbacks.TensorBoard(log_dir, update_freq=update_freq, write_graph=False, profile_batch=0)


@pytest.mark.parametrize("order", ["monitor_first", "tensorboard_first"])
@pytest.mark.parametrize("update_freq", ["batch", 2])
def test_tensorboard_writes_the_state(tmp_path, order, update_freq):
    model = _model(_kmp(**SETTINGS))
    board = _tensorboard(str(tmp_path), update_freq)
    monitor = LossScaleMonitor()
    cbs = [monitor, board] if order == "monitor_first" else [board, monitor]
    model.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=cbs)

    scalars = _scalars(tmp_path / "train")
    assert scalars["epoch_loss_scale"] == [512.0, 1024.0]
    assert scalars["epoch_overflows"] == [1.0, 2.0]
    assert scalars["epoch_skipped_steps"] == [1.0, 2.0]
    assert scalars["epoch_hysteresis_left"] == [2.0, 2.0]
    every = 1 if update_freq == "batch" else update_freq
    # TensorBoard numbers batches from 1 and records those divisible by `every`.
    assert scalars["batch_loss_scale"] == BATCH_SCALES[every - 1::every]
    assert scalars["batch_overflows"] == [0, 1, 1, 1, 1, 2, 2, 2][every - 1::every]


def test_keras_loss_scale_optimizer_logs_the_scale_only():
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=256.0, dynamic_growth_steps=2
    )
    model, recorder = _model(optimizer), Recorder()
    fit = model.fit(
        *_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder, LossScaleMonitor()]
    )
    # With H=1 Keras's class follows kmp's state machine (the spec's parity).
    expected = [s.scale for s in loss_scale.run(LossScaleConfig(256.0, 2), EPOCH_FLAGS * 2)]
    assert _column(recorder.batches, "loss_scale") == expected == [256, 128, 128, 256, 256, 128, 128, 256]
    assert fit.history["loss_scale"] == [256.0, 256.0]
    assert set(fit.history) == {"loss", "loss_scale"}


def test_a_plain_optimizer_gets_one_warning_and_no_change():
    model, monitor = _model(keras.optimizers.SGD(0.01)), LossScaleMonitor()
    with pytest.warns(UserWarning, match="There is no loss scale to monitor") as caught:
        first = model.fit(*_data(inf_batches=()), batch_size=BATCH, verbose=0, callbacks=[monitor])
        train_function = model.train_function
        second = model.fit(*_data(inf_batches=()), batch_size=BATCH, verbose=0, callbacks=[monitor])
    ours = [str(w.message) for w in caught if "LossScaleMonitor" in str(w.message)]
    assert len(ours) == 1
    assert "Received: optimizer=SGD" in ours[0]
    assert set(first.history) == set(second.history) == {"loss"}
    assert model.train_function is train_function


def test_a_second_fit_continues_the_counts_and_the_function_is_restored():
    model, monitor = _model(_kmp(**SETTINGS)), LossScaleMonitor()
    model.fit(*_data(), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert model.train_function.__name__ != "train_function_with_loss_scale"
    # Built by now: the monitor starts from the optimizer's variables.
    fit = model.fit(*_data(), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert fit.history["loss_scale"] == [1024.0]
    assert fit.history["overflows"] == [2.0]
    assert model.train_function.__name__ != "train_function_with_loss_scale"
    # Without the monitor the logs are Keras's own again.
    assert set(model.fit(*_data(), batch_size=BATCH, verbose=0).history) == {"loss"}


def test_under_mirrored_strategy(two_replicas):
    with two_replicas.scope():
        model = _model(_kmp(**SETTINGS))
    fit = model.fit(*_data(batch_size=8), batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[LossScaleMonitor()])
    assert fit.history["loss_scale"] == [512.0, 1024.0]
    assert fit.history["overflows"] == [1.0, 2.0]


def _count_host_reads(monkeypatch):
    calls = []
    real = kmp_floor.to_host

    def counting(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(kmp_floor, "to_host", counting)
    return calls


def test_no_host_read_while_the_floor_is_out_of_reach(monkeypatch):
    reads = _count_host_reads(monkeypatch)
    model, recorder = _model(_kmp(initial_scale=2.0**15)), Recorder()
    model.fit(*_data(inf_batches=(), batches=8), batch_size=BATCH, verbose=0, callbacks=[LossScaleMonitor(), recorder])
    assert len(reads) == 1  # the iteration count at on_train_begin; 15 backoffs from the floor
    assert _column(recorder.batches, "loss_scale") == [2.0**15] * 8


def test_reads_once_per_batch_at_the_floor(monkeypatch):
    reads = _count_host_reads(monkeypatch)
    model, recorder = _model(_kmp(initial_scale=1.0, dynamic_growth_steps=1000)), Recorder()
    model.fit(*_data(inf_batches=(), batches=8), batch_size=BATCH, verbose=0, callbacks=[LossScaleMonitor(), recorder])
    assert reads == [1] + [6] * 8  # one stacked copy of the six scalars after each batch
    assert _column(recorder.batches, "loss_scale") == [1.0] * 8


def test_the_monitor_and_the_optimizer_check_the_floor_once_between_them(monkeypatch):
    model = _model(_kmp(initial_scale=1.0, dynamic_growth_steps=1000))
    model.fit(*_data(inf_batches=(), batches=2), batch_size=BATCH, verbose=0)  # kmp's optimizer wraps the function
    assert model.train_function.checks  # and checks the floor after each call, with one read each at the floor
    reads = _count_host_reads(monkeypatch)
    model.fit(*_data(inf_batches=(), batches=8), batch_size=BATCH, verbose=0, callbacks=[LossScaleMonitor()])
    assert reads == [6] + [6] * 8  # the state when the first step begins, then one read per batch: not two
    reads.clear()
    model.fit(*_data(inf_batches=(), batches=3), batch_size=BATCH, verbose=0)  # the optimizer's check alone again
    assert reads == [6] + [6] * 3


def test_reads_every_few_batches_above_the_floor(monkeypatch):
    reads = _count_host_reads(monkeypatch)
    model = _model(_kmp(initial_scale=16.0))  # four backoffs from the floor
    model.fit(*_data(inf_batches=(), batches=20, batch_size=1), batch_size=1, verbose=0,
              callbacks=[LossScaleMonitor()])
    # Steps 1-4 cannot be stuck; step 5 is checked against the snapshot after step 4.
    assert reads == [1, 12, 12, 12, 12]


# -- The floor check under XLA ------------------------------------------------


def _xla_fit(optimizer, data, monitor=True, steps_per_execution=1, epochs=1):
    model = _model(optimizer, jit_compile=True, steps_per_execution=steps_per_execution)
    cbs = [LossScaleMonitor()] if monitor else []
    model.fit(*data, batch_size=1, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_xla_overflow_at_the_floor_stops_fit(steps_per_execution):
    optimizer = _kmp(initial_scale=4.0, min_scale=1.0)
    model = _model(optimizer, jit_compile=True, steps_per_execution=steps_per_execution)
    weights = model.get_weights()
    data = _data(inf_batches=range(8), batches=8, batch_size=1)
    with pytest.raises(LossScaleError, match=r"already at its minimum \(1 = min_scale\)"):
        model.fit(*data, batch_size=1, shuffle=False, verbose=0, callbacks=[LossScaleMonitor()])
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # every step was skipped
    assert model.train_function.__name__ != "train_function_with_loss_scale"
    # 4 -> 2 -> 1, then the third step is stuck (with two steps per execution
    # the check sees the second execution whole).
    assert int(optimizer.overflows.numpy()) == (3 if steps_per_execution == 1 else 4)
    assert float(optimizer.dynamic_scale.numpy()) == 1.0


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_xla_without_the_monitor_stops_fit_too(steps_per_execution):
    # The compiled step cannot raise; the train function kmp's optimizer wraps checks the state after each call,
    # from the second call on (the first traced the step before the wrapper existed, and is checked then).
    optimizer = _kmp(initial_scale=4.0, min_scale=1.0)
    model = _model(optimizer, jit_compile=True, steps_per_execution=steps_per_execution)
    weights = model.get_weights()
    with pytest.raises(LossScaleError, match=r"already at its minimum \(1 = min_scale\)"):
        model.fit(*_data(inf_batches=range(8), batches=8, batch_size=1), batch_size=1, shuffle=False, verbose=0)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.overflows.numpy()) == (3 if steps_per_execution == 1 else 4)
    assert float(optimizer.dynamic_scale.numpy()) == 1.0
    # Without raise_at_min_scale the steps are skipped, as they were before: nothing is checked.
    optimizer = _kmp(initial_scale=4.0, min_scale=1.0, raise_at_min_scale=False)
    _xla_fit(optimizer, _data(inf_batches=range(8), batches=8, batch_size=1), monitor=False)
    assert int(optimizer.overflows.numpy()) == 8


def test_xla_two_steps_per_execution_clean_then_stuck_is_reported():
    # At the floor, W large: the clean step cannot grow the scale, so the
    # overflow after it was stuck.
    optimizer = _kmp(initial_scale=1.0, dynamic_growth_steps=1000)
    model = _model(optimizer, jit_compile=True, steps_per_execution=2)
    with pytest.raises(LossScaleError):
        model.fit(*_data(inf_batches=[1, 3], batches=4, batch_size=1), batch_size=1, shuffle=False, verbose=0,
                  callbacks=[LossScaleMonitor()])
    assert int(optimizer.overflows.numpy()) == 1


def test_xla_two_steps_per_execution_no_false_alarm_after_a_growth():
    # W=1: every clean step doubles the scale, the overflow after it halves it
    # back to the floor; nothing is stuck and training goes on.
    optimizer = _kmp(initial_scale=1.0, dynamic_growth_steps=1)
    _xla_fit(optimizer, _data(inf_batches=[1, 3, 5, 7], batches=8, batch_size=1), steps_per_execution=2, epochs=2)
    assert int(optimizer.overflows.numpy()) == 8


def test_static_scale_and_raise_off_are_never_checked(monkeypatch):
    reads = _count_host_reads(monkeypatch)
    for optimizer in (_kmp(static_scale=1.0), _kmp(initial_scale=1.0, raise_at_min_scale=False)):
        fit = _model(optimizer).fit(*_data(inf_batches=range(4)), batch_size=BATCH, verbose=0,
                                    callbacks=[LossScaleMonitor()])
        assert fit.history["overflows"] == [4.0]
        assert fit.history["loss_scale"] == [1.0]
    assert reads == []


# -- The decision itself, against the pure state machine ----------------------

CONFIGS = [
    LossScaleConfig(initial_scale=1.0, dynamic_growth_steps=w, hysteresis=h, consecutive_hysteresis=c, growth_rule=r)
    for w, h, c, r in itertools.product([1, 2, 3], [1, 2], [False, True], ["every_window", "after_window"])
]


def _simulate(config, state, flags):
    """Per-step states as the XLA step leaves them, and which steps were stuck."""
    overflows = iterations = 0
    out, stuck_steps = [], []
    for finite in flags:
        state, stuck = loss_scale.adjust(config, state, finite)
        overflows += not finite
        iterations += finite
        stuck_steps.append(bool(stuck))
        out.append(WindowState(state.scale, state.hysteresis_left, state.good_steps, overflows, iterations))
    return out, stuck_steps


def _starts(config):
    for scale, left, good in itertools.product([1.0, 2.0, 4.0], range(1, config.hysteresis + 1), range(4)):
        yield loss_scale.LossScaleState(scale, left, good)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_the_check_never_raises_falsely_and_is_exact_for_single_steps(config):
    detected = 0
    for start in _starts(config):
        before = WindowState(start.scale, start.hysteresis_left, start.good_steps, 0, 0)
        for length in (1, 2, 3):
            for flags in itertools.product([True, False], repeat=length):
                states, stuck = _simulate(config, start, flags)
                verdict = stuck_in_window(config, before, states[-1])
                assert not verdict or any(stuck), (start, flags)
                if length == 1:
                    assert verdict == stuck[0], (start, flags)
                if stuck[0] and list(flags) == sorted(flags):
                    assert verdict, (start, flags)  # overflows first, the first one stuck: always found
                detected += verdict and length > 1
    assert detected


def test_what_the_check_can_and_cannot_see():
    # At the floor with W=1, two executions of several steps:
    config = LossScaleConfig(initial_scale=1.0, dynamic_growth_steps=1)
    start, before = loss_scale.LossScaleState(1.0, 1, 0), WindowState(1.0, 1, 0, 0, 0)
    # It begins with the stuck overflow: found, though a growth follows.
    states, stuck = _simulate(config, start, [False, True])
    assert stuck == [True, False]
    assert stuck_in_window(config, before, states[-1])
    # A clean step grows the scale, one overflow backs it off, the next is
    # stuck: not found, since a growth could have absorbed it.
    states, stuck = _simulate(config, start, [True, False, False])
    assert stuck == [False, False, True]
    assert not stuck_in_window(config, before, states[-1])


@pytest.mark.parametrize("config", CONFIGS[::3], ids=str)
def test_no_step_within_the_margin_can_be_stuck(config):
    for start in _starts(config):
        margin = steps_clear_of_floor(config, start.scale, start.hysteresis_left)
        for flags in itertools.product([True, False], repeat=5):
            _, stuck = _simulate(config, start, flags)
            assert not any(stuck[:margin]), (start, flags)
        # Tight: overflows only get stuck right after the margin.
        _, stuck = _simulate(config, start, [False] * (margin + 1))
        assert stuck[margin]
