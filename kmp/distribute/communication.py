"""The gradient all-reduce: flat buckets, one collective each, in a chosen dtype;
and the mean that the update applies (reduce_mean).

    all_reduce_sum(grads, communication, loss_scale):
        for each bucket of float32 gradients (at most bytes_per_pack bytes;
        0 means one bucket for the whole model):
            flat = concat(reshape(g, [-1]) * pre) as communication.dtype
            flat = replica_context.all_reduce(SUM, flat)     # one collective (CPUs of one
                                                             # process: one add_n, _sum)
            grads = split(float32(flat) * post)
        other gradients (sparse, float8 overwrite-with-gradient) one by one

Why flat buckets: they make the bucket size the user's (DeepSpeed's
allreduce bucket; TensorFlow's collectives pack the same way under
MultiWorkerMirroredStrategy), they give every communication dtype one cast
per bucket, and they keep the count of collectives per step at the number
of buckets. They are not faster than TensorFlow's own list all-reduce on
two logical CPUs: no speed claim here.

The factors, as DeepSpeed defines them for its `communication_data_type`,
`prescale_gradients` and `gradient_predivide_factor`:

- Each replica's gradient reaches this point already divided by the number
  of replicas N (Keras divides each replica's loss by N), which is
  DeepSpeed's `prescale_gradients: true`. `predivide_factor=f` is its
  postscaling instead: the sum travels as grad * N / f and is multiplied by
  f / N after, so the partial sums stay in range for f ~ N.
- float16 communication sends the *scaled* gradients (times the loss
  scale), as DeepSpeed's fp16 engine does: unscaled gradients underflow in
  float16. A sum that overflows float16 becomes inf, is caught by the
  overflow check after the reduce, and skips the step like any overflow.
- bfloat16 has float32's range: its gradients travel unscaled.
"""

from __future__ import annotations

import tensorflow as tf

from kmp.config.settings import Communication


def all_reduce_sum(grads: list, communication: Communication | None = None, loss_scale=None) -> list:
    """Sums gradients across replicas, one collective per bucket; `None`s pass through.

    `loss_scale` (the scale the gradients were divided by) is needed only for
    float16 communication.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(grads)
    communication = communication or Communication()
    dtype = tf.as_dtype(communication.dtype)

    # TensorFlow's collectives pack by the same size (MultiWorkerMirrored);
    # a bucket is already within it, so this only keeps TF from re-splitting.
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=communication.bytes_per_pack)
    out = list(grads)
    flat = [i for i, g in enumerate(grads) if _flattenable(g)]
    for bucket in _buckets([grads[i] for i in flat], dtype.size, communication.bytes_per_pack):
        members = [flat[k] for k in bucket]
        buffer = tf.concat([tf.reshape(grads[i], [-1]) for i in members], axis=0)
        buffer = in_transit(buffer, communication, loss_scale, lambda sent: _sum(ctx, sent, options))
        sizes = [grads[i].shape.num_elements() for i in members]
        for i, part in zip(members, tf.split(buffer, sizes)):
            out[i] = tf.reshape(part, grads[i].shape)
    bucketed = set(flat)
    others = [i for i, g in enumerate(grads) if g is not None and i not in bucketed]
    if others:
        for i, reduced in zip(others, ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in others], options)):
            out[i] = reduced
    return out


def _sum(ctx, buffer, options):
    """One bucket summed across the replicas, every replica getting the sum.

    Replicas that are CPUs of one process share its memory: the sum is one
    add_n on the first replica's device, which the others read. TensorFlow's
    all-reduce for them (ReductionToOneDevice) adds the same way but copies
    the sum back to every device and wraps it for gradients, several times
    slower. Elsewhere (GPUs, several workers) TensorFlow's collective.
    """
    if not cpus_of_one_process(ctx.strategy):
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, buffer, options)
    return ctx.merge_call(_add_on_first_device, args=(buffer,))


def cpus_of_one_process(strategy) -> bool:
    """Whether `strategy`'s replicas are CPUs of this process (MirroredStrategy on logical CPUs): they share memory."""
    if not isinstance(strategy, tf.distribute.MirroredStrategy):  # MultiWorkerMirrored is not one
        return False
    if not strategy.extended._use_merge_call():  # a strategy run without merge_call (as on NCCL GPUs)
        return False
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    return all(d.device_type == "CPU" and (d.job, d.task) == (devices[0].job, devices[0].task) for d in devices)


def _add_on_first_device(strategy, per_replica):
    parts = strategy.experimental_local_results(per_replica)
    with tf.device(parts[0].device):
        return tf.add_n(parts)


def in_transit(flat, communication: Communication, loss_scale, reduce):
    """reduce(flat as it travels): times factor() and in communication.dtype; back to float32 after, divided."""
    pre = factor(tf.distribute.get_replica_context().num_replicas_in_sync, communication, loss_scale)
    sent = tf.cast(flat if pre is None else flat * pre, communication.dtype)
    out = tf.cast(reduce(sent), tf.float32)
    return out if pre is None else out / pre


def factor(replicas: int, communication: Communication, loss_scale):
    """What the gradients are multiplied by before the reduce and divided by after; None: neither."""
    pre = None
    if communication.predivide_factor is not None:
        pre = tf.constant(replicas / communication.predivide_factor, tf.float32)
    if communication.dtype == "float16":
        scale = tf.cast(loss_scale, tf.float32)
        pre = scale if pre is None else pre * scale
    return pre


def _flattenable(g) -> bool:
    return (
        g is not None
        and not isinstance(g, tf.IndexedSlices)
        and g.dtype == tf.float32
        and g.shape.is_fully_defined()
    )


def _buckets(grads: list, itemsize: int, bytes_per_pack: int) -> list[list[int]]:
    """Consecutive groups of at most `bytes_per_pack` bytes (a larger tensor is its own group)."""
    if not grads:
        return []
    if bytes_per_pack == 0:
        return [list(range(len(grads)))]
    groups, current, size = [], [], 0
    for k, g in enumerate(grads):
        nbytes = g.shape.num_elements() * itemsize
        if current and size + nbytes > bytes_per_pack:
            groups.append(current)
            current, size = [], 0
        current.append(k)
        size += nbytes
    groups.append(current)
    return groups


def chunks(flat, communication: Communication) -> list:
    """One flat tensor cut into the all-reduce buckets (`bytes_per_pack` bytes in its dtype; 0: one)."""
    per_bucket = communication.bytes_per_pack // tf.as_dtype(communication.dtype).size
    size = flat.shape[0]
    if not per_bucket or size <= per_bucket:
        return [flat]
    sizes = [per_bucket] * (size // per_bucket) + ([size % per_bucket] if size % per_bucket else [])
    return tf.split(flat, sizes)


def reduce_mean(grads: list, communication: Communication, loss_scale, count=None, weight=None) -> list:
    """The gradient to apply: summed across replicas once, then averaged.

    `count` micro-batches were summed per replica (accumulation), or, with
    `weight` (e.g. a token count), the result is sum(grads) / sum(weights) over
    every micro-batch of every replica.
    """
    if weight is None:
        grads = all_reduce_sum(grads, communication, loss_scale)
        return grads if count is None else [None if g is None else g / count for g in grads]
    if communication.dtype == "float16":
        # A token count times the loss scale would overflow float16.
        grads = all_reduce_sum(grads, communication, loss_scale)
        (total,) = all_reduce_sum([weight])
    else:
        *grads, total = all_reduce_sum(list(grads) + [weight], communication, loss_scale)
    return [None if g is None else g / total for g in grads]
