"""The flat-buffer engine (kmp.engine): the same training as the
per-variable path, and the Keras variables current wherever they are observed.

Each test trains the same model twice from the same seed, with
`flat_buffers=False` (kmp's per-variable path) and True, and compares.
"""

import glob
import json
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import engine
from kmp.callbacks import LossScaleMonitor
from parity import assert_same_update, trainable

ROWS, FEATURES = 48, 6


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, FEATURES).astype("float32")
    return x, (x @ rng.randn(FEATURES, 1) + 0.1 * rng.randn(ROWS, 1)).astype("float32")


def _model(strategy=None, optimizer="adamw", stock=False, **wrap_args):
    """The network compiled with kmp.LossScaleOptimizer(the optimizer, **wrap_args), or with `stock`, with the
    optimizer alone (stock Keras)."""
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else keras.name_scope("one_device"):
        model = keras.Sequential([
            # No parameter whose gradient is zero in exact arithmetic (a bias
            # right before a normalization): Adam turns its round-off into +-lr steps.
            keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1, name="out", dtype="float32"),
        ], name="net")
        inner = {
            "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
            "adam": lambda: keras.optimizers.Adam(1e-2),
            "sgd": lambda: keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
            "lion": lambda: keras.optimizers.Lion(1e-3, weight_decay=0.01),
            "adagrad": lambda: keras.optimizers.Adagrad(5e-2),
            "lamb": lambda: keras.optimizers.Lamb(1e-2),
            "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
            # Blocks of 8: several per variable, and variables that end inside one; the variables of 16
            # elements and fewer keep float32 states (min_8bit_size), the first kernel is quantized.
            "adamw8bit": lambda: kmp.AdamW8bit(1e-2, weight_decay=0.05, block_size=8, min_8bit_size=17),
        }[optimizer]()
        model.compile(optimizer=inner if stock else kmp.LossScaleOptimizer(inner, **wrap_args), loss="mse")
    return model


def _trained(flat, strategy=None, optimizer="adamw", epochs=2, callbacks=(), wrap_args=None, jit_compile="auto",
             **fit_args):
    model = kmp.prepare(_model(strategy, optimizer, **(wrap_args or {})), flat_buffers=flat, jit_compile=jit_compile)
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks),
                        **fit_args)
    return model, history.history


def _raw(model):
    """Every variable's value read directly (not through a wrapped method)."""
    return [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]


def _assert_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol)


# --- The same training ------------------------------------------------------------


_SETTINGS = [("float32", 1), ("mixed_float16", 1), ("mixed_float16", 2)]


