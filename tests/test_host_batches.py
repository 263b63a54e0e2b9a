"""kmp.engine.host_batches: under MirroredStrategy on CPU devices, a prepared model's fit() and evaluate()
read global batches from a plain iterator and split them in the step, training exactly as on
tf.distribute's per-replica iterator; what they cannot split keeps that iterator.

The time it saves per fit() is measured in benchmarks/p1_fit_parts.py, not here.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp import seams
from kmp.engine import engine, host_batches, iterators, replica_step

ROWS = 149  # batches of 64, 64 and 21: the last one splits 11 / 10


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    return x, rng.normal(size=(ROWS, 1)).astype("float32"), rng.uniform(size=(ROWS,)).astype("float32")


class _Rows(keras.metrics.Metric):
    """The rows a step saw, summed over replicas."""

    def __init__(self):
        super().__init__(name="rows")
        self.rows = self.add_variable((), initializer="zeros", name="rows")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.rows.assign_add(tf.cast(tf.shape(y_true)[0], self.rows.dtype))

    def result(self):
        return self.rows


def _train(strategy, monkeypatch, on_host, flat, steps_per_execution):
    """Weights and logs after two epochs; the kinds of iterator the train function was handed."""
    made = []
    make = iterators._Deferred.made

    def recorded(self, on_host=False):
        iterator = make(self, on_host)
        made.append(type(iterator))
        return iterator

    with monkeypatch.context() as patch:
        patch.setattr(iterators._Deferred, "made", recorded)
        if not on_host:
            patch.setattr(host_batches, "possible", lambda strategy: False)
        keras.config.set_dtype_policy("float32")
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(1)])
            model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)), loss="mse", metrics=["mae", _Rows()],
                          steps_per_execution=steps_per_execution)
        kmp.prepare(model, flat_buffers=flat)
        x, y, weights = _data()
        model.fit(x[:64], y[:64], batch_size=64, verbose=0)  # built here (it draws a batch for the shapes)
        made.clear()
        history = model.fit(x, y, sample_weight=weights, batch_size=64, epochs=2, verbose=0)
    return model.get_weights(), history.history, made


@pytest.mark.parametrize("flat, steps_per_execution", [(True, 1), (False, 1), (True, 2)])
def test_fit_splits_host_batches_in_the_step_exactly_as_tf_distribute(two_replicas, monkeypatch, flat,
                                                                      steps_per_execution):
    split = _train(two_replicas, monkeypatch, True, flat, steps_per_execution)
    distributed = _train(two_replicas, monkeypatch, False, flat, steps_per_execution)
    assert split[2] and all(issubclass(t, tf.data.Iterator) for t in split[2]), split[2]
    assert distributed[2] and all(issubclass(t, tf.distribute.DistributedIterator) for t in distributed[2])
    assert split[1] == distributed[1] and split[1]["rows"] == [ROWS, ROWS]  # each row once an epoch
    for a, b in zip(split[0], distributed[0]):
        np.testing.assert_array_equal(a, b)


def test_shares_are_rows_in_order_and_only_equal_shares_have_a_static_size(two_replicas):
    local = two_replicas.experimental_local_results
    first, second = local(host_batches.split(two_replicas, (tf.reshape(tf.range(10.0), (5, 2)), None))[0])
    np.testing.assert_array_equal(first, [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(second, [[6, 7], [8, 9]])
    # kmp.engine.replica_step.row_weight reads a static row count as "equal shares", an unknown
    # one as "weigh by the rows": five rows on two replicas must not look equal.
    traced = []

    @tf.function
    def shares(x):
        traced.append([v.shape[0] for v in local(host_batches.split(two_replicas, (x,))[0])])

    shares(tf.zeros((5, 2)))
    shares(tf.zeros((4, 2)))
    shares.get_concrete_function(tf.TensorSpec((None, 2)))
    assert traced == [[None, None], [2, 2], [None, None]]


def test_what_cannot_be_split_in_the_step_keeps_tf_distributes_iterator(two_replicas):
    dense = tf.data.Dataset.from_tensor_slices((np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32"))).batch(4)
    assert host_batches.undistributed(two_replicas, two_replicas.experimental_distribute_dataset(dense)) is dense
    with_options = two_replicas.experimental_distribute_dataset(
        dense, tf.distribute.InputOptions(experimental_fetch_to_device=False))
    from_function = two_replicas.distribute_datasets_from_function(lambda context: dense)
    sparse = tf.data.Dataset.from_tensors(tf.sparse.from_dense(tf.eye(4)))
    one_device = tf.distribute.get_strategy()
    assert host_batches.undistributed(two_replicas, with_options) is None
    assert host_batches.undistributed(two_replicas, from_function) is None
    assert host_batches.undistributed(two_replicas, two_replicas.experimental_distribute_dataset(sparse)) is None
    assert not host_batches.possible(one_device)
    assert host_batches.possible(two_replicas)


def test_evaluate_leaves_the_train_functions_path_and_buffers_alone(two_replicas, caplog):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    kmp.prepare(model, flat_buffers=True)
    x, y, _ = _data()
    model.fit(x, y, batch_size=64, verbose=0)
    path, buffers = replica_step.describe_path(model), engine.engine_of(model)
    with caplog.at_level(logging.INFO, logger="kmp"):
        model.evaluate(x, y, verbose=0)
    # evaluate() once said "flat buffers off ... the model has its own train_step" and copied the
    # buffers out and the slots back to every replica, to be loaded again by the next fit().
    assert not [r for r in caplog.records if "flat buffers off" in r.getMessage()]
    assert replica_step.describe_path(model) == path and path.startswith("flat buffers")
    assert engine.engine_of(model) is buffers and buffers.state != engine.KERAS


def test_evaluate_splits_host_batches_exactly_as_tf_distribute(two_replicas, monkeypatch):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)), loss="mse",
                      metrics=["mae", _Rows()])
    kmp.prepare(model)
    x, y, weights = _data()
    model.fit(x, y, batch_size=64, verbose=0)
    made = []
    make = iterators._Deferred.made
    monkeypatch.setattr(iterators._Deferred, "made", lambda self, on_host=False: made.append(
        type(make(self, on_host))) or self._iterator)
    split = model.evaluate(x, y, sample_weight=weights, batch_size=64, verbose=0, return_dict=True)
    assert made and all(issubclass(t, tf.data.Iterator) for t in made), made
    monkeypatch.setattr(host_batches, "possible", lambda strategy: False)
    model.test_function = None
    distributed = model.evaluate(x, y, sample_weight=weights, batch_size=64, verbose=0, return_dict=True)
    assert issubclass(made[-1], tf.distribute.DistributedIterator)
    assert split == distributed and split["rows"] == ROWS  # each row once, on one replica


def _counting(strategy, monkeypatch) -> list:
    """The datasets `strategy` distributes from now on (this test's strategy object only)."""
    distributed, stock = [], strategy.experimental_distribute_dataset

    def counted(dataset, *args, **kwargs):
        distributed.append(dataset)
        return stock(dataset, *args, **kwargs)

    monkeypatch.setattr(strategy, "experimental_distribute_dataset", counted)
    return distributed


@pytest.mark.parametrize("flat", [True, False])
def test_a_built_model_trains_and_evaluates_without_distributing_its_data(two_replicas, monkeypatch, flat):
    x, y, _ = _data()
    histories, weights_after = [], []
    for handed in (True, False):
        with monkeypatch.context() as patch:
            if not handed:  # Keras's own path: fit() and evaluate() distribute their data
                patch.setattr(host_batches, "hand_over", lambda *args, **kwargs: None)
            keras.config.set_dtype_policy("float32")
            with two_replicas.scope():
                keras.utils.set_random_seed(1)
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                          keras.layers.Dense(2)])
                model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[_Rows()])
            kmp.prepare(model, flat_buffers=flat)
            labels = (y[:, 0] > 0).astype("int32")
            model.fit(x[:64], labels[:64], batch_size=64, verbose=0)  # built (a batch drawn for the shapes)
            distributed = _counting(two_replicas, patch)
            history = model.fit(x, labels, class_weight={0: 1.0, 1: 2.0}, batch_size=64,
                                epochs=2, validation_data=(x[:40], labels[:40]), verbose=0)
            logs = model.evaluate(x, labels, batch_size=32, verbose=0, return_dict=True)
            assert (not distributed) if handed else len(distributed) == 3, distributed
            histories.append((history.history, logs))
            weights_after.append(model.get_weights())
    assert histories[0] == histories[1] and histories[0][1]["rows"] == ROWS
    for a, b in zip(*weights_after):
        np.testing.assert_array_equal(a, b)


