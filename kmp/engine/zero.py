"""ZeRO stage 1: the weights' all-gather, the slots gathered whole, and where Keras's slot copy lives.

    gather(buffers, new_shard)      # every replica, in replica context, every step
    whole_shards(buffers, names)    # eagerly, when the engine stores the state (a save, the end of fit())
    to_host(slot_variables, device) # when the sharded buffers are built
    to_replicas(slot_variables, strategy)   # when the per-variable path takes over again

Keras's slot variables are, with the flat buffers, only the observable copy
of the optimizer state: the step updates the buffers' shards, and kmp.engine.buffers
copies the gathered shards into the Keras variables when something can
observe them (a save, a callback, the end of fit()). Left mirrored, that copy
is whole on every replica and stage 1 would save no device memory. So at
stage 1 each slot variable's TensorFlow variable becomes one plain variable
in host memory (`host(strategy)`, the process's CPU), once per process: every
replica device then holds 1/N of the state. Replicas that are CPUs of one
process hold it so at stage 0 too (kmp.engine.layout, SharedShards): their
memory is one, and a copy out of the buffers then writes each slot once.
The Keras variable object stays the
same (its `_value` changes), so its path, its checkpoint key, the optimizer's
lists and the `.keras` format are untouched. A mirrored variable would make
each replica's per-variable update write the one host copy N times over:
before Keras's own per-variable update runs again (kmp.engine.prepare), the
slots go back to one component per replica.

After each replica has updated its shard of the flat weights (kmp.engine.buffers,
`update_shard`), every replica's whole weights must hold every new shard.
Under MirroredStrategy all replicas live in this process, and TensorFlow's
`ReplicaContext.all_gather` there all-reduces zero-padded copies (N times
the bytes), so here the shards are concatenated once and each device's
weights assigned (benchmarks/zero_stage1.py compares the stages). Where
those devices are CPUs (one memory) nothing is gathered at all: each replica
holds its shard of the weights and the forward passes read every shard
(the SharedShards layout, kmp.engine.layout). Under MultiWorkerMirroredStrategy the other
workers' shards are elsewhere: `all_gather` is there a collective all-gather
of the equal shards.

Storing the state under several workers is a collective too (each worker
holds its replicas' shards only): kmp.engine gathers it where every worker
is at the same point (fit()'s end, callbacks' hooks, and the model's
save, save_weights, set_weights and load_weights, which
TensorFlow's multi-worker rule has every worker call), and stores the
weights alone, with no collective, for the readers one worker may call
alone (get_weights, evaluate, predict, export).

The gradient is reduce-scattered (kmp.distribute.scatter): each replica
receives the sum of its shard only, and checks and clips from a few numbers
per shard that every replica shares. Between workers that is TensorFlow's
all-to-all collective, half the bytes of the all-reduce; on replicas of one
process, each shard is summed on its owner's device.
"""

from __future__ import annotations

from contextlib import nullcontext

import keras
import tensorflow as tf

from kmp import seams
from kmp.distribute.same_start import same_start


def host(strategy) -> str:
    """This process's CPU: where Keras's slot copy lives (at stage 1; at every stage on CPUs of one process)."""
    try:
        device = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    except RuntimeError:  # the default strategy has no devices of its own
        device = tf.DeviceSpec(job="localhost", replica=0, task=0)
    return device.replace(device_type="CPU", device_index=0).to_string()


def gather(buffers, shard) -> None:
    """Every replica's new `shard` (padded to buffers.shard) into every replica's whole weights."""
    context = tf.distribute.get_replica_context()
    if buffers.layout.across_workers:
        buffers.local("weights").assign(context.all_gather(shard, axis=0)[:buffers.size])
    else:
        context.merge_call(_gather, args=(buffers, shard))


def _gather(strategy, buffers, shard):
    whole = tf.concat(strategy.experimental_local_results(shard), axis=0)[:buffers.size]
    for weights in strategy.experimental_local_results(buffers.buffers["weights"]):
        with tf.device(weights.device):
            weights.assign(whole)


def whole_shards(buffers, names) -> dict:
    """Each sharded buffer of `names` whole (this process's copy, zero padded at the end), by name.

    Under several workers an all-gather: a collective every worker must join
    at the same point (see the module docstring), traced once.
    """
    local = buffers.strategy.experimental_local_results
    if not buffers.layout.across_workers:
        shards = {n: [b.read_value() for b in local(buffers.buffers[n])]
                  for n in names if buffers.is_shard(n)}
    else:
        shards = {n: tf.split(whole, buffers.replicas) for n, whole in buffers.layout.gathered_slots().items()
                  if n in names}
    # Each replica's entries that hold its shard: a slot of 8-bit states may cover some variables only.
    return {n: tf.concat([first_entries(shard, buffers.used(n, k)) for k, shard in enumerate(parts)], axis=0)
            for n, parts in shards.items()}


def first_entries(tensor, n: int):
    """The first `n` entries of `tensor` (itself when that is all of it: no op to run)."""
    return tensor if n == tensor.shape[0] else tensor[:n]


def all_gather_slots(buffers):
    """Every replica's shard of each slot buffer, all-gathered (replica context)."""
    # TensorFlow's collectives take no uint8 (8-bit codes): gathered as int32, exactly.
    slots = {n: buffers.local(n).read_value() for n in buffers.slot_names}
    wide = {n: tf.cast(v, tf.int32) if v.dtype == tf.uint8 else v for n, v in slots.items()}
    gathered = tf.distribute.get_replica_context().all_gather(wide, axis=0)
    return {n: tf.cast(gathered[n], tf.uint8) if slots[n].dtype == tf.uint8 else gathered[n] for n in slots}


def to_host(variables, device: str) -> bool:
    """Each Keras variable's mirrored TensorFlow variable replaced by one plain variable on `device`, same value.
    Whether any was."""
    moved = False
    for variable in variables:
        value = variable.value
        if not isinstance(value, tf.distribute.DistributedValues):
            continue  # already one variable (on one device, or moved before)
        with tf.init_scope(), tf.device(device):
            # ResourceVariable itself: tf.Variable inside a strategy's scope would be mirrored again.
            variable._value = seams.get("ResourceVariable")(
                initial_value=value.read_value(), trainable=False, name=value.name.split(":")[0])
        moved = True
    return moved


def to_replicas(variables, strategy) -> bool:
    """The reverse of to_host: each variable mirrored over `strategy`'s replicas again, same value and
    aggregation (kmp.LossScaleOptimizer uses it too, for a step counter made outside the scope). Whether any was."""
    moved = False
    for variable in variables:
        value = variable.value
        if isinstance(value, tf.distribute.DistributedValues):
            continue
        # 8-bit codes: MultiWorkerMirrored's broadcast of the initial value takes no uint8. Every worker's
        # host copy holds the same, stored from the gathered shards (whole_shards), so none is needed.
        with tf.init_scope(), strategy.scope(), same_start(strategy) if value.dtype == tf.uint8 else nullcontext():
            variable._value = tf.Variable(value.read_value(), trainable=False, name=value.name.split(":")[0],
                                          aggregation=value.aggregation)
        moved = True
    return moved


def on_host(variable) -> bool:
    """True if `variable` (a Keras variable) was moved to one plain variable by to_host."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return not isinstance(value, tf.distribute.DistributedValues)
