"""prepare(model): Keras's fit() under tf.distribute strategies, working and fast.

Keras 3.15 fails twice under MultiWorkerMirroredStrategy on TensorFlow
(keras-team/keras#20585): `_maybe_symbolic_build` all-reduces the first data
batch only to learn its shapes ("Attempt to convert a value (PerReplica:...)
to a Tensor", before the first step), and every step's logs are reduced with
`axis=0`, which fails for scalars. And under any strategy with several
replicas it turns XLA off (or fails when asked for it). `prepare` replaces
two methods of the given instance only, delegating to Keras's, and, with
several replicas, swaps Keras's train step for kmp.replica_step's (XLA per
replica).
"""

from __future__ import annotations

import functools
import types

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as _keras_trainer

from kmp import replica_step
from kmp.errors import Problem, check


def prepare(model: keras.Model, *, jit_compile: bool | str = "auto") -> keras.Model:
    """Make `model.fit()` work, and fast, under tf.distribute strategies; returns `model`.

    Call it after creating the model (in the strategy's scope, as Keras
    requires) and before `fit()`; inside or outside the scope both work.
    Calling it again only changes `jit_compile`. It changes this instance
    only: other models, and Keras's classes, are untouched.

    `jit_compile`, with several replicas (Mirrored, MultiWorkerMirrored):
    "auto" or True compiles each replica's forward/backward pass with XLA
    (kmp.replica_step; "auto" unless a layer does not support XLA), and the
    all-reduce stays outside; False keeps Keras's step without XLA. Keras's
    own `compile(jit_compile=True)`, which fails under a strategy, is turned
    into the same. On one replica, True turns Keras's whole-step XLA on and
    "auto"/False leave the compile() setting as it is.

    Two of the instance's methods are replaced, each delegating to Keras's
    (besides the XLA step above):

    1. `_maybe_symbolic_build`: before the first step Keras builds the model,
       metrics and optimizer from the shapes and dtypes of one data batch,
       which it gets from the distributed first batch as

           batch = strategy.reduce("MEAN", first_batch, axis=None)      # Keras
           batch = strategy.experimental_local_results(first_batch)[0]  # prepared

       Every replica's share of a global batch has the same shapes. Keras's
       reduce fails across workers (keras-team/keras#20585), and it turns
       integer labels into float64; one local replica's share needs no
       communication and has the dtypes the train step will see.
    2. `_make_function` (multi-worker only): Keras reduces each step's logs
       with `strategy.reduce("MEAN", v, axis=0)`, which fails for a scalar
       loss. The step's outputs get a leading axis of 1, so that same reduce
       is the mean over replicas and returns the original shape.
    """
    stock = getattr(type(model), "_maybe_symbolic_build", None)
    if not isinstance(model, keras.Model) or stock is None:
        check([Problem("model", "a keras.Model built by Keras's TensorFlow backend", type(model).__name__,
                       "Pass the model itself, e.g. kmp.distribute.prepare(model).")],
              "kmp.distribute.prepare arguments")
    if jit_compile not in replica_step.JIT_CHOICES:
        check([Problem("jit_compile", '"auto", True or False', jit_compile)], "kmp.distribute.prepare arguments")
    if getattr(model, "_kmp_jit_compile", jit_compile) != jit_compile:
        model.train_function = None  # built with the old setting: rebuild at the next fit()
    model._kmp_jit_compile = jit_compile
    if is_prepared(model):
        return model
    # Bound methods stored on the instance shadow the class's methods for
    # this instance only (tests/test_distribute.py checks both).
    for name, method in _REPLACEMENTS.items():
        setattr(model, name, types.MethodType(method, model))
    return model


def is_prepared(model: keras.Model) -> bool:
    """Whether `prepare(model)` was called on this instance."""
    return all(
        getattr(vars(model).get(name), "__func__", None) is method for name, method in _REPLACEMENTS.items()
    )


def _build_from_local_batch(self, iterator=None, data_batch=None):
    # Keras's method skips its reduce when handed a batch instead of an
    # iterator; hand it one replica's share of the first batch.
    if iterator is not None and self._distribute_strategy is not None:
        for _, _, batches in iterator:
            data_batch = local_batch(self.distribute_strategy, next(batches))
            break
        iterator = None
    return type(self)._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)


def _make_function_prepared(self, step_function):
    setting = getattr(self, "_kmp_jit_compile", "auto")
    several = self.distribute_strategy.num_replicas_in_sync > 1
    # Only Keras's own train_step is swapped: a model's custom one is kept.
    if (
        getattr(step_function, "__func__", None) is _keras_trainer.TensorFlowTrainer.train_step
        and replica_step.wants_replica_xla(self, setting)
    ):
        step_function = functools.partial(replica_step.train_step, self)
    # Under MultiWorkerMirroredStrategy, Keras reduces each step's outputs
    # (the logs) with strategy.reduce("MEAN", v, axis=0), which fails for
    # scalars and averages a vector's entries. With a leading axis of 1 per
    # replica, that same reduce is the mean over replicas, shape unchanged.
    if _keras_trainer._collective_all_reduce_multi_worker(self.distribute_strategy):
        step_function = _with_replica_axis(step_function)
    # Keras's jit_compile puts the whole distributed step in one XLA
    # computation, which fails with several replicas.
    whole_step_xla = (setting is True or bool(self.jit_compile)) and not several
    saved, self._jit_compile = self._jit_compile, whole_step_xla
    try:
        return type(self)._make_function(self, step_function)
    finally:
        self._jit_compile = saved


def _with_replica_axis(step_function):
    @functools.wraps(step_function)
    def step(data):
        return keras.tree.map_structure(
            lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, step_function(data)
        )

    return step


_REPLACEMENTS = {
    "_maybe_symbolic_build": _build_from_local_batch,
    "_make_function": _make_function_prepared,
}


def local_batch(strategy: tf.distribute.Strategy, batch):
    """The first local replica's part of a distributed batch; other batches as they are."""
    leaves = keras.tree.flatten(batch)
    if leaves and all(isinstance(v, tf.distribute.DistributedValues) for v in leaves):
        return keras.tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)
    return batch
