"""ZeRO stage 1 on the flat buffers (kmp.engine.buffers): the optimizer state in shards, the same training.

Each test trains the same model from the same seed on the flat-buffer
engine under MirroredStrategy on two logical CPUs, at `zero_stage=0` and
`zero_stage=1`, and compares: the update math is the same element by
element, so weights, slots and the loss-scale state agree bit for bit.
"""

import json
import logging
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import engine
from kmp.engine import zero
from parity import assert_same_update, trainable
from test_engine import _WithUnused, _data, _Interrupt, _model, _raw, _trained


def _pair(two_replicas, optimizer="adamw", epochs=2, policy="float32", **wrap_args):
    """The same run at stage 0 and stage 1: (models, loss histories)."""
    keras.config.set_dtype_policy(policy)
    runs = [_trained(True, two_replicas, optimizer, epochs=epochs, wrap_args={**wrap_args, "zero_stage": stage})
            for stage in (0, 1)]
    return [m for m, _ in runs], [h["loss"] for _, h in runs]


def _assert_same(a, b, eight_bit=False):
    """Bit for bit; with 8-bit states, within the issue's 1e-6 relative: XLA fuses the quantizing
    update of a shard differently from the whole buffer's, an ulp here and there."""
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if not eight_bit:
            np.testing.assert_array_equal(u, v)
        elif u.dtype == np.uint8:  # a code may move to its neighbour, rarely
            assert np.abs(u.astype(int) - v).max(initial=0) <= 1 and np.mean(u != v) <= 0.02
        else:
            np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-9)


_ADAM_ACCUMULATED = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5}


@pytest.fixture(scope="module")
def adam_accumulated(two_replicas):
    """_pair of Adam with windows of 2 and clipping, 2 epochs: ((whole, sharded), losses). Read only:
    the stage 1 run is also the uninterrupted reference and the saved model of the tests below."""
    policy = keras.config.dtype_policy()
    try:
        return _pair(two_replicas, "adam", epochs=2, **_ADAM_ACCUMULATED)
    finally:
        keras.config.set_dtype_policy(policy)


@pytest.mark.parametrize("optimizer, epochs, wrap_args", [
    # Weight decay: a prefix of the buffer, split across the shards. A hundred steps: the issue's
    # bar is 1e-6 relative after 100 steps; the math is the same, so it is exact.
    ("adamw", 17, {}),
    ("adam", 2, _ADAM_ACCUMULATED),  # the adam_accumulated fixture
    # (SGD, Lion, Adagrad: their flat rules are tested in test_engine; sharding does not depend on the rule.)
    ("adamw8bit", 2, {"gradient_accumulation_steps": 2}),  # codes and scales, sharded by whole blocks
])
def test_stage_1_trains_as_stage_0(two_replicas, request, optimizer, epochs, wrap_args):
    (whole, sharded), (whole_loss, sharded_loss) = (
        request.getfixturevalue("adam_accumulated") if optimizer == "adam" else
        _pair(two_replicas, optimizer, epochs=epochs, **wrap_args))
    # 6 steps an epoch, a step per window of accumulation.
    assert sharded.optimizer.iterations.numpy() == 6 * epochs // wrap_args.get("gradient_accumulation_steps", 1)
    buffers = engine.engine_of(sharded).buffers
    # On the two logical CPUs (replicas of one process) both step the flat buffers in shards, with Keras's copy of
    # the slots once in host memory.
    assert buffers.layout.sharded and engine.engine_of(whole).buffers.layout.sharded
    assert buffers.layout.slots_on_host and engine.engine_of(whole).buffers.layout.slots_on_host
    local = two_replicas.experimental_local_results
    # 161 parameters, padded to whole units of 16 elements (kmp.engine.buffers, ALIGN): 176,
    # and two shards of 96. In blocks of 8 (8-bit states) each variable is padded
    # to whole blocks first, except the variables that keep float32 states (min_8bit_size): their 65
    # elements come first, padded to 80; then the kernel's 96 and the same shards. One scale per block;
    # the float32 slots and the kept run's own weights cover the first run only, which the first shard holds.
    size, shard = 176, 96
    kept = {"momentum": 80, "velocity": 80, "kept_weights": 80} if optimizer == "adamw8bit" else {}
    assert set(kept) <= set(buffers.buffers)
    # Replicas of one process (logical CPUs) hold the weights in shards too (kmp.engine.buffers, weight_shards).
    assert buffers.layout.name == "shared shards"
    for name, variable in buffers.buffers.items():
        in_shards = name in buffers.slot_names or name in ("weights", "kept_weights")
        # The sums add up the flat gradient, zero padded to two whole shards (kmp.engine.buffers, `length`).
        whole_length = 2 * shard if name == "sums" else size
        expected = ([whole_length] if not in_shards else [shard // 8] if "scales" in name else
                    [kept.get(name, shard)])
        assert [c.shape.as_list() for c in local(variable)] == [expected, expected], name
    _assert_same(_raw(whole), _raw(sharded), eight_bit=optimizer == "adamw8bit")  # slots: gathered back
    np.testing.assert_allclose(whole_loss, sharded_loss, rtol=1e-6 if optimizer == "adamw8bit" else 0)


def test_overflows_skip_on_every_shard_and_the_scale_moves_the_same(two_replicas):
    x, y = _data()
    x[9] = 1e5  # overflows float16 on replica 0 only
    keras.config.set_dtype_policy("mixed_float16")
    runs = []
    for stage in (0, 1):
        # The input overflows the forward pass: "backoff" halves the scale there (the default raises).
        model = kmp.prepare(_model(two_replicas, "adam", zero_stage=stage, initial_scale=2.0**20,
                                   forward_overflow="backoff"), flat_buffers=True)
        scales = []
        trace = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs, m=model: scales.append(float(m.optimizer.dynamic_scale.numpy())))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[trace])
        runs.append((model, scales))
    (whole, whole_scales), (sharded, sharded_scales) = runs
    assert sharded.optimizer.skipped_steps.numpy() == whole.optimizer.skipped_steps.numpy() >= 2
    assert sharded_scales == whole_scales and len(set(sharded_scales)) > 1
    assert all(np.isfinite(w).all() for w in sharded.get_weights())
    _assert_same(_raw(whole), _raw(sharded))