def test_keras_splits_validation_data_off_arrays_and_distributes_them(two_replicas, monkeypatch):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)), loss="mse", metrics=[_Rows()])
    kmp.prepare(model)
    x, y, _ = _data()
    model.fit(x, y, batch_size=64, verbose=0)
    distributed = _counting(two_replicas, monkeypatch)
    model.fit(x, y, batch_size=64, validation_split=0.2, verbose=0)
    assert len(distributed) == 2  # the training and the validation data, as fit() split them


def test_a_dataset_handed_over_is_distributed_when_something_reads_it(two_replicas, monkeypatch):
    dense = tf.data.Dataset.from_tensor_slices((np.arange(16, dtype="float32").reshape(8, 2),)).batch(4)
    distributed = _counting(two_replicas, monkeypatch)
    handed = host_batches._Undistributed(two_replicas, dense)
    assert isinstance(handed, tf.distribute.DistributedDataset) and not distributed
    assert host_batches.undistributed(two_replicas, handed) is dense and not distributed
    first = next(iter(handed))  # read: distributed now, once
    assert distributed == [dense] and handed.element_spec == two_replicas.experimental_distribute_dataset(
        dense).element_spec
    shares = two_replicas.experimental_local_results(first[0])
    np.testing.assert_array_equal(shares[0], [[0, 1], [2, 3]])
    np.testing.assert_array_equal(shares[1], [[4, 5], [6, 7]])