# Each setting (one device without XLA, one device's whole-step XLA, replicas in shards) with and
# without accumulation and clipping, which change the step's path (kmp.scaling.optimizer,
# apply_flat); each optimizer's flat rule once (the rule is elementwise, the same in every setting),
# the ones without a fused per-variable update on the cheapest setting (Lamb's one update needs replicas).
@pytest.mark.parametrize("optimizer, wrap_args, policy, replicas", [
    *[("adam", {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5}, *setting) for setting in _SETTINGS],
    ("adamw", {}, "mixed_float16", 1),
    ("adamw", {}, "mixed_float16", 2),  # sharded without accumulation: bit for bit
    ("sgd", {"gradient_accumulation_steps": 3}, "mixed_float16", 2),  # accumulation without clipping, sharded
    ("lion", {}, "float32", 1),
    ("adagrad", {}, "float32", 1),  # (with Lion: one device without XLA, without accumulation)
    ("lamb", {"gradient_accumulation_steps": 2}, "mixed_float16", 2),
])
def test_the_buffers_train_as_the_per_variable_path(policy, optimizer, wrap_args, replicas, two_replicas):
    keras.config.set_dtype_policy(policy)
    strategy = two_replicas if replicas == 2 else None
    if policy == "mixed_float16":
        # On one device both run the whole step with XLA: Keras's step
        # without it rounds float16 otherwise, and a step that overflows in one
        # and not the other would part the trajectories.
        wrap_args = {**wrap_args, "initial_scale": 128.0}
    jit_compile = True if policy == "mixed_float16" and replicas == 1 else "auto"
    (plain, plain_logs), (flat, flat_logs) = (
        _trained(f, strategy, optimizer, wrap_args=wrap_args, jit_compile=jit_compile) for f in (False, True))
    assert engine.engine_of(plain) is None
    buffers = engine.engine_of(flat).buffers
    slots = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1, "adagrad": 1, "lamb": 2}[optimizer]
    assert len(buffers.buffers) == 1 + slots + ("gradient_accumulation_steps" in wrap_args)
    # Every parameter, padded to whole units of 16 elements (kmp.engine.buffers, ALIGN).
    assert buffers.size == -(-sum(int(np.prod(v.shape)) for v in flat.trainable_variables) // 16) * 16
    # Under the strategy both run XLA per replica and the same update math:
    # bit for bit, except that a global norm (clipping) sums in another
    # order. On one device, one ulp per step (the learning rate is computed
    # outside XLA), which float16 forward passes round further.
    # Lion, Adagrad and Lamb have no per-variable fused update: there the
    # comparison is with Keras's own update_step, rounded without XLA.
    fused = optimizer in ("sgd", "adam", "adamw")
    exact = replicas == 2 and fused and "gradient_clipping" not in wrap_args
    rtol = 0 if exact else 1e-5 if policy == "float32" or (replicas == 2 and fused) else 2e-3
    _assert_close(_raw(plain), _raw(flat), rtol=rtol, atol=rtol / 10)
    np.testing.assert_allclose(plain_logs["loss"], flat_logs["loss"], rtol=rtol)
    # The loss-scale trajectory is the same (scale, skipped steps).
    for name in ("dynamic_scale", "skipped_steps", "iterations"):
        assert getattr(plain.optimizer, name).numpy() == getattr(flat.optimizer, name).numpy(), name


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_replicas_of_one_process_share_the_step_and_every_replica_sees_the_result(two_replicas, optimizer):
    # 6 steps in windows of 4: the second window is open at the end.
    model, _ = _trained(True, two_replicas, optimizer, wrap_args={"gradient_accumulation_steps": 4}, epochs=1)
    buffers = engine.engine_of(model).buffers
    local = two_replicas.experimental_local_results
    if optimizer == "adam":
        # Each replica holds and steps its shard of the weights and slots (ZeRO stage 0 here), and Keras's copy
        # of the slots is held once in host memory: 161 parameters in 176 (whole units of 16): two shards of 96,
        # the second's last 31 padding.
        assert buffers.layout.name == "shared shards" and buffers.layout.slots_on_host
        for name in ("weights", *buffers.slot_names):
            shards = [c.numpy() for c in local(buffers.buffers[name])]
            assert [s.shape for s in shards] == [(96,), (96,)] and all(s[:65].any() for s in shards), name
            assert not shards[1][65:].any(), name  # the padding never moves
    else:
        # Lamb's trust ratio needs each variable whole: one update, on the first replica's
        # buffers; the second replica's weight and slot buffers are neither loaded nor stepped.
        assert buffers.layout.name == "first copy"
        for name in ("weights", *buffers.slot_names):
            first, second = local(buffers.buffers[name])
            assert first.numpy().any() and not second.numpy().any(), name
    # Each replica's accumulation sums (of the open window) are its own.
    assert not np.array_equal(*(s.numpy() for s in local(buffers.buffers["sums"])))
    # Stored: every replica's Keras copy of the weights and optimizer state holds the
    # same values (evaluate() and other per-replica reads use them), the iteration count too.
    model.get_weights()
    own = {id(v) for v in model.optimizer.accumulation.sums}
    for variable in [v for v in model.trainable_variables + model.optimizer.variables if id(v) not in own]:
        values = [c.numpy() for c in local(variable.value)]
        for other in values[1:]:
            np.testing.assert_array_equal(values[0], other, err_msg=variable.path)


def test_overflows_are_skipped_and_the_scale_moves_as_without_buffers(two_replicas):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    x[9] = 1e5  # global batch 1 overflows float16 on replica 0 only
    runs = []
    for flat in (False, True):
        # The input overflows float16 in the forward pass: "backoff" halves the scale there (the default raises).
        model = kmp.prepare(_model(two_replicas, "adam", forward_overflow="backoff"), flat_buffers=flat)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        runs.append(model)
    plain, flat = runs
    assert flat.optimizer.skipped_steps.numpy() == plain.optimizer.skipped_steps.numpy() >= 1
    assert flat.optimizer.dynamic_scale.numpy() == plain.optimizer.dynamic_scale.numpy()
    assert all(np.isfinite(w).all() for w in flat.get_weights())
    _assert_close(_raw(plain), _raw(flat), rtol=2e-3, atol=2e-4)


def test_the_overflow_names_the_layer_with_buffers(capfd):
    keras.config.set_dtype_policy("mixed_float16")
    model = _model(optimizer="sgd", forward_overflow="backoff")  # named, and the scale halved (not raised)
    model.get_layer("d1").kernel.assign(np.full((FEATURES, 16), 1e3, "float32"))  # float16 max is 65504
    kmp.prepare(model, flat_buffers=True)
    x, y = _data()
    x[:8] = 100.0
    history = model.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=[LossScaleMonitor()])
    assert engine.engine_of(model) is not None
    assert history.history["overflows"] == [1.0]
    assert "| forward overflow in layer 'd1' (Dense): output inf, inputs finite" in capfd.readouterr().err


# --- Observed: the Keras variables are current -------------------------------------


class _Recorder(keras.callbacks.Callback):
    """Reads a kernel directly (not through a model method) after every batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.get_layer("d1").kernel.numpy().copy())


class _Zeroer(keras.callbacks.Callback):
    """Writes a kernel directly in the middle of an epoch."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            kernel = self.model.get_layer("out").kernel
            kernel.assign(np.zeros(kernel.shape, "float32"))


def test_callbacks_reading_each_batch_and_writing_mid_epoch_see_and_set_the_current_weights(caplog):
    # One run each way with both callbacks: d1's kernel read after every batch, out's kernel
    # zeroed after batch 2 of each epoch (the writes also change what the later reads see).
    recorders = [_Recorder(), _Recorder()]
    with caplog.at_level(logging.WARNING, logger="kmp.engine.engine"):
        runs = [_trained(flat, callbacks=[recorder, _Zeroer()])[0] for flat, recorder in zip((False, True), recorders)]
    assert caplog.text.count("_Recorder overrides on_train_batch_end: the flat-buffer engine copies") == 1
    # What each batch hook saw matches the per-variable path, and so does where training ended.
    assert len(recorders[1].seen) == 2 * ROWS // 8
    _assert_close(recorders[0].seen, recorders[1].seen)
    assert not np.array_equal(recorders[1].seen[0], recorders[1].seen[-1])  # it trained
    _assert_close(_raw(runs[0]), _raw(runs[1]))


@pytest.fixture(scope="module")
def adam_on_two_replicas(two_replicas):
    """The engine's defaults, Adam in mixed_float16 on two replicas, a kernel read after every batch:
    (model, recorder), the reference that variants of the engine's internals match bit for bit."""
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        recorder = _Recorder()
        model, _ = _trained(True, two_replicas, "adam", callbacks=[recorder], epochs=1)
    finally:
        keras.config.set_dtype_policy(policy)
    return model, recorder


