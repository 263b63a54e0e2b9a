"""Each replica's own accumulation state, in saved files.

An open accumulation window holds each replica's partial sums (kmp.scaling.accumulate:
nothing is communicated until the window closes). Keras and TensorFlow save
one value per variable, replica 0's. kmp saves every replica's rows beside
it and puts them back after the ordinary restore:

    save:    if several workers and the window is open:
                 rows = all_gather(value on each replica)    # [replicas, ...]; every worker saves
             else:
                 rows = stack(value on each local replica)   # [local replicas, ...]
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

Under MultiWorkerMirroredStrategy the gather is a collective, so a save of an
open window must be called on every worker, at the same step. That is
TensorFlow's rule for multi-worker saving (its multi-worker Keras tutorial:
every worker saves, non-chief workers to a temporary path, because a save may
aggregate variables, as it does for SyncOnRead variables), and Keras 3.15's
ModelCheckpoint and BackupAndRestore call save on every worker. Every
worker's file then holds every replica's rows. A save called on the chief
alone inside a window waits for the others (until the strategy's collective
timeout, if one is set). A closed window is not gathered: its sums are zero
on every replica and every worker sees the same window position, so a
chief-only save at a window boundary works, and is exact, as before.
"""

from __future__ import annotations

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


def gather_rows(strategy, variables, dtype=tf.float32):
    """A function returning every replica's own values of `variables`, one
    row per replica in replica order: [replicas, total size] of `dtype`.

    One all-gather per call (a collective under several workers: every worker
    must call it at the same point), traced once: TensorFlow's eager gather
    traces anew at every call.
    """

    @tf.autograph.experimental.do_not_convert
    def local():
        # Replica context: each variable reads this replica's own component.
        parts = [tf.reshape(tf.cast(tf.convert_to_tensor(v.value), dtype), [-1]) for v in variables]
        return tf.expand_dims(tf.concat(parts, 0), 0)

    @tf.function
    @tf.autograph.experimental.do_not_convert
    def gather():
        return strategy.gather(strategy.run(local), axis=0)

    return gather


def _across_workers(micro_steps) -> bool:
    """Whether a save must gather the rows of other workers: an open window
    under several workers, saved eagerly (a save traced into a function, as a
    SavedModel's, reads no value and writes this worker's rows)."""
    strategy = getattr(micro_steps.value, "distribute_strategy", None)  # None: not distributed
    if strategy is None or not tf.executing_eagerly():
        return False
    if not seams.get("collective_all_reduce_multi_worker")(strategy):
        return False
    # The same on every worker (every replica counts the same micro-batches),
    # so all of them gather, or none.
    return int(np.asarray(micro_steps.numpy())) != 0


class PerReplicaWindow(tf.__internal__.tracking.Trackable):
    """The `tf.train.Checkpoint` entry for every replica's accumulation state.

    `local_state()` returns the optimizer's local-state variables (sums,
    weight sum) in a fixed order; each is saved as one stacked tensor.
    """

    def __init__(self, local_state, micro_steps):
        _register()
        self.local_state = local_state
        self.micro_steps = micro_steps
        self._gather = None  # traced at the first save that gathers

    def rows(self) -> list[tf.Tensor]:
        """Each local-state variable's rows to save, [replicas saved, *shape]:
        under several workers with an open window, every replica's, gathered
        (every worker must save); otherwise this worker's."""
        variables = self.local_state()
        if not _across_workers(self.micro_steps):
            return [read_rows(v) for v in variables]
        if self._gather is None:
            self._gather = gather_rows(self.micro_steps.value.distribute_strategy, variables)
        rows = self._gather()  # float32, as the sums and the weight sum are
        sizes = [int(np.prod(v.shape)) for v in variables]
        return [tf.reshape(part, [-1, *v.shape]) for part, v in zip(tf.split(rows, sizes, axis=1), variables)]


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
        names += _keys(object_name, window)
        tensors += window.rows()
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
