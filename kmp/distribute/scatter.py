"""The flat gradient reduce-scattered, and the few numbers every replica then shares.

    shard = reduce_scatter_mean(flat, shard, communication, loss_scale, count)
        # replica i of N gets the mean of flat[i*shard:(i+1)*shard] (flat: N*shard elements)
    rows = gather_rows(vector)
        # every replica's small vector, stacked in replica order: [N, length], on every replica

Used where each replica updates its shard of the flat buffers (kmp.engine.layout's
sharded layouts: ZeRO stage 1, and replicas that are CPUs of one process at any
stage): a replica then needs only its shard of the summed gradient, and the
overflow decision, the clip norm and the names of overflowing variables are
a few numbers per shard (kmp.engine.layout, `_Shards.check`).

How the shards are summed, by where the replicas are:

- CPUs of one process (MirroredStrategy on logical CPUs) share its memory:
  one merge_call, in which shard i is the add_n of every replica's slice i,
  made on replica i's device. Each replica adds 1/N of the elements that
  one add_n of the whole gradient adds (kmp.distribute.communication's
  `_sum`), and checks only those afterwards.
- Several workers (MultiWorkerMirroredStrategy): TensorFlow's all-to-all
  collective sends slice i of every replica's gradient to replica i, which
  adds the N slices it receives. Each worker sends and receives (N-1)/N of
  the gradient: half the bytes of the ring all-reduce. tf.distribute offers no reduce-scatter, and TensorFlow's own
  collective for it (CollectiveReduceScatterV2) did not complete between
  two logical CPUs when tried.
- Elsewhere (GPUs of one process; not testable on this project's machines):
  TensorFlow's all-reduce of the whole gradient, then this replica's slice.

The communication settings are those of the all-reduce (kmp.distribute
.communication): the sum travels in `communication.dtype`, scaled by the
same factors; between workers each collective carries at most
`bytes_per_pack` bytes of the whole gradient.
"""

from __future__ import annotations

import tensorflow as tf

from kmp import seams
from kmp.config.settings import Communication
from kmp.distribute.communication import all_reduce_sum, chunks, cpus_of_one_process, in_transit


def reduce_scatter_mean(flat, shard: int, communication: Communication, loss_scale, count=None):
    """This replica's shard of the sum of `flat` over the replicas (divided by `count` micro-batches)."""
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    if flat.shape[0] != replicas * shard:
        raise ValueError(f"reduce_scatter_mean expects {replicas} x {shard} elements. Received: {flat.shape[0]}.")
    if replicas == 1:
        out = flat
    elif cpus_of_one_process(ctx.strategy):
        out = in_transit(flat, communication, loss_scale,
                         lambda sent: ctx.merge_call(_add_on_owners, args=(sent, shard)))
    elif _collective(ctx.strategy):
        out = in_transit(flat, communication, loss_scale,
                         lambda sent: _all_to_all_sum(ctx, sent, shard, communication))
    else:
        whole = tf.concat(all_reduce_sum(chunks(flat, communication), communication, loss_scale), axis=0)
        out = tf.reshape(whole, [replicas, shard])[ctx.replica_id_in_sync_group]
    return out if count is None else out / count


def gather_rows(vector):
    """Every replica's `vector` (same length everywhere), stacked in replica order, on every replica."""
    ctx = tf.distribute.get_replica_context()
    if ctx.num_replicas_in_sync == 1:
        return vector[None]
    if cpus_of_one_process(ctx.strategy):
        return ctx.merge_call(_stack_on_first, args=(vector,))
    # The all-gather's first dimension is not known while tracing: the shape is.
    return tf.reshape(ctx.all_gather(vector[None], axis=0), [ctx.num_replicas_in_sync, vector.shape[0]])


def _add_on_owners(strategy, per_replica, shard):
    parts = strategy.experimental_local_results(per_replica)
    devices = strategy.extended.worker_devices

    def owner(context):
        i = context.replica_id_in_sync_group
        with tf.device(devices[i]):
            return tf.add_n([p[i * shard:(i + 1) * shard] for p in parts])

    return strategy.experimental_distribute_values_from_function(owner)


def _stack_on_first(strategy, per_replica):
    parts = strategy.experimental_local_results(per_replica)
    with tf.device(parts[0].device):
        return tf.stack(parts)


def _collective(strategy) -> bool:
    """Whether the replicas reduce through TensorFlow's collectives: MultiWorkerMirroredStrategy."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _all_to_all_sum(ctx, sent, shard: int, communication: Communication):
    """Slice i of every replica's `sent` to replica i, which adds the N slices it receives.

    Through the strategy's own launcher for this replica (its group, its
    instance keys, its ordering token), as its all-reduce and all-gather go:
    the same collective group, ordered with them.
    """
    launcher = ctx.strategy.extended._cross_device_ops._launchers[ctx._replica_id]
    replicas = ctx.num_replicas_in_sync
    rows = tf.reshape(sent, [replicas, shard])
    # At most bytes_per_pack bytes of the whole gradient per collective (0: one).
    pack = communication.bytes_per_pack
    width = max(1, pack // (replicas * sent.dtype.size)) if pack else shard
    sums = []
    for start in range(0, shard, width):
        with tf.device(launcher._device):
            received = seams.get("all_to_all_v2")(
                rows[:, start:start + width], launcher._group_size, launcher._group_key, launcher._next_instance_key(),
                timeout=launcher._options.timeout_seconds, ordering_token=launcher._get_ordering_token())
            sums.append(tf.reduce_sum(tf.reshape(received, [replicas, -1]), axis=0))
    return sums[0] if len(sums) == 1 else tf.concat(sums, axis=0)