class _Rewriter(keras.callbacks.Callback):
    """Writes a kernel's own value back after every batch: nothing changes but the buffer it is in."""

    def on_train_batch_end(self, batch, logs=None):
        kernel = self.model.get_layer("d1").kernel
        kernel.assign(kernel.value + 0.0)


def test_the_many_variable_paths_train_the_same(adam_on_two_replicas, two_replicas, monkeypatch):
    # Models of many variables split the weights before the XLA forward pass
    # (engine.SPLIT_IN_XLA_UP_TO), and loads made often run as one traced
    # graph (kmp.engine.buffers.EAGER_COPIES): both at once here, on this small model, with
    # a copy out around every batch and a load of what a callback wrote; the same math, bit for bit.
    keras.config.set_dtype_policy("mixed_float16")
    monkeypatch.setattr(engine, "SPLIT_IN_XLA_UP_TO", 0)
    monkeypatch.setattr(kmp.engine.buffers, "EAGER_COPIES", 0)
    seen_other = _Recorder()
    other, _ = _trained(True, two_replicas, "adam", callbacks=[seen_other, _Rewriter()], epochs=1)
    one, seen_one = adam_on_two_replicas
    buffers = engine.engine_of(other).buffers
    assert buffers._graphs.keys() == {"load"}  # a store is never traced
    assert buffers._calls["load"] == ROWS // 8  # the first, then one before each later step (the rewritten kernel)
    assert not engine.engine_of(one).buffers._graphs
    _assert_close(_raw(one), _raw(other), rtol=0, atol=0)
    _assert_close(seen_one.seen, seen_other.seen, rtol=0, atol=0)


@pytest.fixture(scope="module")
def one_epoch_on_one_device():
    """The engine's defaults on one device, float32, one epoch: a model that tests read (or change and restore)."""
    return _trained(True, epochs=1)[0]


def test_gradients_written_in_place_are_the_joined_ones(one_epoch_on_one_device, monkeypatch):
    # Inside XLA on replicas that are CPUs of one process, variables of
    # kmp.engine.buffers.IN_PLACE_FROM elements or more are written into the flat gradient
    # in place and the runs of smaller ones between them joined; elsewhere
    # everything is joined. With the threshold at 16 this model has both kinds
    # (out's bias: 1 element), and a variable without a gradient: the same
    # elements, bit for bit, padded as if to two shards.
    model = one_epoch_on_one_device
    buffers = engine.engine_of(model).buffers
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=v.shape) * 300, tf.float16) for v in model.trainable_variables]
    grads[1] = None  # d1's bias
    scale = tf.constant(128.0)
    written = []
    monkeypatch.setattr(type(buffers), "_written_in_place",
                        lambda self, parts, real=type(buffers)._written_in_place: written.append(1) or real(self, parts))
    monkeypatch.setattr(buffers, "length", buffers.size + 32)  # as if sharded: zeros past the last variable
    monkeypatch.setattr(buffers.layout, "shares_cores", True)  # as on replicas that are CPUs of one process
    joined = tf.function(lambda: buffers.join(grads, scale))()
    monkeypatch.setattr(kmp.engine.buffers, "IN_PLACE_FROM", 16)
    in_place = tf.function(lambda: buffers.join(grads, scale), jit_compile=True)()
    assert written and in_place.shape == joined.shape == [buffers.size + 32]
    np.testing.assert_array_equal(in_place.numpy(), joined.numpy())
    start = [0, *np.cumsum(buffers.spans)]
    by_variable = {id(v): k for k, v in enumerate(buffers.variables)}
    for g, v in zip(grads, model.trainable_variables):
        k = by_variable[id(v)]
        expected = np.zeros(v.shape, "float32") if g is None else g.numpy().astype("float32") / np.float32(128)
        np.testing.assert_array_equal(in_place.numpy()[start[k]:start[k] + expected.size], expected.ravel())
    assert not in_place.numpy()[buffers.size:].any()


def test_writing_gradients_in_place_trains_the_same(adam_on_two_replicas, two_replicas, monkeypatch):
    keras.config.set_dtype_policy("mixed_float16")
    joined, _ = adam_on_two_replicas
    monkeypatch.setattr(kmp.engine.buffers, "IN_PLACE_FROM", 16)
    in_place, _ = _trained(True, two_replicas, "adam", callbacks=[_Recorder()], epochs=1)  # as the reference
    assert engine.engine_of(in_place).buffers.layout.shares_cores
    _assert_close(_raw(joined), _raw(in_place), rtol=0, atol=0)


def test_one_device_joins_the_gradient(monkeypatch):
    # One device's XLA computation has every core, and XLA:CPU runs an in-place
    # write on one thread: there the gradient is joined whatever the sizes.
    monkeypatch.setattr(kmp.engine.buffers, "IN_PLACE_FROM", 1)
    monkeypatch.setattr(kmp.engine.buffers.FlatBuffers, "_written_in_place",
                        lambda self, parts: pytest.fail("written in place"))
    model, _ = _trained(True, epochs=1, jit_compile=True)
    assert not engine.engine_of(model).buffers.layout.shares_cores


def test_a_callback_that_says_it_reads_no_weights_costs_no_copies():
    class Quiet(_Recorder):
        kmp_reads_weights = False

    model = kmp.prepare(_model(), flat_buffers=True)
    listed = engine.callbacks(model, [Quiet(), _Recorder(), keras.callbacks.History()])
    assert [type(c).__name__ for c in listed] == ["_Sync", "Quiet", "_Around", "_Recorder", "_Around", "History"]


