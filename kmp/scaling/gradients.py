"""What kmp does to a list of gradients between the backward pass and the update.

    unscale(g, scale)        g / scale, in float32 (the master precision)
    finite_flags(grads)      per gradient: no inf or nan (sparse values included)
    all_finite(flat)         one tensor: no inf or nan, from its sum when that is finite
    clip_by_global_norm(grads, clip)
                             Keras's global-norm clip, op for op, except that
                             finite gradients too large to square still get a
                             finite norm; a gradient holding inf or nan makes
                             every gradient nan, so the finite check sees it
    clipped_check(finite, grads, clip)
                             (finite, clip factor): the factor by the global
                             norm, which a finite step needs finite too
    norm_parts(g) / norm_of_parts(largest, rest)
                             the same norm from shards: each shard's two
                             numbers, combined on every replica

Plain TensorFlow on tensors: no variables, no distribution.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops


def typed_where(cond, a, b):
    """`tf.where` that gives Python numbers the dtype of the tensor beside them."""
    ref = next((x for x in (a, b) if tf.is_tensor(x)), None)
    if ref is not None:
        a, b = (tf.cast(x, ref.dtype) for x in (a, b))
    return tf.where(cond, a, b)


def unscale(grad, scale):
    """`grad / scale`, computed in float32; None stays None. A `scale` of None: float32(grad)."""
    if grad is None:
        return None
    if scale is None:
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(grad.values, tf.float32), grad.indices, grad.dense_shape)
        return tf.cast(grad, tf.float32)
    scale = tf.cast(scale, tf.float32)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, tf.float32) / scale, grad.indices, grad.dense_shape)
    return tf.cast(grad, tf.float32) / scale


def finite_flags(grads) -> list:
    """One scalar per gradient: True iff it holds no inf or nan (None and sparse ones included)."""
    return [
        tf.constant(True) if g is None
        else tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads
    ]


def all_finite(flat):
    """Whether `flat` holds no inf or nan (a bool scalar), from its sum when that is finite.

    A finite sum means every element is finite: an inf or a nan carries
    through any order of addition. Only a sum that overflowed from finite
    elements needs the exact check, which then runs instead. TensorFlow's
    sum is one multi-threaded read, faster than reduce_all(is_finite) and
    than the sum in XLA (which XLA:CPU reduces on one thread).
    """
    return tf.cond(tf.math.is_finite(tf.reduce_sum(flat)), lambda: tf.constant(True),
                   lambda: tf.reduce_all(tf.math.is_finite(flat)))


def global_norm(grads):
    """sqrt(sum of squares) over every gradient: Keras's `global_norm`, and finite
    for finite gradients.

    Squares of finite float32 values above ~1.8e19 overflow, and Keras's norm
    is then inf (its clip turns every gradient into nan). Only in that case the
    norm is computed again scaled by the largest |g|, which stays finite; a
    gradient that holds inf or nan still gives a non-finite norm.
    """
    grads = [g for g in grads if g is not None]
    norm = ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(g)) for g in grads])))

    def rescaled():
        largest = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(g)) for g in grads]))
        return largest * tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g / largest)) for g in grads]))

    return tf.cond(tf.math.is_inf(norm), rescaled, lambda: norm)


def norm_parts(g):
    """(largest, rest) with norm(g) = largest * sqrt(rest): (1, sum of squares), or, where the
    squares of finite values overflow, (max |g|, sum of (g / max |g|)^2), as global_norm does."""
    squares = tf.reduce_sum(tf.square(g))

    def rescaled():
        largest = tf.reduce_max(tf.abs(g))
        return largest, tf.reduce_sum(tf.square(g / largest))

    return tf.cond(tf.math.is_inf(squares), rescaled, lambda: (tf.ones([]), squares))


def norm_of_parts(largest, rest):
    """The norm of every shard's gradient from each shard's norm_parts (two vectors):
    L * sqrt(sum (largest / L)^2 * rest), L = max largest; sqrt(sum rest) when no square overflowed.

    In float64 (a few numbers): shards whose sums of squares are each finite
    can add up past float32's range, where the whole gradient's norm is finite.
    """
    largest, rest = tf.cast(largest, tf.float64), tf.cast(rest, tf.float64)
    top = tf.reduce_max(largest)
    return tf.cast(top * tf.sqrt(tf.reduce_sum(tf.square(largest / top) * rest)), tf.float32)


def global_clip_scale(grads, clip_norm):
    """The factor Keras's `clip_by_global_norm` multiplies every gradient by.

    min(1, clip_norm / norm), and nan when the norm is not finite: a clip of an
    overflowing gradient must not look finite.
    """
    return clip_scale(global_norm(grads), clip_norm)


def clipped_check(finite, grads, clip_norm):
    """(finite, clip factor): with clipping, the factor by the global norm of `grads`, and a finite
    step needs the factor finite too (the values applied are grads * factor). Without: (finite, None)."""
    if clip_norm is None:
        return finite, None
    clip = global_clip_scale(grads, clip_norm)
    return finite & tf.math.is_finite(clip), clip


def clip_scale(norm, clip_norm):
    """global_clip_scale's factor for a gradient of norm `norm`."""
    scale_for_finite = clip_norm * ops.minimum(1.0 / norm, 1.0 / clip_norm)
    return scale_for_finite + (norm - norm)


def clip_by_global_norm(grads, clip_norm):
    scale = global_clip_scale(grads, clip_norm)
    return [g * scale if g is not None else g for g in grads]
