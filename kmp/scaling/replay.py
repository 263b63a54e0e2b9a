"""overflow="replay": an overflowing step recomputed on its own batch at the lowered scale, inside the step.

The step hands the optimizer a `Replay`: its loss, and the forward/backward
pass again on the same batch, weights and seeds at a given scale. Then, in
replica context, after the all-reduce and the overflow check ("skip"'s):

    if not finite:                                  # agreed by every replica: on a clean step a
                                                    # branch not taken, the rest of the step as before
        if every replica's loss is finite:          # else no scale helps (a forward overflow,
                                                    # kmp.engine.forward_overflow): skipped as before
            while not finite and replays < MAX_REPLAYS and scale > min_scale:
                scale = max(scale * backoff, min_scale); good_steps = 0   # hysteresis is not spent:
                                                    # the same scale would overflow again
                grads = forward_backward(batch, scale) / scale
                grads = all_reduce(grads); finite, clip = check(grads)
            replayed_steps += 1
    update(grads) if finite; adjust(finite)         # as "skip": the batch counts once in `iterations`
                                                    # and the schedule; still not finite: skipped

With gradient accumulation each micro-batch is checked as it arrives (one
all-reduce of a flag, no gradient exchange) and only an overflowing one is
replayed, the same way, before it joins the window; the window's own check
stays.

Under MirroredStrategy every all-reduce is a merge_call, which cannot sit in
a replica's own cond or loop: the branch and its loop are then built across
replicas, each retry run on every replica (`_Across`), as kmp's accumulation
window is. That branch takes no gradient in and gives each replica one packed
tensor out (empty on a clean step); each replica then picks its own gradients
or the replayed ones in a cond of its own, on its device. A branch across
replicas that passed every variable's gradient of every replica through
itself made a clean per-variable step 1.3x slower on two CPUs, this one 1.13x
(benchmarks/replay_overhead.py); the flat buffers' (one tensor) 1.01-1.03x either way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from kmp import seams
from kmp.distribute.communication import all_reduce_sum, cpus_of_one_process

# Retries of one step: from kmp's initial 2**15, 8 halvings reach 2**7. A step that still overflows is
# skipped as with "skip", and the next step starts from the scale reached.
MAX_REPLAYS = 8


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the step gives the optimizer to replay its batch: `gradients(scale)`, this replica's gradients
    of the same batch at `scale`, unscaled float32 in the form the optimizer's layout takes; and its `loss`."""

    gradients: Callable
    loss: object


def local_finite(grads):
    """Whether this replica's gradients (a list, None allowed) hold no inf or nan."""
    flags = [tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
             for g in grads if g is not None]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def agreed_finite(grads):
    """Whether every replica's gradients are finite: one all-reduce of a flag (none on one replica)."""
    bad = tf.cast(tf.logical_not(local_finite(grads)), tf.float32)
    (total,) = all_reduce_sum([bad])
    return total == 0


def replayed(optimizer, replay: Replay, grads, finite, clip, flags, layout, count, weight, reduce: bool = True):
    """(grads, finite, clip, flags) after replaying an overflowing step (replica context); as they are on a
    clean one. `reduce`: the gradients are all-reduced and checked by the layout (an effective step), else
    only checked on every replica (a micro-batch, kmp.scaling.accumulate)."""
    strategy = tf.distribute.get_strategy()
    given = (grads, finite, clip, flags)
    out = tf.__internal__.distribute.interim.maybe_merge_call(
        _branch, strategy, optimizer, replay, given, layout, count, weight, reduce)
    if not isinstance(out, _Packed):
        return out
    # Built across replicas: this replica's own choice, on its device (see the module docstring).
    leaves = tf.nest.flatten(given, expand_composites=True)
    present = [v is not None for v in leaves]

    def tensors(structure):
        return [v for v in tf.nest.flatten(structure, expand_composites=True) if v is not None]

    chosen = iter(tf.cond(out.replayed, lambda: tensors(out.unpacked(given)), lambda: tensors(given)))
    return tf.nest.pack_sequence_as(given, [next(chosen) if p else None for p in present], expand_composites=True)