def test_model_checkpoint_mid_epoch_saves_the_current_weights(tmp_path):
    files = []
    for flat in (False, True):
        path = tmp_path / f"{flat}.weights.h5"
        checkpoint = keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True, save_freq=4)
        _trained(flat, callbacks=[checkpoint], epochs=1)  # 6 batches: saved after batch 4 only
        reader = _model()
        reader.load_weights(str(path))
        files.append(_raw(reader))
    _assert_close(*files)
    untrained = _raw(_model())
    assert not np.array_equal(files[1][0], untrained[0])


def _copies(model, direction: str):
    """The names each copy ("load" or "store") of `model`'s buffers copied (recorded from now on)."""
    buffers, seen = engine.engine_of(model).buffers, []
    copy = getattr(buffers, direction)

    def recorded(names=None):
        seen.append(tuple(buffers.buffers) if names is None else tuple(names))
        copy(names)

    setattr(buffers, direction, recorded)
    return seen


def test_an_epoch_end_copies_only_for_what_reads_the_variables_and_only_what_it_reads(tmp_path):
    x, y = _data()
    model = kmp.prepare(_model(), flat_buffers=True)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    stores = _copies(model, "store")
    everything, state = ("weights", "momentum", "velocity"), ("momentum", "velocity")  # AdamW
    # The known callbacks read at an epoch's end through the model's methods: one store, at the end.
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[keras.callbacks.CSVLogger(os.devnull)])
    assert stores == [everything]
    # Validation reads the weights only: the optimizer's state is stored once, at the end.
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y))
    assert stores[1:] == [("weights",)] * 3 + [state]
    # A save reads the state too.
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y), callbacks=[checkpoint])
    assert stores[5:] == [("weights",), state] * 2


def _histograms(log_dir):
    """Each epoch's histogram of each weight that a TensorBoard callback logged: {(tag, step): buckets}."""
    found = {}
    for path in glob.glob(os.path.join(log_dir, "train", "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "histograms":
                    found[(value.tag, event.step)] = tf.make_ndarray(value.tensor)
    return found


def test_tensorboard_histograms_see_each_epochs_weights(tmp_path):
    runs = []
    for flat in (False, True):
        board = keras.callbacks.TensorBoard(str(tmp_path / str(flat)), histogram_freq=1, write_graph=False)
        _trained(flat, callbacks=[board], epochs=2)
        runs.append(_histograms(str(tmp_path / str(flat))))
    assert runs[0].keys() == runs[1].keys() and {step for _, step in runs[0]} == {0, 1}
    for key in runs[0]:
        np.testing.assert_allclose(runs[1][key], runs[0][key], rtol=1e-4, atol=1e-5, err_msg=str(key))


def test_a_keras_file_moves_between_the_engine_and_plain_keras(one_epoch_on_one_device, tmp_path):
    x, _ = _data()
    model = one_epoch_on_one_device
    model.save(tmp_path / "flat.keras")
    plain = keras.models.load_model(tmp_path / "flat.keras")  # no prepare, no engine
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    # And back: a plain model's file trains on under the engine exactly as without it.
    continued = []
    for flat in (False, True):
        loaded = kmp.prepare(keras.models.load_model(tmp_path / "flat.keras"), flat_buffers=flat)
        loaded.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
        continued.append(_raw(loaded))
    _assert_close(*continued)


def test_checkpoints_hold_keras_variables_only(one_epoch_on_one_device, tmp_path):
    model = one_epoch_on_one_device
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert not [n for n in names if "kmp_flat" in n]
    restored = _model()
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(path).assert_existing_objects_matched()
    _assert_close(_raw(model), _raw(restored), rtol=0, atol=0)


def test_validation_and_evaluate_see_the_current_weights_and_early_stopping_restores_the_best():
    # Validated each epoch; stopped after the second epoch (no improvement of 10) with the first epoch's
    # weights restored; then evaluated, on the restored weights.
    x, y = _data()
    runs, results = [], []
    for flat in (False, True):
        stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True,
                                             start_from_epoch=0, min_delta=10.0)
        model, logs = _trained(flat, epochs=4, callbacks=[stop], validation_data=(x, y))
        assert len(logs["loss"]) == 2 and stop.best_epoch == 0, "expected the stop after epoch 2, epoch 1 restored"
        runs.append(_raw(model))
        results.append((logs["val_loss"], model.evaluate(x, y, verbose=0)))
    _assert_close(*runs)  # the restored weights
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, err_msg="val_loss")
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, err_msg="evaluate")


class _Interrupt(keras.callbacks.Callback):
    kmp_reads_weights = False

    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise KeyboardInterrupt

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:  # after epoch 0's validation, which stored the weights only
            raise KeyboardInterrupt


@pytest.mark.parametrize("validated", [False, True])
def test_an_interrupted_fit_leaves_the_variables_current(validated):
    runs = []
    x, y = _data()
    for flat in (False, True):
        model = kmp.prepare(_model(), flat_buffers=flat)
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[_Interrupt()],
                      **({"validation_data": (x, y), "steps_per_epoch": 3} if validated else {}))
        runs.append(_raw(model))  # the optimizer's state too
    _assert_close(*runs)


