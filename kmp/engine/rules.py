"""The optimizer rules kmp.engine.buffers applies to flat tensors that kmp.engine.fused does not have.

Each rule is Keras 3.15's `update_step`, op for op, on one flat tensor per
slot (`scalars` once per step, `update` on the whole buffer). SGD, Adam and
AdamW use kmp.engine.fused's rules. Lamb's trust ratio is per variable: the norms
are sums over each variable's segment of the buffer. kmp.scaling.eight_bit's 8-bit
Adam and AdamW run its adam_update on their buffers of codes and scales.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kmp.engine import fused
from kmp.scaling.eight_bit import Adam8bit, AdamW8bit, adam_update

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


class EightBitAdam:
    """kmp.scaling.eight_bit's Adam8bit/AdamW8bit update_step on flat buffers (its adam_update, on whole buffers).

    Each moment is two buffers, its uint8 codes (one per element) and its
    float32 scales (one per block); the second moment is stored as its square
    root. kmp.engine.buffers starts every variable on a block, so the blocks,
    codes and scales are those of the Keras variables; the elements that pad a
    variable to whole blocks hold code 0, the value 0.
    """

    slots = (("momentum_codes", "_moment_codes"), ("momentum_scales", "_moment_scales"),
             ("velocity_codes", "_velocity_codes"), ("velocity_scales", "_velocity_scales"))
    # The variables under the optimizer's min_8bit_size keep Adam's float32 moments, at the buffers' start,
    # stepped by fused._Adam: two float32 slot buffers over their elements only (the codes cover every element).
    float32_slots = ADAM_SLOTS
    blocks = True  # kmp.engine.buffers aligns each variable to the optimizer's block_size
    per_block = ("momentum_scales", "velocity_scales")
    dtypes = {"momentum_codes": tf.uint8, "velocity_codes": tf.uint8}

    @staticmethod
    def scalars(h, lr, local_step, dtype):
        return {**fused._Adam.scalars(h, lr, local_step, dtype), "local_step": local_step}

    @staticmethod
    def update(s, h, value, grad, slots):
        step, states = adam_update(grad, [slot.read_value() for slot in slots], s["alpha"], s["one_minus_beta_1"],
                                   s["one_minus_beta_2"], s["epsilon"], h["block_size"], s["local_step"])
        for slot, state in zip(slots, states):
            slot.assign(state)
        return value - step


# The rules whose Keras update squares the gradient (a second moment, an accumulator). Keras squares a sparse
# gradient (an embedding lookup's) row by row, before repeated rows and the replicas' rows are summed; the flat
# buffers receive the summed gradient and square that (kmp.engine.buffers.join says so once). kmp's 8-bit
# update makes the gradient dense first on both paths.
SQUARING = (fused._Adam, Adagrad, Lamb)

RULES = {keras.optimizers.SGD: fused._SGD, keras.optimizers.Adam: fused._Adam, keras.optimizers.AdamW: fused._Adam,
          keras.optimizers.Lion: Lion, keras.optimizers.Adagrad: Adagrad, keras.optimizers.Lamb: Lamb,
          Adam8bit: EightBitAdam, AdamW8bit: EightBitAdam}
HYPERPARAMETERS = {**fused._HYPERPARAMETERS, keras.optimizers.Lion: ("beta_1", "beta_2"),
                   keras.optimizers.Adagrad: ("epsilon",), keras.optimizers.Lamb: ("beta_1", "beta_2", "epsilon"),
                   Adam8bit: ("beta_1", "beta_2", "epsilon", "block_size"),
                   AdamW8bit: ("beta_1", "beta_2", "epsilon", "block_size")}