@pytest.mark.parametrize("eight_bit", [False, True])
def test_a_variable_without_gradient_is_left_alone_on_its_shard(two_replicas, eight_bit):
    runs = []
    for stage in (0, 1):
        keras.utils.set_random_seed(0)
        with two_replicas.scope():
            model = _WithUnused()
            model(np.zeros((1, 6), "float32"))
            # 8-bit: the unused kernel (18 elements) quantized, its bias kept in float32 (min_8bit_size).
            inner = (kmp.AdamW8bit(1e-2, weight_decay=0.1, block_size=8, min_8bit_size=10) if eight_bit else
                     keras.optimizers.AdamW(1e-2, weight_decay=0.1))
            model.compile(optimizer=kmp.LossScaleOptimizer(inner, zero_stage=stage), loss="mse")
            model.optimizer.build(model.trainable_variables)
        # Moments left from earlier training: an update of this variable would move them.
        slots = [getattr(inner, name)[inner._get_variable_index(v)] for v in model.unused.weights
                 for name in (("_moment_codes", "_moment_scales") if eight_bit and len(v.shape) == 2 else
                              ("_momentums",))]
        for slot in slots:
            slot.assign(np.full(slot.shape, 200 if slot.dtype == "uint8" else 0.5, slot.dtype))
        initial = [np.array(v) for v in model.unused.weights + slots]
        kmp.prepare(model, flat_buffers=True).fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert engine.engine_of(model).buffers.layout.slots_on_host  # replicas of one process: at both stages
        # Its weights and its slots (8-bit: codes and the scales of its blocks) as they were.
        for before, after in zip(initial, model.unused.weights + slots):
            np.testing.assert_array_equal(np.array(after), before)
        runs.append(_raw(model))
    _assert_same(*runs, eight_bit=eight_bit)


# --- Checkpoints hold the whole state ----------------------------------------------


def test_a_keras_file_saved_on_two_replicas_resumes_on_one_device_and_back(tmp_path, two_replicas, adam_accumulated):
    (whole, sharded), _ = adam_accumulated
    sharded.save(tmp_path / "sharded.keras")
    # On one device: the whole optimizer state, as the unsharded run holds it.
    one = keras.models.load_model(tmp_path / "sharded.keras")
    assert one.optimizer.zero_stage == 1  # kept: on one replica there is one shard, the whole
    _assert_same(_raw(whole), _raw(one))
    # And back: saved on one device, resumed on two replicas at stage 1 exactly as at stage 0.
    keras.config.set_dtype_policy("float32")
    for stage in (0, 1):
        model, _ = _trained(True, None, "adam", epochs=1, wrap_args={"zero_stage": stage})
        model.save(tmp_path / f"one_{stage}.keras")
    continued = []
    for stage in (0, 1):
        with two_replicas.scope():
            model = keras.models.load_model(tmp_path / f"one_{stage}.keras")
        kmp.prepare(model, flat_buffers=True).fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert engine.engine_of(model).buffers.layout.slots_on_host  # replicas of one process: at both stages
        continued.append(_raw(model))
    _assert_same(*continued)


