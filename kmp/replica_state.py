"""Each replica's own accumulation state, in saved files.

An open accumulation window holds each replica's partial sums (kmp.accumulate:
nothing is communicated until the window closes). Keras and TensorFlow save
one value per variable, replica 0's. kmp saves every local replica's rows
beside it and puts them back after the ordinary restore:

    save:    rows = stack(value on each local replica)      # [local replicas, ...]
    restore: if len(rows) == replicas: replica i <- rows[i]  # i: its index among all replicas
             else: replica 0 <- sum(rows); the others <- 0  # the window's total is kept

- `.keras` / `.weights.h5` (save_own_variables): kmp.LossScaleOptimizer
  stores the rows under `per_replica_<index>` itself.
- `tf.train.Checkpoint`: `PerReplicaWindow`, an object the optimizer tracks
  under the name `per_replica_window`, saved by a TensorFlow registered
  checkpoint saver. Such savers run after the ordinary restore of the same
  checkpoint (TensorFlow's contract for them), so the variables' own entries
  (replica 0's sums, given to every replica) cannot overwrite the rows. The
  object has no tensors of its own: a checkpoint without it (written before
  it existed) restores as before, and `assert_existing_objects_matched()`
  still passes on it.

Under MultiWorkerMirroredStrategy each worker holds (and saves) only its own
replicas' rows; gathering them needs a collective that every worker joins,
which a save cannot count on (a chief-only `model.save` would wait forever).
kmp.callbacks.BackupAndRestore gathers them itself (every worker takes part
in its backups). The saves here warn when they write an open window that
way.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from kmp import seams

SAVER = ("kmp", "PerReplicaWindow")  # package, name: recorded in checkpoints
_registered = False


def components(variable) -> list:
    """The local replicas' own variables of a Keras variable (one on one device)."""
    value = variable.value
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def read_rows(variable) -> tf.Tensor:
    """Every local replica's value of `variable`, stacked: [local replicas, *shape]."""
    return tf.stack([tf.convert_to_tensor(c.read_value()) for c in components(variable)])


def replica_ids(strategy) -> list:
    """The index among all replicas of each local replica, in `components` order
    (under several workers, not the local position)."""

    @tf.autograph.experimental.do_not_convert
    def replica_id():
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    # In a tf.function: strategy.run in eager mode warns about its overhead.
    ids = tf.function(tf.autograph.experimental.do_not_convert(lambda: strategy.run(replica_id)))()
    return list(strategy.experimental_local_results(ids))


def assign_rows(variables, rows) -> None:
    """Each replica's saved row of each variable back into its own component.

    rows[k] holds variables[k]'s rows, one per replica that saved it. Saved
    by as many replicas as there are now, replica i takes row i; by another
    number, replica 0 (of all workers) takes the sum of the rows and the
    others zeros, so the next all-reduce sees the window's total (rounded in
    another order). Graph-safe: a restored tensor's row count may only be
    known when it runs.
    """
    if not variables:
        return
    value = variables[0].value
    if isinstance(value, tf.distribute.DistributedValues):
        count, ids = value.distribute_strategy.num_replicas_in_sync, replica_ids(value.distribute_strategy)
    else:
        count, ids = 1, [0]
    for variable, saved in zip(variables, rows, strict=True):
        saved = tf.convert_to_tensor(saved, variable.dtype)
        same = tf.equal(tf.shape(saved)[0], count)
        total = tf.reduce_sum(saved, axis=0)
        for index, component in zip(ids, components(variable), strict=True):
            index = tf.cast(index, tf.int32)
            # A select, not a product: a window holding an inf keeps it, with no NaN beside.
            kept = tf.where(tf.equal(index, 0), total, tf.zeros_like(total))
            component.assign(tf.cond(same, lambda: tf.gather(saved, index), lambda: kept))


def warn_if_incomplete(micro_steps, how: str) -> None:
    """Under several workers, a save of an open window holds only this worker's sums."""
    strategy = getattr(micro_steps.value, "distribute_strategy", None)  # None: not distributed
    if strategy is None or not tf.executing_eagerly():  # a save traced into a function (SavedModel) reads no value
        return
    if not seams.get("collective_all_reduce_multi_worker")(strategy):
        return
    if int(np.asarray(micro_steps.numpy())) == 0:
        return
    warnings.warn(
        f"kmp: {how} saves an open accumulation window under MultiWorkerMirroredStrategy: each worker holds "
        "its own replicas' partial sums and this file gets only this worker's, so a run resumed from it is "
        "not exact. Save when the window has closed (a save_freq that is a multiple of "
        "gradient_accumulation_steps), or use kmp.callbacks.BackupAndRestore, which gathers every worker's.",
        stacklevel=3,
    )


class PerReplicaWindow(tf.__internal__.tracking.Trackable):
    """The `tf.train.Checkpoint` entry for every local replica's accumulation state.

    `local_state()` returns the optimizer's local-state variables (sums,
    weight sum) in a fixed order; each is saved as one stacked tensor.
    """

    def __init__(self, local_state, micro_steps):
        _register()
        self.local_state = local_state
        self.micro_steps = micro_steps


def _register() -> None:
    global _registered
    if _registered:
        return
    register = seams.get("register_checkpoint_saver")
    register(package=SAVER[0], name=SAVER[1], predicate=lambda obj: isinstance(obj, PerReplicaWindow),
             save_fn=_save, restore_fn=_restore, strict_predicate_restore=False)
    _registered = True


def _keys(object_name: str, window: PerReplicaWindow) -> list[str]:
    return [f"{object_name}/.PER_REPLICA/{j}" for j in range(len(window.local_state()))]


def _save(trackables, file_prefix):
    """TensorFlow's registered-saver save_fn: one stacked tensor per local-state variable."""
    names, tensors = [], []
    for object_name, window in trackables.items():
        warn_if_incomplete(window.micro_steps, "tf.train.Checkpoint")
        names += _keys(object_name, window)
        tensors += [read_rows(v) for v in window.local_state()]
    with tf.device("CPU:0"):
        tf.raw_ops.SaveV2(prefix=file_prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=tensors)
    return [file_prefix]


def _restore(trackables, merged_prefix):
    """TensorFlow's registered-saver restore_fn. TensorFlow runs it after the
    ordinary restore ops (registration.register_checkpoint_saver's contract)."""
    for object_name, window in trackables.items():
        variables = window.local_state()
        names = _keys(object_name, window)
        with tf.device("CPU:0"):
            rows = tf.raw_ops.RestoreV2(prefix=merged_prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                                        dtypes=[tf.as_dtype(v.dtype) for v in variables])
        assign_rows(variables, rows)