def test_kmp_backup_resumes_exactly_with_buffers(tmp_path):
    from kmp.callbacks.backup import BackupAndRestore

    def job(directory, interrupt=False):
        model = kmp.prepare(_model(optimizer="adam", gradient_accumulation_steps=2), flat_buffers=True)
        callbacks = [BackupAndRestore(str(directory), save_freq=3)] + ([_Interrupt()] if interrupt else [])
        try:
            model.fit(*_data(), batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        except KeyboardInterrupt:
            return None
        return _raw(model)

    whole = job(tmp_path / "whole")
    assert job(tmp_path / "cut", interrupt=True) is None
    resumed = job(tmp_path / "cut")
    _assert_close(whole, resumed, rtol=0, atol=0)


def test_set_weights_between_fits_is_trained_from_and_a_new_compile_gets_new_buffers():
    runs, losses = [], []
    for flat in (False, True):
        model, _ = _trained(flat, epochs=1)
        model.set_weights([w * 0.5 for w in model.get_weights()])
        model.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
        runs.append(_raw(model))
        # Then compiled anew (SGD at lr 0, MAE): new buffers, trained from the weights as they are.
        first = engine.engine_of(model)
        model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.0)), loss="mae")
        before = [np.array(w) for w in model.trainable_weights]
        losses.append(model.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"])
        if flat:
            assert engine.engine_of(model) is not first
        _assert_close(before, [np.array(w) for w in model.trainable_weights], rtol=0, atol=0)
    _assert_close(*runs)  # set_weights was trained from
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)  # the new loss (MAE), on the same weights


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_fit_after_a_fit_loads_nothing_and_a_write_reloads_its_buffer_only(replicas, two_replicas):
    """The Keras variables still holding what the last store wrote (kmp.engine.buffers.written_since_store):
    no copy back into the buffers. A write by any route moves its variable to a new buffer: that buffer
    (only) is loaded, and trained from as by the per-variable path."""
    strategy = two_replicas if replicas == 2 else None
    x, y = _data()
    update = tf.function(lambda v: v.assign_add(tf.ones_like(v)), jit_compile=True)  # a user's XLA write

    def each_component(m, variable):  # XLA takes no distributed variable: each replica's, on its device
        for component in m.distribute_strategy.experimental_local_results(variable.value):
            with tf.device(component.device):
                update(component)
    writes = [
        ("weights", lambda m: m.get_layer("d1").kernel.assign(m.get_layer("d1").kernel * 0.5)),
        ("momentum", lambda m: m.optimizer.inner_optimizer._momentums[0].assign_add(np.full((6, 16), 1e-2))),
        ("weights", lambda m: each_component(m, m.get_layer("out").bias)),
        ("weights", lambda m: m.get_layer("d1").set_weights([w + 0.1 for w in m.get_layer("d1").get_weights()])),
    ]
    runs = []
    for flat in (False, True):
        model = kmp.prepare(_model(strategy, "adam"), flat_buffers=flat)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        loads = _copies(model, "load") if flat else []
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert loads == []
        for name, write in writes:
            write(model)
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
            if flat:
                assert loads.pop() == (name,)
        runs.append(_raw(model))
    _assert_close(*runs)


def _same_shapes(strategy=None, optimizer="adam"):
    """Three kernels of one shape between biases: the buffers hold the kernels as one run."""
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else keras.name_scope("one_device"):
        model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="tanh") for _ in range(3)]
                                 + [keras.layers.Dense(1)])
        inner = (kmp.AdamW8bit(1e-2, weight_decay=0.05, block_size=8, min_8bit_size=17) if optimizer == "adamw8bit"
                 else keras.optimizers.Adam(1e-2))
        model.compile(optimizer=kmp.LossScaleOptimizer(inner), loss="mse")
    return model


@pytest.mark.parametrize("replicas, optimizer", [(1, "adamw8bit"), (2, "adam")])
def test_variables_of_one_shape_are_stored_as_one_run_and_train_as_the_per_variable_path(replicas, optimizer,
                                                                                          two_replicas):
    """The variables of one shape lie next to each other in the buffers, and a store splits them by one op
    (kmp.engine.buffers._CopyPlan): every variable still gets its own values, and a fit after a fit still
    finds them unwritten (nothing to load)."""
    strategy = two_replicas if replicas == 2 else None
    rng = np.random.RandomState(0)
    x = rng.randn(48, 8).astype("float32")
    y = np.tanh(x @ rng.randn(8, 1)).astype("float32")
    runs = []
    for flat in (False, True):
        model = kmp.prepare(_same_shapes(strategy, optimizer), flat_buffers=flat)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        if flat:
            buffers = engine.engine_of(model).buffers
            kernels = [k for k, shape in enumerate(buffers.shapes) if shape == (8, 8)]
            assert kernels == list(range(kernels[0], kernels[0] + 3))  # together
            assert any(count == 3 for _, count, _ in buffers._copy_plan("weights").wanted)
            loads = _copies(model, "load")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert not flat or loads == []
        runs.append(_raw(model))
    _assert_close(*runs)


def test_a_run_is_of_one_shape_and_unpadded_between():
    """kmp.engine.buffers._runs: the variables a copy splits by one op."""
    from kmp.engine.buffers import _runs

    # 1-D variables need no reshape: SplitV's pieces are theirs.
    assert _runs([(8, 8)] * 3 + [(8,)] * 2, [64] * 3 + [8] * 2) == [((8, 8), 3, 64, 0), ((8,), 1, 8, 0),
                                                                   ((8,), 1, 8, 0)]
    # Padding after a variable ends its run, which may end padded itself.
    assert _runs([(3, 5)] * 3, [15, 16, 15]) == [((3, 5), 2, 15, 1), ((3, 5), 1, 15, 0)]
    assert _runs([(3, 5), (5, 3), (3, 5)], [15] * 3) == [((3, 5), 1, 15, 0), ((5, 3), 1, 15, 0), ((3, 5), 1, 15, 0)]