def test_the_handed_adapter_is_kerass_own_but_for_its_dataset(two_replicas):
    x, y, _ = _data()
    handed = host_batches._adapter(two_replicas, x, y, None, 64, None, False, None)
    own = seams.get("get_data_adapter")(x, y, batch_size=64)  # Keras's own, to compare with
    assert (handed.num_batches, handed.batch_size, handed.has_partial_batch, handed.partial_batch_size) == (
        own.num_batches, own.batch_size, own.has_partial_batch, own.partial_batch_size) == (3, 64, True, ROWS - 128)
    assert isinstance(handed.get_tf_dataset(), host_batches._Undistributed)
    first = next(handed.get_numpy_iterator())
    np.testing.assert_array_equal(first[0], x[:64])
    handed.on_epoch_begin()
    handed.on_epoch_end()


class _OwnFit(keras.Sequential):
    """A model class whose fit() takes other arguments and calls Keras's through super(), as keras-hub's tasks do."""

    def fit(self, x=None, y=None, **kwargs):
        return super().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), **kwargs)


def test_a_fit_of_the_models_own_calls_kerass_which_distributes_as_before(two_replicas, monkeypatch):
    keras.config.set_dtype_policy("float32")
    with two_replicas.scope():
        model = _OwnFit([keras.Input((8,)), keras.layers.Dense(1)], name="own_fit")
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-2)), loss="mse", metrics=[_Rows()])
    kmp.prepare(model)
    x, y, _ = _data()
    model.fit(x, y, verbose=0)
    distributed = _counting(two_replicas, monkeypatch)
    history = model.fit(x, y, epochs=2, verbose=0)
    assert len(distributed) == 1 and history.history["rows"] == [ROWS, ROWS]
