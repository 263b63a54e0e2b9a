"""ZeRO stage 1's all-gather of the weights, by hand, for the replicas of one process.

    gather(buffers, new_shard)      # every replica, in replica context, every step

After each replica has updated its shard of the flat weights (kmp.flat,
`update_shard`), every replica's whole weights must hold every new shard.
TensorFlow's `ReplicaContext.all_gather` under MirroredStrategy all-reduces
zero-padded copies (N times the bytes): stage 1 took 1.50-1.54x the step
of stage 0 with it. All replicas of a MirroredStrategy live in this
process (kmp.flat.support keeps stage 1 to one process), so here the shards
are concatenated once and each device's weights assigned: 1.07-1.09x
(benchmarks/p6_zero_stage1.py). Concatenating on each device (1.22-1.25x)
and assigning slice by slice in place (1.15-1.18x) measured slower.

The gradient's reduce stays TensorFlow's all-reduce of the whole flat
gradient (kmp.distribute.communication), each replica then taking its
slice: tf.distribute has no reduce-scatter, and one written by hand the
same way (each shard summed on its owner's device in a merge_call) was not
faster in the combinations measured with the gathers above (1.12-1.22x).
"""

from __future__ import annotations

import tensorflow as tf


def gather(buffers, shard) -> None:
    """Every replica's new `shard` (padded to buffers.shard) into every replica's whole weights."""
    tf.distribute.get_replica_context().merge_call(_gather, args=(buffers, shard))


def _gather(strategy, buffers, shard):
    whole = tf.concat(strategy.experimental_local_results(shard), axis=0)[:buffers.size]
    for weights in strategy.experimental_local_results(buffers.buffers["weights"]):
        with tf.device(weights.device):
            weights.assign(whole)