def _branch(strategy, optimizer, replay, given, layout, count, weight, reduce):
    if tf.distribute.in_cross_replica_context():
        return _branch_across(strategy, optimizer, replay, given, layout, count, weight, reduce)
    across = _Across(strategy, given)

    def overflowed():
        def retry(replay, layout, count, weight):
            return _retry(optimizer, replay, layout, count, weight, reduce)

        can = across.first(across.each(lambda r: _loss_finite(r), replay))
        config = optimizer.loss_scale_config

        def more(i, scale, state):
            return (tf.logical_not(across.first(state[1])) & can & (i < MAX_REPLAYS)
                    & (scale > config.min_scale))

        def body(i, _, state):
            state = across.each(retry, replay, layout, count, weight)
            return i + 1, tf.convert_to_tensor(optimizer.dynamic_scale.value), across.flat(state)

        start = (tf.constant(0), tf.convert_to_tensor(optimizer.dynamic_scale.value), across.flat(across.given))
        i, _, state = tf.while_loop(lambda i, s, f: more(i, s, across.grouped(f)), body, start)
        with tf.control_dependencies(state):
            optimizer.replayed_steps.assign_add(tf.cast(i > 0, optimizer.replayed_steps.dtype))
        return [tf.identity(t) for t in state]

    out = tf.cond(across.first(given[1]), lambda: across.flat(across.given), overflowed)
    return across.grouped(out)


def _branch_across(strategy, optimizer, replay, given, layout, count, weight, reduce):
    """The replays built across replicas: a _Packed per replica (regrouped), its gradients packed in one tensor."""
    across = _Across(strategy, given)
    config = optimizer.loss_scale_config
    template = _Packed.template(across.template)

    def retry(replay, layout, count, weight):
        return _retry(optimizer, replay, layout, count, weight, reduce)

    def none_replayed():
        return [t for _ in range(across.count) for t in template.nothing()]

    def replays():
        # The first retry here: no gradient of the step enters this branch. The retries after it are
        # nested conds, not a while loop: under MultiWorkerMirroredStrategy a collective inside a while
        # loop built across replicas never met its peer (DeadlineExceeded), inside a cond it does.
        def retried(level, flat):
            if level == MAX_REPLAYS:
                return flat
            again = (tf.logical_not(across.first(across.grouped(flat)[1]))
                     & (tf.convert_to_tensor(optimizer.dynamic_scale.value) > config.min_scale))
            return tf.cond(again,
                           lambda: retried(level + 1, across.flat(across.each(retry, replay, layout, count, weight))),
                           lambda: flat)

        first = across.flat(across.each(retry, replay, layout, count, weight))
        if not cpus_of_one_process(strategy):
            flat = retried(1, first)
        else:
            # CPUs of one process sum without collectives: a while loop, whose untaken branch costs the clean
            # step less than the nested conds (per variable, 1.14x against 1.31x: benchmarks/RESULTS.md).
            def more(i, flat):
                return (tf.logical_not(across.first(across.grouped(flat)[1])) & (i < MAX_REPLAYS)
                        & (tf.convert_to_tensor(optimizer.dynamic_scale.value) > config.min_scale))

            def body(i, _):
                return i + 1, across.flat(across.each(retry, replay, layout, count, weight))

            _, flat = tf.while_loop(more, body, (tf.constant(1), first))
        with tf.control_dependencies(flat):
            optimizer.replayed_steps.assign_add(tf.constant(1, optimizer.replayed_steps.dtype))
        states = across.grouped(flat)
        return [t for k in range(across.count) for t in template.packed(across.replica(states, k))]

    def overflowed():
        can = across.first(across.each(_loss_finite, replay))
        above = tf.convert_to_tensor(optimizer.dynamic_scale.value) > config.min_scale
        return tf.cond(can & above, replays, none_replayed)

    out = tf.cond(across.first(given[1]), none_replayed, overflowed)
    size = len(template.nothing())
    return seams.get("regroup")([template.made(out[k * size:(k + 1) * size]) for k in range(across.count)])


