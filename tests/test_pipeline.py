"""kmp.input_pipeline: the batch arithmetic of the strategy and the config, and its errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp


def _examples(n=96, features=4):
    x = np.arange(n * features, dtype="float32").reshape(n, features)
    return tf.data.Dataset.from_tensor_slices((x, np.arange(n, dtype="int64")))


def test_one_device_batches_by_the_micro_batch_and_shuffles_the_same_way_every_time():
    data = kmp.input_pipeline(_examples(), micro_batch_size=8, seed=3)
    batches = [y.numpy() for _, y in data]
    assert [len(b) for b in batches] == [8] * 12
    assert [y.numpy().tolist() for _, y in kmp.input_pipeline(_examples(), micro_batch_size=8, seed=3)][0] == \
        batches[0].tolist()  # the same seed: the same order (every worker draws the same global batches)
    assert sorted(np.concatenate(batches).tolist()) == list(range(96))
    assert data.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA


def test_the_last_short_batch_is_dropped_by_default():
    assert [len(y) for _, y in kmp.input_pipeline(_examples(20), micro_batch_size=8, shuffle=None)] == [8, 8]
    kept = kmp.input_pipeline(_examples(20), micro_batch_size=8, shuffle=None, drop_remainder=False)
    assert [len(y) for _, y in kept] == [8, 8, 4]


def test_under_mirrored_strategy_each_replica_gets_its_micro_batch(two_replicas):
    config = {"train_batch_size": 32, "gradient_accumulation_steps": 2}  # micro = 32 / 2 replicas / 2 = 8
    data = kmp.input_pipeline(_examples(), config, strategy=two_replicas, shuffle=None)
    first = next(iter(data))
    assert first[0].shape == (16, 4)  # the per-step global batch: 8 x 2 replicas
    shares = two_replicas.experimental_local_results(next(iter(two_replicas.experimental_distribute_dataset(data)))[1])
    assert [s.numpy().tolist() for s in shares] == [list(range(8)), list(range(8, 16))]


def test_fit_under_mirrored_strategy_takes_it_with_kmps_accumulation(two_replicas):
    keras.config.set_dtype_policy("mixed_float16")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "fp16": {"enabled": True}}
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(1e-4), config), loss="mse")
    kmp.prepare(model)
    data = kmp.input_pipeline(_examples(), config, model=model).map(lambda x, y: (x / 400.0, tf.cast(y, "float32")))
    model.fit(data, epochs=1, verbose=0)
    # 96 examples / (4 x 2 replicas) = 12 micro-steps = 4 optimizer steps of 3 micro-batches.
    assert int(model.optimizer.iterations.numpy()) == 4


def test_batch_sizes_that_do_not_multiply_out_are_deepspeeds_error(two_replicas):
    with pytest.raises(kmp.ConfigError, match=r"train_batch_size.*8 \* 2 \* 2 = 32.*Received: train_batch_size=30"):
        kmp.input_pipeline(_examples(), {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8,
                                         "gradient_accumulation_steps": 2}, strategy=two_replicas)


def test_a_model_that_accumulates_differently_is_an_error():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1), gradient_accumulation_steps=4), loss="mse")
    with pytest.raises(kmp.ConfigError, match=r"gradient_accumulation_steps: expected the model's optimizer's value, "
                                              r"4. Received: gradient_accumulation_steps=2"):
        kmp.input_pipeline(_examples(), micro_batch_size=8, gradient_accumulation_steps=2, model=model)


@pytest.mark.parametrize("batched", [
    lambda d: d.batch(8), lambda d: d.batch(8).map(lambda x, y: (x, y)).prefetch(2),
    lambda d: d.padded_batch(8), lambda d: tf.data.Dataset.zip((d.batch(8), d.batch(8))),
])
def test_an_already_batched_dataset_is_an_error(batched):
    with pytest.raises(kmp.ConfigError, match=r"dataset: expected an unbatched dataset.*Pass it from before .batch"):
        kmp.input_pipeline(batched(_examples()), micro_batch_size=8)


def test_a_batched_then_unbatched_dataset_is_taken():
    data = kmp.input_pipeline(_examples().batch(5).unbatch(), micro_batch_size=8, shuffle=None)
    assert [len(y) for _, y in data] == [8] * 12


def test_fewer_examples_than_one_global_batch_is_an_error(two_replicas):
    with pytest.raises(kmp.ConfigError, match=r"at least one global batch of 32 examples \(16 per replica x 2 "
                                              r"replicas\). Received: dataset='20 examples'"):
        kmp.input_pipeline(_examples(20), micro_batch_size=16, strategy=two_replicas)


def test_no_batch_size_at_all_is_an_error():
    with pytest.raises(kmp.ConfigError, match="train_batch_size or train_micro_batch_size_per_gpu"):
        kmp.input_pipeline(_examples())
