"""Finished input iterators, destroyed off the main thread.

Destroying a tf.data iterator with autotuning (Keras's input pipeline for
arrays and most user datasets) waits until the pipeline's autotune thread
next wakes: TensorFlow notifies that thread of the cancellation before it
marks itself cancelled, so the thread sleeps out its period, which doubles
from 10 ms up to about a minute while the iterator lives. Keras drops an
epoch's iterator when the next epoch begins and when fit() returns, so each
epoch after the first, and fit() itself, can wait seconds doing nothing
(benchmarks/input_teardown.py measures it).

A prepared model's train and test functions hand each iterator they are
called with to one daemon thread, which holds a reference of its own:

    train_function(iterator) -> hold(iterator), once per iterator
    thread, every 0.1 s: an iterator nobody else holds any more is dropped
        there (its destructor waits there, while training goes on)

The main thread then never holds the last reference, so it never waits.
At interpreter exit the thread drops what it holds before TensorFlow shuts
down; what is still waiting then is waited for (stock Keras waited in fit()).

Keras also makes each epoch's iterator when the previous epoch ends, after
the last one too, where nothing reads it: a distributed iterator costs about
0.13 s of CPU under MirroredStrategy, once per fit() and evaluate(). On a
prepared model's epoch iterators it is made when a step first takes it
(`defer_next_epochs`). Where the step splits global batches itself
(kmp.engine.host_batches), the train function's iterator is a plain one on
the undistributed dataset.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import tensorflow as tf

# Imported first, so its exit wait is registered before ours and runs after it (atexit runs last-in first):
# a multi-worker job's leader drops its iterators, then waits for the other workers.
from kmp.distribute import leaving  # noqa: F401

_ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)
POLL_SECONDS = 0.1
# The autotune thread's longest sleep is a minute: a wait longer than that at exit is not this one.
EXIT_SECONDS = 120.0


class _Releaser:
    def __init__(self):
        self._held = {}  # id -> iterator: the only references this module keeps
        self._lock = threading.Condition()
        self._thread = None
        self._pid = None
        self._stopping = False

    def hold(self, iterator) -> None:
        with self._lock:
            if self._stopping or id(iterator) in self._held:  # held: the same object, alive
                return
            self._held[id(iterator)] = iterator
            if self._thread is None or self._pid != os.getpid():  # a forked child starts its own
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="kmp-iterator-release", daemon=True)
                self._thread.start()
            self._lock.notify()

    def holding(self) -> int:
        with self._lock:
            return len(self._held)

    def _unused(self) -> list:
        # Nobody else's: two references, the dict's value and getrefcount's argument.
        with self._lock:
            keys = [k for k in self._held if self._stopping or sys.getrefcount(self._held[k]) <= 2]
            return [self._held.pop(k) for k in keys]

    def _run(self) -> None:
        while True:
            done = self._unused()
            done.clear()  # the destructors run here, on this thread
            with self._lock:
                if self._stopping and not self._held:
                    return
                self._lock.wait(POLL_SECONDS if self._held else None)

    def stop(self) -> None:
        """Drop everything held and wait (up to EXIT_SECONDS) until it is destroyed (at interpreter exit)."""
        with self._lock:
            self._stopping = True
            thread = self._thread if self._pid == os.getpid() else None
            self._lock.notify()
        if thread is not None:
            thread.join(EXIT_SECONDS)


_RELEASER = _Releaser()
atexit.register(_RELEASER.stop)


class _Deferred:
    """An epoch's input iterator, made from its dataset when first read or handed to a step: from the
    undistributed dataset (`host`) when the step splits global batches itself (kmp.engine.host_batches)."""

    def __init__(self, dataset, host=None):
        self._dataset, self._host, self._iterator = dataset, host, None

    def made(self, on_host: bool = False):
        if self._iterator is None:
            self._iterator = iter(self._host if on_host and self._host is not None else self._dataset)
        return self._iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.made())

    def __getattr__(self, name):  # get_next, element_spec, ...: the iterator's own
        if name.startswith("_"):  # copy's and pickle's probes, or an unset attribute: no iterator for them
            raise AttributeError(name)
        return getattr(self.made(), name)


def defer_next_epochs(epoch_iterator, host=None) -> None:
    """On this Keras epoch iterator (fit's, evaluate's), each epoch's input iterator is made when first used;
    `host`: the undistributed dataset, for a train function that splits its batches (`releasing`)."""
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    if dataset is not None and "_get_iterator" not in vars(epoch_iterator):
        epoch_iterator._get_iterator = lambda: _Deferred(dataset, host)


def of_a_dataset(iterator) -> bool:
    """Whether `iterator` reads a tf.data or distributed dataset (made yet or not): not a Python one's batches."""
    return isinstance(iterator, (_Deferred, *_ITERATORS))


def releasing(function, on_host: bool = False):
    """`function` (a train or test function), handing each input iterator it is called with to the thread;
    with `on_host`, an epoch's iterator is made on the undistributed dataset where there is one."""

    def call(iterator):
        if isinstance(iterator, _Deferred):
            iterator = iterator.made(on_host)
        if isinstance(iterator, _ITERATORS):
            _RELEASER.hold(iterator)
        return function(iterator)

    call.__wrapped__ = function
    return call


def holding() -> int:
    """How many iterators are held, waiting for their last other reference to go (for tests)."""
    return _RELEASER.holding()
