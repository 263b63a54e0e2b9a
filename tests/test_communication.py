"""kmp.distribute.communication: flat buckets, communication dtype, pre-divide factor, on two real replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmp.config.settings import Communication
from kmp.distribute import communication
from kmp.distribute.communication import _buckets, all_reduce_sum
from kmp.errors import ConfigError
from kmp.scaling.optimizer import LossScaleOptimizer

SHAPES = [(3, 4), (5,), (2, 2, 2), (1,)]


def _local_grads(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=s) * scale).astype("float32") for s in SHAPES]


def _reduce_on_replicas(strategy, per_replica, communication=None, loss_scale=None):
    """all_reduce_sum inside strategy.run; returns each replica's result as numpy."""

    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [
                None if per_replica[0][k] is None else
                tf.switch_case(rid, [lambda g=g[k]: tf.constant(g) for g in per_replica])
                for k in range(len(per_replica[0]))
            ]
            out = all_reduce_sum(grads, communication, loss_scale)
            return [tf.zeros(()) if g is None else g for g in out]

        return strategy.run(fn)

    results = step()
    return [[r.numpy() for r in strategy.experimental_local_results(t)] for t in results]


@pytest.mark.parametrize("bytes_per_pack", [0, 40, 10**6])
def test_float32_flat_buckets_equal_the_plain_sum_bit_for_bit(two_replicas, bytes_per_pack):
    a, b = _local_grads(0), _local_grads(1)
    out = _reduce_on_replicas(two_replicas, [a, b], Communication(bytes_per_pack=bytes_per_pack))
    for k, per_replica in enumerate(out):
        for value in per_replica:  # the same on both replicas
            np.testing.assert_array_equal(value, a[k] + b[k])


def test_replicas_of_one_process_add_in_memory_and_others_use_the_collective(two_replicas, monkeypatch):
    assert communication.cpus_of_one_process(two_replicas)
    assert not communication.cpus_of_one_process(tf.distribute.get_strategy())
    a, b = _local_grads(0), _local_grads(1)
    in_memory = _reduce_on_replicas(two_replicas, [a, b])
    monkeypatch.setattr(communication, "cpus_of_one_process", lambda strategy: False)  # TensorFlow's all-reduce
    assert all(np.array_equal(u, v) for x, y in zip(in_memory, _reduce_on_replicas(two_replicas, [a, b]))
               for u, v in zip(x, y))


def test_none_gradients_pass_through(two_replicas):
    a, b = _local_grads(0), _local_grads(1)
    a[1] = b[1] = None
    out = _reduce_on_replicas(two_replicas, [a, b])
    np.testing.assert_array_equal(out[1][0], 0.0)  # the None placeholder
    np.testing.assert_array_equal(out[2][1], a[2] + b[2])


def test_buckets_group_consecutive_tensors_up_to_the_byte_limit():
    grads = [tf.zeros(s) for s in [(4,), (4,), (10,), (1,), (1,)]]
    assert _buckets(grads, 4, 0) == [[0, 1, 2, 3, 4]]
    assert _buckets(grads, 4, 32) == [[0, 1], [2], [3, 4]]  # a larger tensor is its own bucket
    assert _buckets(grads, 2, 32) == [[0, 1], [2, 3, 4]]  # half the bytes in float16
    assert _buckets([], 4, 0) == []


def test_predivide_factor_gives_the_same_sum(two_replicas):
    a, b = _local_grads(0), _local_grads(1)
    out = _reduce_on_replicas(two_replicas, [a, b], Communication(predivide_factor=8.0))
    for k, per_replica in enumerate(out):
        np.testing.assert_allclose(per_replica[0], a[k] + b[k], rtol=1e-6)
        np.testing.assert_array_equal(per_replica[0], per_replica[1])


def test_float16_sends_scaled_gradients_so_small_ones_survive(two_replicas):
    """1e-8 underflows float16 (its smallest subnormal is 6e-8); times a loss scale of 2**15 it does not."""
    a, b = _local_grads(0, scale=1e-8), _local_grads(1, scale=1e-8)
    out = _reduce_on_replicas(two_replicas, [a, b], Communication(dtype="float16"), loss_scale=2.0**15)
    for k, per_replica in enumerate(out):
        np.testing.assert_allclose(per_replica[0], a[k] + b[k], rtol=2e-3, atol=1e-12)
        np.testing.assert_array_equal(per_replica[0], per_replica[1])
    assert tf.cast(tf.constant(a[0]), tf.float16).numpy().max() == 0.0  # without the scale: all zeros


def test_bfloat16_communication_sums_the_gradients_rounded_to_bfloat16(two_replicas):
    a, b = _local_grads(0), _local_grads(1)
    out = _reduce_on_replicas(two_replicas, [a, b], Communication(dtype="bfloat16"))
    for k, per_replica in enumerate(out):
        # Each replica's gradient travels in bfloat16 and is summed there; float32 again after.
        sent = [tf.cast(tf.constant(g[k]), tf.bfloat16) for g in (a, b)]
        expected = tf.cast(tf.add_n(sent), tf.float32).numpy()
        assert not np.array_equal(expected, a[k] + b[k])  # bfloat16's rounding shows
        for value in per_replica:  # every replica gets the same sum
            np.testing.assert_array_equal(value, expected)


def test_a_float16_overflow_in_communication_skips_the_step(two_replicas):
    """Scaled gradients whose sum exceeds float16's range: inf, caught after the reduce."""
    with two_replicas.scope():
        weight = keras.Variable(np.ones(2, "float32"))
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10, log_overflows=False,
                                 communication={"dtype": "float16"})
        opt.build([weight])

    @tf.function
    def step(g):
        two_replicas.run(lambda: opt.apply([g], [weight]))

    # Tensors, not Python lists: both steps run one trace (a list's values would each trace anew).
    step(tf.constant([40000.0, 1.0]))  # each replica: 40000 (scaled); the sum 80000 > 65504
    assert int(opt.skipped_steps.numpy()) == 1 and float(opt.dynamic_scale.numpy()) == 2.0**9
    np.testing.assert_array_equal(weight.numpy(), [1.0, 1.0])
    step(tf.constant([2.0**10, 2.0**10]))  # unscaled: 1 per replica, summed to 2 -> the weight moves by 0.2
    for value in two_replicas.experimental_local_results(weight.value):
        np.testing.assert_allclose(value.numpy(), [0.6, 0.6], rtol=1e-6)


def test_communication_settings_round_trip_and_bad_values_name_their_path():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), communication={"dtype": "bfloat16", "bytes_per_pack": 1024})
    config = opt.get_config()
    assert config["communication"] == {"dtype": "bfloat16", "bytes_per_pack": 1024, "predivide_factor": None}
    assert LossScaleOptimizer.from_config(config).communication == opt.communication
    with pytest.raises(ConfigError) as info:
        LossScaleOptimizer(keras.optimizers.SGD(0.1), communication={"dtype": "fp8", "predivide_factor": -1})
    message = str(info.value)
    assert "communication.dtype" in message and "'float32', 'float16', 'bfloat16'" in message
    assert "communication.predivide_factor" in message
    with pytest.raises(ConfigError, match="communication.bucket"):
        LossScaleOptimizer(keras.optimizers.SGD(0.1), communication={"bucket": 1})
