"""How the replicas hold and step the flat buffers: one layout, chosen once when the buffers are built.

    layout = choose(buffers, optimizer, strategy)
    grad = layout.reduce(optimizer, [grad], count)          # in a step (replica context)
    finite, clip, flags = layout.check(optimizer, grad)
    layout.update(optimizer, grad, finite, clip)

- Whole: each replica holds and steps its own whole copy (one device; GPUs;
  several workers at ZeRO stage 0). The gradient is all-reduced.
- SharedShards: replicas that are CPUs of one process share its memory, so at
  every ZeRO stage each holds one shard of the weights and slots and steps it
  in place, and every replica's forward pass reads all the weight shards, and
  Keras's slot copy is held once (kmp.engine.zero). The gradient is
  reduce-scattered (kmp.distribute.scatter).
- GatheredShards: ZeRO stage 1 elsewhere. Each replica holds the whole
  weights and one shard of the slots, steps its shard, and every new shard is
  gathered into every replica's weights (kmp.engine.zero).
- FirstCopy: Lamb on replicas of one process. Its trust ratio needs each
  variable whole, so the step runs once, on the first replica's buffers, which
  every replica reads.

The optimizer (kmp.scaling.optimizer) takes the same four calls on its
per-variable path: a layout is the one thing that differs between the paths.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from kmp.distribute.communication import chunks, cpus_of_one_process, reduce_mean
from kmp.distribute.scatter import gather_rows, reduce_scatter_mean
from kmp.engine import zero
from kmp.scaling.gradients import all_finite, clip_scale, clipped_check, norm_of_parts, norm_parts


def choose(buffers, optimizer, strategy, per_variable_rule: bool):
    """The layout of `buffers` for `optimizer` (kmp's, built) under `strategy`."""
    replicas = strategy.num_replicas_in_sync
    stage_1 = getattr(optimizer, "zero_stage", 0) >= 1 and replicas > 1
    one_process = replicas > 1 and cpus_of_one_process(strategy)
    # On CPUs of one process, shards at stage 0 too: no unused copies on the other replicas, and both
    # stages take the same step. One update of whole buffers on the first replica's can be a little
    # faster, but stage 1 cannot step that way (one XLA computation cannot touch both devices' shards).
    # Keras's slot copy is held once there at both stages as well: the replicas' memory is one, and each
    # copy out of the buffers then writes it once, not once per replica.
    if one_process and not per_variable_rule:
        return SharedShards(buffers)
    if stage_1:  # ZeRO and Lamb are refused together (kmp.engine.buffers.support)
        return GatheredShards(buffers, across_workers=len(strategy.extended.worker_devices) < replicas)
    if one_process:
        return FirstCopy(buffers)
    return Whole(buffers)


class Whole:
    """Each replica holds and steps its own whole copy of every buffer."""

    name = "whole"
    sharded = False  # each replica holds one of N equal shards of the slots
    slots_on_host = False  # Keras's slot copy held once, in host memory (kmp.engine.zero)
    across_workers = False  # other workers hold some shards: gathering them is a collective
    shares_cores = False  # the replicas are CPUs of one process
    in_place = True  # the update writes its new weights into the weight buffers (else returns them: `write`)

    def __init__(self, buffers):
        self.buffers = buffers

    def sizes(self, size: int, unit: int, replicas: int) -> tuple[int, int]:
        """(elements of a shard, of the flat gradient) for buffers of `size` elements."""
        return size, size

    def offset(self, index: int) -> int:
        """Where replica `index`'s shard starts in a whole buffer."""
        return 0

    def holds_shard(self, name: str) -> bool:
        """Whether each replica holds only its shard of buffer `name`."""
        return False

    def first_only(self, name: str) -> bool:
        """Whether every replica reads the first replica's buffer `name` (or Keras's `iterations`)."""
        return False

    def read_weights(self, name: str = "weights"):
        """This replica's flat weights (buffer `name`) as its forward pass reads them (buffers.split takes
        either): a tensor, or every replica's shard (a tuple)."""
        return self.buffers.local(name).read_value()

    def stepped(self, weights, offset: int):
        """The weights this replica's update steps: all of its buffer, or the shard at `offset`."""
        return weights.read_value()

    def write(self, weights, new):
        """The update's new weights written; returns what the update returns (None: written)."""
        weights.assign(new)
        return None

    # --- A step (replica context) ---

    @property
    def variables(self) -> list:
        """The trainable variables, in the order of the overflow flags (the optimizer's)."""
        return self.buffers.optimizer._trainable_variables

    def sums(self) -> list:
        """The accumulation window's sums: this replica's one flat buffer."""
        return [self.buffers.local("sums")]

    def reduce(self, optimizer, grads, count, weight=None):
        """The mean of the replicas' flat gradients (`grads`: one), all-reduced once, in buckets."""
        reduced = reduce_mean(chunks(grads[0], optimizer.communication), optimizer.communication,
                              optimizer.dynamic_scale.value, count)
        return reduced[0] if len(reduced) == 1 else tf.concat(reduced, axis=0)

    def check(self, optimizer, grad):
        """(finite, clip factor or None, per-variable finite flags) of the reduced gradient; the flags,
        for the overflow line, are computed on an overflow only."""
        finite, clip = clipped_check(all_finite(grad), [grad], optimizer.gradient_clipping)
        count = len(self.buffers.sizes)
        flags = tf.cond(finite, lambda: tf.ones([count], tf.bool), lambda: self.buffers.segment_finite(grad))
        return finite, clip, flags

    def update(self, optimizer, grad, finite, clip) -> None:
        """The update, if finite, at this step's learning rate."""
        self._apply(grad, finite, clip, optimizer.inner_optimizer._get_current_learning_rate())

    def _apply(self, grad, finite, clip, learning_rate) -> None:
        # One XLA computation on this replica's buffers.
        ops.cond(finite, lambda: self.buffers.update(grad, clip, learning_rate), lambda: None)

    def updated(self):
        """What the update wrote, for the step clock (kmp.engine.wall_clock)."""
        return self.buffers.local("weights")


class FirstCopy(Whole):
    """Lamb on replicas of one process: the first replica's buffers, stepped once, read by all.

    Each replica updating its own copy, as on GPUs, makes the updates contend
    for the same cores and memory.
    """

    name = "first copy"
    shares_cores = True

    def first_only(self, name: str) -> bool:
        return name != "sums"  # each replica accumulates its own micro-batches

    def _apply(self, grad, finite, clip, learning_rate) -> None:
        self.buffers.update_once(finite, grad, clip, learning_rate)


class _Shards(Whole):
    """Each replica steps one shard: it receives the sum of that shard only, and every replica gets every
    shard's few numbers (whether finite, its norm's parts, its flags), so all decide alike."""

    sharded = True

    def sizes(self, size: int, unit: int, replicas: int) -> tuple[int, int]:
        # Shards of whole units: vectorized updates, and no block of 8-bit states split between
        # replicas. The flat gradient is zero padded to N whole shards in the backward pass's XLA
        # concatenate, where it costs nothing: each replica's shard of it is then a slice.
        shard = -(-size // (replicas * unit)) * unit
        return shard, replicas * shard

    def offset(self, index: int) -> int:
        return index * self.buffers.shard

    def holds_shard(self, name: str) -> bool:
        return name in self.buffers.slot_names

    def reduce(self, optimizer, grads, count, weight=None):
        return reduce_scatter_mean(grads[0], self.buffers.shard, optimizer.communication,
                                   optimizer.dynamic_scale.value, count)

    def check(self, optimizer, shard):
        buffers = self.buffers
        finite_here = all_finite(shard)
        count = len(buffers.sizes)
        # Which variables hold the inf or nan: computed on the shard that has one only.
        flags = tf.cond(finite_here, lambda: tf.ones([count], tf.bool),
                        lambda: buffers.segment_finite(shard, buffers.shard_offset()))
        numbers = [tf.cast(finite_here, tf.float32)[None]]
        if optimizer.gradient_clipping is not None:
            numbers += [n[None] for n in norm_parts(shard)]
        rows = gather_rows(tf.concat(numbers + [tf.cast(flags, tf.float32)], axis=0))
        finite, clip = tf.reduce_all(rows[:, 0] > 0), None
        if optimizer.gradient_clipping is not None:
            clip = clip_scale(norm_of_parts(rows[:, 1], rows[:, 2]), optimizer.gradient_clipping)
            finite = finite & tf.math.is_finite(clip)
        return finite, clip, tf.reduce_all(rows[:, len(numbers):] > 0, axis=0)


class SharedShards(_Shards):
    """Replicas that are CPUs of one process: each holds and steps its shard of the weights and slots
    in place; every replica's forward pass reads all the weight shards (no copy is gathered)."""

    name = "shared shards"
    shares_cores = True
    slots_on_host = True  # at every stage

    def holds_shard(self, name: str) -> bool:
        return name in ("weights", "kept_weights") or super().holds_shard(name)

    def read_weights(self, name: str = "weights"):
        local = self.buffers.strategy.experimental_local_results
        return tuple(w.read_value() for w in local(self.buffers.buffers[name]))


class GatheredShards(_Shards):
    """ZeRO stage 1 elsewhere: each replica holds the whole weights, steps its shard, and every new shard
    is gathered into every replica's weights (kmp.engine.zero.gather)."""

    name = "gathered shards"
    slots_on_host = True
    in_place = False

    def __init__(self, buffers, across_workers: bool):
        super().__init__(buffers)
        self.across_workers = across_workers
        self._gather_slots = None  # traced once

    def gathered_slots(self) -> dict:
        """Under several workers, each slot buffer whole: an all-gather every worker must join."""
        buffers = self.buffers
        if self._gather_slots is None:
            self._gather_slots = tf.function(lambda: buffers.strategy.run(zero.all_gather_slots, args=(buffers,)),
                                             autograph=False)
        local = buffers.strategy.experimental_local_results
        return {n: local(t)[0] for n, t in self._gather_slots().items()}

    def stepped(self, weights, offset: int):
        return self.buffers.shard_of(weights.read_value(), offset)

    def write(self, weights, new):
        return new  # zero.gather writes every replica's into the whole weights

    def _apply(self, grad, finite, clip, learning_rate) -> None:
        buffers = self.buffers
        new = ops.cond(finite, lambda: buffers.update(grad, clip, learning_rate),
                       lambda: buffers.shard_of(buffers.local("weights").read_value()))
        zero.gather(buffers, new)
