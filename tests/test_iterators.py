"""kmp.engine.iterators: a prepared model's finished input iterators are destroyed on kmp's thread,
never on the main one, where destroying one waits for tf.data's autotune thread to wake.

The wait itself is timing (benchmarks/p6_transformer.py measures whole fit() calls); what is
tested is where each iterator's destructor runs, and that nothing still in use is dropped.
"""

import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.engine import iterators


@pytest.fixture(autouse=True)
def releaser(monkeypatch):
    """A releaser of the test's own: the worker's may still hold what earlier tests left behind."""
    own = iterators._Releaser()
    monkeypatch.setattr(iterators, "_RELEASER", own)
    yield own
    own.stop()


def _wait_until_released(releaser, seconds=30.0):
    end = time.monotonic() + seconds
    while releaser.holding() and time.monotonic() < end:
        time.sleep(0.02)
    return releaser.holding()


def _destroyed_on(obj, where: list):
    weakref.finalize(obj, lambda: where.append(threading.current_thread().name))


def _count_passes(releaser, monkeypatch) -> threading.Semaphore:
    """A semaphore released after each of the release thread's passes over what it holds."""
    passes, unused = threading.Semaphore(0), releaser._unused

    def counted():
        done = unused()
        passes.release()
        return done

    monkeypatch.setattr(releaser, "_unused", counted)
    return passes


def test_an_iterator_nobody_else_holds_is_destroyed_on_the_release_thread(releaser, monkeypatch):
    where = []
    passes = _count_passes(releaser, monkeypatch)
    seen = iterators.releasing(lambda it: next(it))
    iterator = iter(tf.data.Dataset.range(10).prefetch(tf.data.AUTOTUNE))
    _destroyed_on(iterator, where)
    assert int(seen(iterator)) == 0 and int(seen(iterator)) == 1
    # Two passes of the thread, each after the iterator was held (the thread starts with the hold).
    assert passes.acquire(timeout=30) and passes.acquire(timeout=30)
    assert releaser.holding() == 1 and where == []  # still held: nothing is dropped while the caller holds it
    del iterator
    assert _wait_until_released(releaser) == 0
    assert where == ["kmp-iterator-release"]


def test_anything_else_is_passed_through_and_not_held():
    seen = iterators.releasing(lambda batches: len(batches))
    assert seen([np.ones(2)]) == 1  # train_on_batch's list of one batch
    assert iterators.holding() == 0


def test_at_exit_what_is_held_is_dropped_and_waited_for(releaser):
    where = []
    iterator = iter(tf.data.Dataset.range(3))
    _destroyed_on(iterator, where)
    releaser.hold(iterator)
    del iterator
    releaser.stop()
    assert releaser.holding() == 0 and where == ["kmp-iterator-release"]
    releaser.hold(iter(tf.data.Dataset.range(3)))  # after the stop: not held, destroyed by the caller
    assert releaser.holding() == 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_destroys_each_epochs_iterator_off_the_main_thread(replicas, two_replicas, releaser, monkeypatch):
    strategy = two_replicas if replicas == 2 else tf.distribute.get_strategy()
    where, hold = [], releaser.hold

    def watched(iterator):
        if id(iterator) not in releaser._held:
            _destroyed_on(iterator, where)
        hold(iterator)

    monkeypatch.setattr(releaser, "hold", watched)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    kmp.prepare(model)
    x = np.random.default_rng(0).random((32, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=3, verbose=0, validation_data=(x, x[:, :1]))
    assert _wait_until_released(releaser) == 0
    # At least the three epochs' iterators (and validation's, as many as Keras made), none on the main thread.
    assert len(where) >= 3 and set(where) == {"kmp-iterator-release"}, where


def test_fit_makes_no_input_iterator_it_does_not_read(two_replicas, monkeypatch):
    # Keras makes each epoch's iterator as the previous epoch ends, after the last one too, where
    # nothing reads it (~0.13 s of CPU each under MirroredStrategy): a prepared model's are made when read.
    # Plain iterators on the host here (kmp.engine.host_batches); tf.distribute's are counted too.
    made = []
    distributed = type(two_replicas.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2)))
    make, deferred = distributed.__iter__, iterators._Deferred.made
    monkeypatch.setattr(distributed, "__iter__", lambda self: made.append("distributed") or make(self))

    def made_on_host(self, on_host=False):
        if on_host and self._host is not None and self._iterator is None:
            made.append("host")
        return deferred(self, on_host)

    monkeypatch.setattr(iterators._Deferred, "made", made_on_host)
    x = np.random.default_rng(0).random((32, 4)).astype("float32")
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    kmp.prepare(model)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)  # built here
    made.clear()
    history = model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, validation_data=(x, x[:, :1]))
    assert len(history.history["val_loss"]) == 2 and np.all(np.isfinite(history.history["val_loss"]))
    # Two epochs and two evaluations, one iterator each (stock Keras makes 11 here).
    assert made == ["host"] * 4, made