def test_the_buffers_back_after_a_per_variable_fit_store_into_the_moved_slots(two_replicas):
    """On replicas of one process Keras's slots move to one host copy and back (kmp.engine.zero) when a fit
    takes the per-variable path in between: the stores then write the slots' new variables."""
    x, y = _data()
    runs = []
    for flats in ((False, False, False), (True, False, True)):
        model = _model(two_replicas, "adam")
        for flat in flats:
            model = kmp.prepare(model, flat_buffers=flat)
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        runs.append(_raw(model))
    _assert_close(*runs)


# --- Where the buffers do not apply --------------------------------------------


def test_an_optimizer_without_a_flat_update_falls_back_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="kmp.engine.prepare"):
        model, _ = _trained("auto", optimizer="rmsprop", epochs=1)
    assert engine.engine_of(model) is None
    assert "flat buffers off for net, per-variable updates instead: RMSprop has no fused update" in caplog.text
    stock = _model(optimizer="rmsprop", stock=True)
    initial = trainable(stock)
    stock.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_same_update(initial, trainable(stock), trainable(model), rtol=1e-4)  # the same values here


def test_flat_buffers_true_warns_where_they_do_not_apply(caplog):
    with caplog.at_level(logging.WARNING, logger="kmp.engine.prepare"):
        _trained(True, optimizer="rmsprop", epochs=1)
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "flat buffers off" in r.message]


def test_prepare_checks_flat_buffers():
    with pytest.raises(kmp.ConfigError, match="flat_buffers"):
        kmp.prepare(_model(), flat_buffers="yes")


def test_the_engine_changes_only_this_instance():
    model = kmp.prepare(_model(), flat_buffers=True)
    other = _model()
    for name in ("fit", "evaluate", "save", "get_weights", "set_weights", "load_weights"):
        assert name in vars(model)
        assert name not in vars(other)


class _WithUnused(keras.Model):
    """A layer that is built and trainable but not used: it gets no gradient."""

    def __init__(self):
        super().__init__(name="net")
        self.d1 = keras.layers.Dense(8, activation="relu", name="d1")
        self.unused = keras.layers.Dense(3, name="unused")
        self.out = keras.layers.Dense(1, name="out", dtype="float32")

    def build(self, shape):
        self.unused.build(shape)

    def call(self, x):
        return self.out(self.d1(x))


def test_a_variable_without_gradient_is_not_updated_as_in_keras(caplog):
    runs = []
    for flat in (False, True):
        keras.utils.set_random_seed(0)
        model = _WithUnused()
        model(np.zeros((1, FEATURES), "float32"))
        model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.AdamW(1e-2, weight_decay=0.1)), loss="mse")
        initial = np.array(model.unused.kernel)
        with caplog.at_level(logging.WARNING, logger="kmp.engine.buffers"):
            kmp.prepare(model, flat_buffers=flat).fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert (engine.engine_of(model) is not None) == flat
        np.testing.assert_array_equal(np.array(model.unused.kernel), initial)  # no step, no weight decay
        runs.append(_raw(model))
    _assert_close(*runs)
    assert "no gradient for 2 trainable variable(s) (net/unused/kernel, net/unused/bias)" in caplog.text
    assert "AutoGraph could not transform" not in caplog.text


class _OneHotLookup(keras.layers.Layer):
    """An embedding lookup as a one-hot matmul: the same rows, a dense gradient."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(10, 3), name="embeddings")

    def call(self, ids):
        return keras.ops.matmul(keras.ops.one_hot(ids, 10), self.embeddings)


def test_a_sparse_gradient_is_summed_before_it_is_squared_and_kmp_says_so(two_replicas, caplog):
    """An embedding lookup's gradient, with ids repeated in each replica's batch: Keras 3's Adam squares
    each looked-up row before the repeats and the replicas' rows are summed; the flat buffers square the
    summed gradient, as Adam on a dense gradient (here a one-hot matmul, under stock Keras) does. kmp says so
    once; the per-variable path keeps Keras's update."""
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 10, (16, 4)).astype("int32"), rng.normal(size=(16, 1)).astype("float32")

    def trained(kind, lookup="embedding"):
        keras.utils.set_random_seed(0)
        with two_replicas.scope():
            first = keras.layers.Embedding(10, 3, name="emb") if lookup == "embedding" else _OneHotLookup(name="emb")
            model = keras.Sequential([keras.Input((4,), dtype="int32"), first, keras.layers.Flatten(),
                                      keras.layers.Dense(1, name="out")], name="lookup")
            model.set_weights(initial)  # the same start for both lookups
            optimizer = keras.optimizers.Adam(1e-2)
            model.compile(optimizer=optimizer if kind == "stock" else kmp.wrap(optimizer), loss="mse")
        if kind != "stock":
            kmp.prepare(model, flat_buffers=kind == "flat")
        model.fit(ids, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return [v.numpy() for v in model.trainable_variables]

    rows = np.random.default_rng(1).normal(size=(10, 3)).astype("float32")
    initial = [rows, np.full((12, 1), 0.1, "float32"), np.zeros(1, "float32")]
    with caplog.at_level(logging.WARNING, logger="kmp.engine.buffers"):
        stock, per_variable = trained("stock"), trained("per-variable")
        assert "is sparse" not in caplog.text
        flat, dense = trained("flat"), trained("stock", lookup="one-hot")
    assert caplog.text.count("kmp: the gradient of lookup/emb/embeddings is sparse (an embedding lookup)") == 1
    _assert_close(stock, per_variable)
    _assert_close(flat, dense)
    assert np.abs(flat[0] - stock[0]).max() > 1e-3  # the rows' second moments differ where ids repeat


def test_auto_keeps_large_variables_per_variable(caplog):
    def large():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((400,)), keras.layers.Dense(400, name="wide")], name="wide_net")
        model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
        return model

    x = np.random.RandomState(0).randn(16, 400).astype("float32")
    with caplog.at_level(logging.INFO, logger="kmp.engine.prepare"):
        auto = kmp.prepare(large())
        auto.fit(x, x, batch_size=8, verbose=0)
    assert engine.engine_of(auto) is None
    assert "its variables hold 80,200 parameters on average (> 65,536)" in caplog.text
    forced = kmp.prepare(large(), flat_buffers=True)
    forced.fit(x, x, batch_size=8, verbose=0)
    assert engine.engine_of(forced) is not None
    _assert_close(_raw(auto), _raw(forced))