class _Packed:
    """One replica's replayed (grads, finite, clip, flags), its gradients packed in one float32 tensor, and
    whether they were replayed."""

    def __init__(self, has_clip, has_flags, tensors=None):
        self.has_clip, self.has_flags = has_clip, has_flags
        self.tensors = tensors

    @classmethod
    def template(cls, given):
        _, _, clip, flags = given
        return cls(clip is not None, flags is not None)

    def nothing(self):
        """A step not replayed: nothing packed (its own gradients stay)."""
        out = [tf.constant(False), tf.zeros([0], tf.float32), tf.constant(False)]
        return out + [tf.constant(1.0)] * self.has_clip + [tf.zeros([0], tf.bool)] * self.has_flags

    def packed(self, state):
        grads, finite, clip, flags = state
        grads = [grads] if tf.is_tensor(grads) else grads  # the flat buffers' one gradient
        dense = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads if g is not None]
        out = [tf.constant(True), tf.concat(dense, 0) if dense else tf.zeros([0]), finite]
        if self.has_clip:
            out.append(clip)
        if self.has_flags:
            out.append(flags if tf.is_tensor(flags) else tf.stack(flags))
        return out

    def made(self, tensors):
        return _Packed(self.has_clip, self.has_flags, list(tensors))

    @property
    def replayed(self):
        return self.tensors[0]

    def unpacked(self, given):
        """(grads, finite, clip, flags) shaped as `given`, this replica's own."""
        grads, _, clip, flags = given
        packed, finite = self.tensors[1], self.tensors[2]
        rest = self.tensors[3:]
        one = tf.is_tensor(grads)  # the flat buffers' one gradient
        grads = [grads] if one else grads
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            if isinstance(g, tf.IndexedSlices):
                shape = tf.TensorShape(tf.get_static_value(g.dense_shape))
                rows = tf.range(shape[0], dtype=g.indices.dtype)
                size = shape.num_elements()
                out.append(tf.IndexedSlices(tf.reshape(packed[offset:offset + size], shape), rows, g.dense_shape))
            else:
                size = g.shape.num_elements()
                out.append(tf.reshape(packed[offset:offset + size], g.shape))
            offset += size
        new_clip = rest.pop(0) if self.has_clip else clip
        new_flags = None
        if self.has_flags:
            vector = rest.pop(0)
            new_flags = tf.reshape(vector, flags.shape) if tf.is_tensor(flags) else tf.unstack(vector, len(flags))
        return (out[0] if one else out), finite, new_clip, new_flags


def _loss_finite(replay):
    (bad,) = all_reduce_sum([tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(replay.loss))), tf.float32)])
    return bad == 0


def _retry(optimizer, replay, layout, count, weight, reduce):
    """One retry on this replica: the scale backed off, the batch's gradients again, all-reduced and checked."""
    config = optimizer.loss_scale_config
    scale = tf.maximum(optimizer.dynamic_scale.value * config.backoff_factor, config.min_scale)
    optimizer.dynamic_scale.assign(scale)
    optimizer.good_steps.assign(0)
    grads = replay.gradients(scale)
    if not reduce:
        return grads, agreed_finite(grads), None, None
    grads = layout.reduce(optimizer, grads, count, weight)
    finite, clip, flags = layout.check(optimizer, grads)
    return grads, finite, clip, flags


class _Across:
    """Per-replica values as one flat list of tensors (replica after replica), which a cond or a while loop
    built across replicas can carry; and back. In a replica's own context (one replica, or no merge_call)
    the list is that replica's."""

    def __init__(self, strategy, given):
        self.strategy, self.given = strategy, given
        self.across = tf.distribute.in_cross_replica_context()
        self.count = len(strategy.extended.worker_devices) if self.across else 1
        self.template = self.replica(given, 0)
        self.present = [v is not None for v in tf.nest.flatten(self.template, expand_composites=True)]

    def replica(self, value, k):
        def local(v):
            if isinstance(v, tf.distribute.DistributedValues):
                return self.strategy.experimental_local_results(v)[k]
            return v

        return tf.nest.map_structure(local, value)

    def flat(self, value):
        """`value` (this structure, per replica) as its tensors, replica after replica."""
        out = []
        for k in range(self.count):
            leaves = tf.nest.flatten(self.replica(value, k), expand_composites=True)
            out += [v for v in leaves if v is not None]
        return out

    def grouped(self, tensors):
        """`flat`'s tensors as the structure again: per replica across replicas, else this replica's."""
        tensors = list(tensors)
        size = sum(self.present)
        structures = []
        for k in range(self.count):
            mine = iter(tensors[k * size:(k + 1) * size])
            leaves = [next(mine) if p else None for p in self.present]
            structures.append(tf.nest.pack_sequence_as(self.template, leaves, expand_composites=True))
        if not self.across:
            return structures[0]
        return seams.get("regroup")(structures)

    def first(self, value):
        """The first replica's value of something every replica agrees on (a flag)."""
        return self.replica(value, 0) if self.across else value

    def each(self, fn, *args):
        """fn(*args) on every replica: from across the replicas, or here."""
        if self.across:
            return self.strategy.extended.call_for_each_replica(fn, args=args)
        return fn(*args)
