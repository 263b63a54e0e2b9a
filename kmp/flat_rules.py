"""The optimizer rules kmp.flat applies to flat tensors that kmp.fused does not have.

Each rule is Keras 3.15's `update_step`, op for op, on one flat tensor per
slot (`scalars` once per step, `update` on the whole buffer). SGD, Adam and
AdamW use kmp.fused's rules. Lamb's trust ratio is per variable: the norms
are sums over each variable's segment of the buffer.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kmp import fused

ADAM_SLOTS = (("momentum", "_momentums"), ("velocity", "_velocities"))


class Lion:
    """keras.optimizers.Lion.update_step on flat tensors."""

    slots = (("momentum", "_momentums"),)

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        return {"beta_1": tf.cast(h["beta_1"], dtype), "beta_2": tf.cast(h["beta_2"], dtype)}

    @staticmethod
    def update(s, h, value, grad, slots):
        (m,) = slots
        m_value = m.read_value()
        step = s["lr"] * tf.sign(m_value * s["beta_1"] + grad * (1.0 - s["beta_1"]))
        m.assign(m_value * s["beta_2"] + grad * (1.0 - s["beta_2"]))
        return value - step


class Adagrad:
    """keras.optimizers.Adagrad.update_step on flat tensors."""

    slots = (("accumulator", "_accumulators"),)

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        return {"epsilon": tf.constant(h["epsilon"], dtype)}

    @staticmethod
    def update(s, h, value, grad, slots):
        (accumulator,) = slots
        total = accumulator.read_value() + tf.square(grad)
        accumulator.assign(total)
        return value - (s["lr"] * grad) / tf.sqrt(total + s["epsilon"])


class Lamb:
    """keras.optimizers.Lamb.update_step on flat tensors: its trust ratio per variable (segment)."""

    slots = ADAM_SLOTS
    per_variable = True

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        return {"beta_1_power": tf.pow(tf.cast(h["beta_1"], dtype), local_step),
                "beta_2_power": tf.pow(tf.cast(h["beta_2"], dtype), local_step)}

    @staticmethod
    def update(s, h, value, grad, slots):
        m, v = slots
        m_value, v_value = m.read_value(), v.read_value()
        m_value = m_value + (grad - m_value) * (1 - h["beta_1"])
        v_value = v_value + (tf.square(grad) - v_value) * (1 - h["beta_2"])
        m.assign(m_value)
        v.assign(v_value)
        update = (m_value / (1.0 - s["beta_1_power"])) / (
            tf.sqrt(v_value / (1.0 - s["beta_2_power"])) + h["epsilon"])

        def norms(x):
            return tf.gather(tf.sqrt(tf.math.unsorted_segment_sum(tf.square(x), s["segments"], s["count"])),
                             s["segments"])

        w_norm, g_norm = norms(value), norms(update)
        ratio = tf.where(w_norm > 0, tf.where(g_norm > 0, w_norm / g_norm, 1.0), 1.0)
        return value - ratio * s["lr"] * update


RULES = {keras.optimizers.SGD: fused._SGD, keras.optimizers.Adam: fused._Adam, keras.optimizers.AdamW: fused._Adam,
          keras.optimizers.Lion: Lion, keras.optimizers.Adagrad: Adagrad, keras.optimizers.Lamb: Lamb}
HYPERPARAMETERS = {**fused._HYPERPARAMETERS, keras.optimizers.Lion: ("beta_1", "beta_2"),
                   keras.optimizers.Adagrad: ("epsilon",), keras.optimizers.Lamb: ("beta_1", "beta_2", "epsilon")}