def test_a_custom_train_step_keeps_its_path_and_says_so(caplog):
    class Custom(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(0)
    model = Custom([keras.Input((FEATURES,)), keras.layers.Dense(1)], name="custom")
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
    with caplog.at_level(logging.WARNING, logger="kmp.engine.prepare"):
        kmp.prepare(model, flat_buffers=True).fit(*_data(), batch_size=8, verbose=0)
    assert engine.engine_of(model) is None
    assert "flat buffers off for custom, per-variable updates instead: the model has its own train_step" in caplog.text


@pytest.mark.parametrize("optimizer, jit_compile", [("adam", True), ("lamb", "auto"), ("lamb", True)])
def test_models_of_millions_of_parameters_compile(optimizer, jit_compile):
    # Past about 10 MB of int32 (2.6M parameters), XLA gave the segment ids
    # of tf.repeat a padded dynamic shape: Lamb's update, and the overflow
    # flags inside a whole-step XLA step, failed to compile.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1536,)), keras.layers.Dense(2048),
                              keras.layers.Dense(1, dtype="float32")])
    inner = keras.optimizers.Adam(1e-3) if optimizer == "adam" else keras.optimizers.Lamb(1e-3)
    model.compile(optimizer=kmp.LossScaleOptimizer(inner), loss="mse", jit_compile=jit_compile)
    kmp.prepare(model, flat_buffers=True)
    x = np.random.RandomState(0).rand(16, 1536).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    assert engine.engine_of(model).buffers.size > 3_000_000
    assert model.optimizer.iterations.numpy() + model.optimizer.skipped_steps.numpy() == 2
    after = model.get_weights()
    assert all(np.isfinite(w).all() for w in after)
    assert not np.array_equal(before[0], after[0])


# --- Reads and writes between train_on_batch calls, by any route ----------------------


def _on_batches(flat, between, steps=3, strategy=None):
    """train_on_batch `steps` times, `between(model)` after each; what `between` returned each time."""
    model = kmp.prepare(_model(strategy), flat_buffers=flat)
    x, y = _data()
    seen = []
    for k in range(steps):
        model.train_on_batch(x[8 * k:8 * k + 8], y[8 * k:8 * k + 8])
        seen.append(between(model))
    return model, seen


def test_a_variable_written_between_train_on_batch_calls_is_trained_from():
    """The issue's repro: SGD at lr 0 changes nothing, so the kernel stays as written."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.0), gradient_accumulation_steps=1), loss="mse")
    kmp.prepare(model, flat_buffers=True)
    x = np.ones((16, 8), "float32")
    model.train_on_batch(x, x[:, :1])
    assert engine.engine_of(model) is not None
    model.layers[0].kernel.assign(np.zeros((8, 1)))
    model.train_on_batch(x, x[:, :1])
    assert np.abs(model.get_weights()[0]).max() == 0.0
    assert np.abs(model.layers[0].kernel.numpy()).max() == 0.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_read_between_train_on_batch_calls_sees_the_current_weights(replicas, two_replicas):
    strategy = two_replicas if replicas == 2 else None
    reads = {
        "a layer's variable": lambda m: m.layers[0].kernel.numpy(),
        "a layer's get_weights": lambda m: m.layers[0].get_weights()[0],
        "__array__": lambda m: np.array(m.layers[0].kernel),
        "a graph's read": lambda m: tf.function(lambda: tf.reduce_sum(m.layers[0].kernel.value))().numpy(),
    }
    routes = list(reads)

    def in_turn():
        """Every route after each step, a different one first each time: each is the first read after a step."""
        steps = iter(range(len(routes)))

        def read(model):
            first = next(steps)
            return {route: reads[route](model) for route in routes[first:] + routes[:first]}
        return read

    runs = [_on_batches(flat, in_turn(), steps=len(routes), strategy=strategy)[1] for flat in (False, True)]
    for step, (per_variable, flat) in enumerate(zip(*runs), 1):
        for route in routes:
            np.testing.assert_allclose(per_variable[route], flat[route], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{route}, after step {step}")


def test_weight_clipping_between_train_on_batch_calls_holds():
    """WGAN's critic: every kernel clipped to [-0.01, 0.01] after each step."""

    def clip(model):
        for layer in model.layers:
            for v in layer.trainable_weights:
                v.assign(np.clip(v.numpy(), -0.01, 0.01))
        return [v.numpy() for v in model.trainable_variables]

    runs = [_on_batches(flat, clip, steps=4)[1] for flat in (False, True)]
    for per_variable, flat in zip(*runs):
        _assert_close(per_variable, flat)
    assert max(np.abs(w).max() for w in runs[1][-1]) <= 0.01