@pytest.mark.parametrize("optimizer", ["adam", "adamw8bit"])
def test_a_tf_checkpoint_restores_every_shard(tmp_path, two_replicas, optimizer):
    sharded, _ = _trained(True, two_replicas, optimizer, epochs=1, wrap_args={"zero_stage": 1})
    path = tf.train.Checkpoint(model=sharded, optimizer=sharded.optimizer).write(str(tmp_path / "ckpt"))
    restored = _model(two_replicas, optimizer, zero_stage=1)
    with two_replicas.scope():
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(path).assert_existing_objects_matched()
    _assert_same(_raw(sharded), _raw(restored))
    # The shards are loaded from the restored variables before the next step: both go on alike.
    for model in (sharded, restored):
        kmp.prepare(model, flat_buffers=True).fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same(_raw(sharded), _raw(restored))


def test_a_store_of_the_weights_joins_no_slot_shards(adam_accumulated):
    """Validation and the model's readers store the weights only (kmp.engine.buffers.WEIGHT_BUFFERS):
    only the weights' shards are joined for them."""
    buffers = engine.engine_of(adam_accumulated[0][1]).buffers
    assert set(zero.whole_shards(buffers, ("weights",))) == {"weights"}
    assert set(zero.whole_shards(buffers, tuple(buffers.buffers))) == {"weights", "momentum", "velocity"}