class _Ema(keras.callbacks.Callback):
    """An EMA of the weights swapped in for each epoch's end (as EMA callbacks evaluate), and back out."""

    def on_train_batch_end(self, batch, logs=None):
        weights = self.model.get_weights()
        self.ema = weights if not hasattr(self, "ema") else [0.5 * a + 0.5 * w for a, w in zip(self.ema, weights)]

    def on_epoch_end(self, epoch, logs=None):
        self.live = self.model.get_weights()
        for v, a in zip(self.model.weights, self.ema):
            v.assign(a)

    def on_epoch_begin(self, epoch, logs=None):
        if hasattr(self, "live"):
            for v, w in zip(self.model.weights, self.live):
                v.assign(w)


def test_an_ema_swap_by_assign_in_callbacks_trains_as_the_per_variable_path():
    runs = [_trained(flat, callbacks=[_Ema()], epochs=3)[0] for flat in (False, True)]
    _assert_close(_raw(runs[0]), _raw(runs[1]))


def test_the_eager_copies_raw_ops_read_write_and_check_shapes_as_assign_does():
    """kmp.engine.buffers copies between fit() calls with the ops alone: same values, and a
    value of another shape is refused (the raw op alone would give the variable that shape)."""
    from kmp.engine import buffers

    variable = tf.Variable(np.zeros((2, 3), "float32"))
    value = buffers._reshaped(tf.range(6, dtype=tf.float32), (2, 3))
    buffers._assign(variable, value)
    np.testing.assert_array_equal(buffers._read(variable).numpy(), np.arange(6).reshape(2, 3))
    with pytest.raises(tf.errors.InvalidArgumentError):
        buffers._assign(variable, tf.zeros((3, 2)))
    assert variable.shape == (2, 3)
    np.testing.assert_array_equal(variable.numpy(), np.arange(6).reshape(2, 3))
    # The same shape tensor serves every call with that shape.
    assert buffers._shape_tensor((2, 3)) is buffers._shape_tensor((2, 3))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_new_compile_with_the_same_optimizer_trains_and_reports_the_new_loss(replicas, two_replicas):
    """compile(optimizer=model.optimizer, loss=...) after a prepared fit(): the next fit() minimises and reports
    the new loss, as stock Keras's (the unprepared model, under the same strategy) does."""
    strategy = two_replicas if replicas == 2 else None
    x, y = _data()
    losses = []
    for model in (_model(strategy, "adam"), kmp.prepare(_model(strategy, "adam"), flat_buffers=True)):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        with model.distribute_strategy.scope():
            model.compile(optimizer=model.optimizer, loss="mae")
        losses.append(model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


def test_bfloat16_weights_train_from_float32_masters_as_mixed_bfloat16_weights_train():
    """The "bfloat16" policy's weights on the flat buffers: the same float32 masters and training as
    mixed_bfloat16's float32 weights (both compute in bfloat16, from the weights rounded), the variables being
    the masters rounded.
    Updated per variable, in bfloat16, Adam does not move them (its bias correction is 0 there), and kmp says so."""
    import warnings

    x, y = _data()
    models, start = {}, None
    for policy, flat in (("bfloat16", True), ("mixed_bfloat16", True), ("bfloat16", False)):
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
        kmp.prepare(model, flat_buffers=flat)
        start = start or [w.astype("float32") for w in model.get_weights()]  # bfloat16 values: the same start
        model.set_weights(start)
        before = [np.array(v.numpy(), "float32") for v in model.trainable_variables]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        said = [str(r.message) for r in record if "weights in their own dtype" in str(r.message)]
        models[policy, flat] = model, before, said
    (mixed, _, _), (pure, _, pure_said) = models["mixed_bfloat16", True], models["bfloat16", True]
    assert {v.dtype for v in pure.trainable_variables} == {"bfloat16", "float32"}  # the output layer is float32
    masters = [engine.engine_of(m).buffers.buffers["weights"].numpy() for m in (mixed, pure)]
    np.testing.assert_allclose(masters[1], masters[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(pure.trainable_variables, mixed.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy().astype(a.dtype))
    assert pure_said == []
    stock, before, said = models["bfloat16", False]
    sixteen = [k for k, v in enumerate(stock.trainable_variables) if v.dtype == "bfloat16"]
    after = [np.array(v.numpy(), "float32") for v in stock.trainable_variables]
    _assert_close([before[k] for k in sixteen], [after[k] for k in sixteen], rtol=0, atol=0)
    assert len(said) == 1 and "kmp.prepare(model)'s flat buffers train them from float32 master weights" in said[0]


_SHARDS_HELD = """
import gc, json
import numpy as np, tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, kmp
from kmp.engine import engine
current = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
keras.utils.set_random_seed(0)
gc.collect()
before = current()
with strategy.scope():
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
kmp.prepare(model, flat_buffers=True)
x = np.ones((8, 512), "float32")
model.fit(x, x[:, :1], batch_size=8, verbose=0)
buffers = engine.engine_of(model).buffers
gc.collect()
estimate = kmp.memory_estimate(model)
print(json.dumps(dict(held=current() - before, variables=sum(vars(estimate.in_variables()).values()) * 2 + estimate.host,
                      parameters=sum(int(np.prod(v.shape)) for v in model.trainable_variables),
                      sharded=all(map(buffers.is_shard, buffers.buffers)))))
"""


def test_a_load_into_sharded_buffers_keeps_no_whole_copy_alive():
    """On CPUs of one process each replica's buffers hold a shard. A shard cut from the whole joined
    tensor shares its memory: a buffer holding it kept the whole alive, N times its size. Measured by
    TensorFlow's allocator in a process of its own (in the suite's, other tests' tensors come and go)."""
    out = subprocess.run([sys.executable, "-c", _SHARDS_HELD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["sharded"]
    # The shards of the weights and two slots held whole on both replicas: 6 half copies more (12 bytes each).
    assert found["held"] < found["variables"] + 2 * found["parameters"], found