def test_kmp_backup_resumes_exactly_at_stage_1(tmp_path, two_replicas, adam_accumulated):
    from kmp.callbacks.backup import BackupAndRestore

    def job(directory, interrupt=False):
        model = kmp.prepare(_model(two_replicas, "adam", **_ADAM_ACCUMULATED, zero_stage=1), flat_buffers=True)
        callbacks = [BackupAndRestore(str(directory), save_freq=3)] + ([_Interrupt()] if interrupt else [])
        try:
            model.fit(*_data(), batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        except KeyboardInterrupt:
            return None
        assert engine.engine_of(model).buffers.layout.slots_on_host
        return _raw(model)

    keras.config.set_dtype_policy("float32")
    (_, whole), _ = adam_accumulated  # the same job, uninterrupted (without backups)
    assert job(tmp_path / "cut", interrupt=True) is None
    _assert_same(_raw(whole), job(tmp_path / "cut"))


# --- Settings, and where stage 1 does not apply -----------------------------------------


def test_wrap_and_a_deepspeed_config_turn_it_on(two_replicas):
    with two_replicas.scope():
        assert kmp.wrap(keras.optimizers.Adam(), zero_stage=1, precision="bf16").zero_stage == 1
        assert kmp.wrap(keras.optimizers.Adam(), {"zero_optimization": {"stage": 1}}, precision="fp16").zero_stage == 1
        with pytest.warns(UserWarning, match="kmp uses stage 1"):
            assert kmp.wrap(keras.optimizers.Adam(), {"zero_optimization": {"stage": 3}},
                            precision="fp16").zero_stage == 1
        assert kmp.wrap(keras.optimizers.Adam(), precision="fp16").zero_stage == 0
    config = kmp.LossScaleOptimizer(keras.optimizers.Adam(), zero_stage=1).get_config()
    assert kmp.LossScaleOptimizer.from_config(config).zero_stage == 1


@pytest.mark.parametrize("stage", [2, -1, True, 1.0, "1"])
def test_the_optimizer_takes_stage_0_or_1(stage):
    with pytest.raises(kmp.ConfigError, match=r"zero_stage: expected an integer from 0 to 1.*Received: "
                                              r"zero_stage=.*kmp builds ZeRO stage 1"):
        kmp.LossScaleOptimizer(keras.optimizers.Adam(), zero_stage=stage)


def test_without_the_flat_buffers_it_says_the_state_stays_whole(two_replicas):
    keras.config.set_dtype_policy("float32")
    with pytest.warns(UserWarning, match="every replica keeps the whole optimizer state") as record:
        model = _model(two_replicas, "adam", zero_stage=1)  # not prepared
        model.fit(*_data(), batch_size=8, epochs=2, verbose=0)
    assert len([r for r in record if "zero_stage=1" in str(r.message)]) == 1  # once


def test_lamb_keeps_whole_variables_and_says_why(two_replicas, caplog):
    with caplog.at_level(logging.WARNING, logger="kmp.engine.prepare"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = _trained(True, two_replicas, "lamb", epochs=1, wrap_args={"zero_stage": 1})
    assert engine.engine_of(model) is None
    assert "Lamb's trust ratio needs each variable whole" in caplog.text
    stock = _model(two_replicas, "lamb", stock=True)
    initial = trainable(stock)
    stock.fit(*_data(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_same_update(initial, trainable(stock), trainable(model), rtol=1e-4)  # 2e-7 apart here


def test_each_replica_device_holds_half_the_state_and_keras_copy_is_in_host_memory(two_replicas):
    (whole, sharded), _ = _pair(two_replicas, "adam", epochs=1)
    slots = lambda model: [*model.optimizer.inner_optimizer._momentums, *model.optimizer.inner_optimizer._velocities]
    # Replicas of one process hold Keras's copy once at stage 0 too (kmp.engine.layout, SharedShards).
    for model in (whole, sharded):
        assert all(zero.on_host(v) and v.value.device == zero.host(two_replicas) for v in slots(model))

    def state_bytes(model, device):
        """Optimizer-state bytes on `device`: Keras's slot variables and the flat buffers' slots."""
        buffers = engine.engine_of(model).buffers
        variables = [v.value for v in slots(model)] + [buffers.buffers[n] for n in buffers.slot_names]
        return sum(c.numpy().nbytes for v in variables for c in two_replicas.experimental_local_results(v)
                   if tf.DeviceSpec.from_string(c.device) == tf.DeviceSpec.from_string(device))

    # 161 parameters, Adam: 1288 bytes of state per replica on the per-variable path. On these
    # replicas of one process the flat buffers are in shards of 96 (176 elements: whole units of 16), and
    # Keras's copy is held once in host memory, at both stages.
    replica_1 = "/job:localhost/replica:0/task:0/device:CPU:1"
    assert (state_bytes(whole, replica_1), state_bytes(sharded, replica_1)) == (8 * 96, 8 * 96)
    for model in (whole, sharded):  # replica 0's device is the host here
        assert state_bytes(model, zero.host(two_replicas)) == 1288 + 8 * 96
    # Keras's per-variable update needs the slots on every replica: they go back, and to the host again.
    for flat_buffers in (False, True):
        for model in (whole, sharded):
            kmp.prepare(model, flat_buffers=flat_buffers).fit(*_data(), batch_size=8, epochs=1, shuffle=False,
                                                              verbose=0)
        assert all(zero.on_host(v) == flat_buffers for v in slots(sharded) + slots(whole))
        _assert_same(_raw(whole), _raw(sharded))


_HOST_APART = """
import json
import tensorflow as tf
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 3)
import keras, numpy as np, kmp
from kmp.engine import engine

strategy = tf.distribute.MirroredStrategy(["/cpu:1", "/cpu:2"])  # CPU:0, the host, holds no replica
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-3), zero_stage=1), loss="mse")
x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
kmp.prepare(model, flat_buffers=True).fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
inner, buffers = model.optimizer.inner_optimizer, engine.engine_of(model).buffers
state = [v.value for v in inner._momentums + inner._velocities] + [buffers.buffers[n] for n in buffers.slot_names]
held = {}
for variable in state:
    for c in strategy.experimental_local_results(variable):
        device = tf.DeviceSpec.from_string(c.device).device_index
        held[device] = held.get(device, 0) + c.numpy().nbytes
print(json.dumps(held))
"""


@pytest.mark.slow
def test_with_the_host_apart_from_the_replicas_each_replica_device_holds_half_the_state():
    # As on a machine of accelerators: three logical CPUs, replicas on CPU:1 and CPU:2, the host CPU:0.
    done = subprocess.run([sys.executable, "-c", _HOST_APART], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    held = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    # 129 parameters, Adam: 8 * 129 = 1032 bytes of state unsharded; the flat buffers hold 144
    # (whole units of 16), a shard 80 elements.
    assert held == {0: 1032, 1: 8 * 80, 2: 8 * 80}


def test_one_device_has_one_shard(two_replicas):
    model, _ = _trained(True, None, "adam", epochs=1, wrap_args={"zero_stage": 1})
    buffers = engine.engine_of(model).buffers
    assert not buffers.layout.sharded and not buffers.layout.slots_on_host and buffers.shard == buffers.size


def test_wrap_says_once_where_it_does_not_run_the_stage_asked(two_replicas):
    """Stages 2 and 3 run as stage 1, said as for a config's zero_optimization.stage; outside a strategy's scope
    the optimizer still carries stage 1 (it shards once trained under one), and that is said."""
    keras.config.set_dtype_policy("float32")
    for stage in (2, 3):
        with two_replicas.scope(), pytest.warns(UserWarning) as record:
            assert kmp.wrap(keras.optimizers.Adam(), zero_stage=stage).zero_stage == 1
        assert [str(r.message) for r in record] == [
            f"zero_stage is {stage}: {kmp.config.deepspeed._ZERO_STAGES[stage]}. The training is the same; "
            "the memory saved is less."]
    with pytest.warns(UserWarning) as record:
        outside = kmp.wrap(keras.optimizers.Adam(), zero_stage=1)
    assert len(record) == 1 and "outside a strategy's scope (one replica): zero_stage=1" in str(record[0].message)
    assert isinstance(outside, kmp.LossScaleOptimizer) and outside.zero_stage == 1
