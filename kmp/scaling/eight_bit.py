"""8-bit Adam and AdamW: the two moments stored block-wise in 8-bit floats (kmp.scaling.quantize).

    kmp.wrap(keras.optimizers.AdamW(1e-3), states="8bit")     # the same settings, 8-bit moments
    kmp.AdamW8bit(1e-3, weight_decay=0.01)                    # or the class itself (kmp.Adam8bit too)

Why: Adam's two float32 moments are 8 bytes per parameter on every replica,
twice the float32 weights. Stored as one byte per element plus one float32
scale per block of `block_size` elements of each variable, they take
2 + 8/256 bytes.

The update is Keras's Adam.update_step on the decoded moments, op for op
(AdamW's decay is Keras's, before it). The weight moves with the new
moments' exact values; then they are encoded again. The first moment m is
stored signed, the second v as its square root (half the binades; Adam
divides by sqrt(v) anyway):

    m = decode(m8, m_scale);                  v = decode(r8, r_scale) ** 2
    m += (g - m) * (1 - beta_1);              v += (g^2 - v) * (1 - beta_2)
    w -= lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)
    m8 = encode(m, m_scale');                 r8 = encode(sqrt(v), r_scale', stochastically)

The new scales bound the new moments before they are computed (adam_update),
so the moments are decoded, updated and encoded in one pass over the
elements (the gradient's block maxima take one more). Each variable's blocks
are its own. As bitsandbytes does, variables under `min_8bit_size` elements
(4096) keep Adam's float32 moments and Keras's Adam step: their states are a
small part of a model's, and an output layer's and the biases' are the ones
accuracy can hinge on (benchmarks/RESULTS.md, the demo). On kmp.prepare's
flat buffers the same update runs on whole buffers of codes and scales
(kmp.engine.rules.EightBitAdam; kmp.engine.buffers starts each variable on a
block, so the blocks are these; the float32 moments are a run of their own),
and ZeRO stage 1 shards them by whole blocks. kmp's per-variable fused update
(kmp.engine.fused) is for float32 states: without the flat buffers this
class's update_step runs. `amsgrad` is not offered.
"""

from __future__ import annotations

import functools
import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from kmp.distribute.same_start import same_start
from kmp.errors import Problem, check
from kmp.memory.estimate import MIN_8BIT_SIZE
from kmp.scaling import quantize

STATES = ("32bit", "8bit")


class _EightBitStates:
    """Adam's build and update_step with 8-bit moments (mixed into Keras's Adam and AdamW)."""

    def __init__(self, *args, block_size=quantize.BLOCK_SIZE, min_8bit_size=MIN_8BIT_SIZE, **kwargs):
        problems = []
        if kwargs.get("amsgrad"):
            problems.append(Problem("amsgrad", "False (8-bit states keep no float32 velocity maximum)", True,
                                    "Use the 32-bit optimizer for amsgrad."))
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            problems.append(Problem("block_size", "an integer >= 1 (256 is the default)", block_size))
        if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool) or min_8bit_size < 0:
            problems.append(Problem("min_8bit_size", f"an integer >= 0 ({MIN_8BIT_SIZE} is the default; 0 quantizes "
                                    "every variable)", min_8bit_size))
        check(problems, f"kmp.{type(self).__name__} arguments")
        super().__init__(*args, **kwargs)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size

    def quantizes(self, size: int) -> bool:
        """Whether a variable of `size` elements keeps 8-bit moments (else Adam's float32 ones)."""
        return size >= self.min_8bit_size

    def build(self, var_list):
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)  # iterations, indices; not Adam's float32 slots
        self._moment_codes, self._moment_scales, self._velocity_codes, self._velocity_scales = [], [], [], []
        # Adam's own float32 moments, for the variables under min_8bit_size (None for the others).
        self._momentums, self._velocities = [], []
        strategy = self._distribution_strategy
        for variable in var_list:
            size = math.prod(variable.shape)
            if not self.quantizes(size):
                for states in (self._moment_codes, self._moment_scales, self._velocity_codes, self._velocity_scales):
                    states.append(None)
                self._momentums.append(self.add_variable_from_reference(variable, "momentum"))
                self._velocities.append(self.add_variable_from_reference(variable, "velocity"))
                continue
            self._momentums.append(None)
            self._velocities.append(None)
            blocks = -(-size // self.block_size)
            # Zero scales decode to exact zeros, whatever the codes: Adam's zero start.
            for codes, scales, name in ((self._moment_codes, self._moment_scales, "momentum"),
                                        (self._velocity_codes, self._velocity_scales, "velocity")):
                # Zeros on every worker: made without MultiWorkerMirrored's broadcast, which takes no uint8.
                with strategy.extended.colocate_vars_with(_tf_variable(variable)), same_start(strategy):
                    codes.append(self.add_variable((size,), dtype="uint8", name=f"{name}_8bit"))
                    scales.append(self.add_variable((blocks,), dtype="float32", name=f"{name}_scale"))

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        if self._moment_codes[index] is None:  # under min_8bit_size: Keras's Adam step on float32 moments
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        # Flat, with its static length (an embedding's gradient made dense has none).
        gradient = ops.reshape(ops.cast(tf.convert_to_tensor(gradient), dtype), [math.prod(variable.shape)])
        local_step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        states = self._states(index)
        # One variable's update at a time: each decodes its moments to float32 (8 bytes per element, and as
        # much again for the new ones), and TensorFlow would run every variable's at once, holding more than
        # the 8-bit states save (benchmarks/memory.py).
        with tf.control_dependencies(self._updated_before()):
            step, new_states = adam_update(gradient, [_read(state) for state in states], alpha, 1 - self.beta_1,
                                           1 - self.beta_2, self.epsilon, self.block_size, local_step)
        self._last_update = step
        self.assign_sub(variable, ops.reshape(step, variable.shape))
        for state, value in zip(states, new_states):
            self.assign(state, value)

    def _updated_before(self) -> list:
        """The previous variable's update in the graph being traced (none in another graph, or eagerly)."""
        last = getattr(self, "_last_update", None)
        if last is None or tf.executing_eagerly() or last.graph is not tf.compat.v1.get_default_graph():
            return []
        return [last]

    def moments(self, variable) -> tuple[tf.Tensor, tf.Tensor]:
        """(m, v) of `variable` as float32, decoded (for inspection and tests)."""
        index = self._get_variable_index(variable)
        if self._moment_codes[index] is None:
            return ops.convert_to_tensor(self._momentums[index]), ops.convert_to_tensor(self._velocities[index])
        m_codes, m_scales, r_codes, r_scales = (_read(s) for s in self._states(index))
        m = quantize.decode(m_codes, m_scales, True, self.block_size)
        r = quantize.decode(r_codes, r_scales, False, self.block_size)
        return ops.reshape(m, variable.shape), ops.reshape(ops.square(r), variable.shape)

    def _states(self, index) -> tuple:
        """Variable `index`'s (m codes, m scales, sqrt(v) codes, sqrt(v) scales)."""
        return (self._moment_codes[index], self._moment_scales[index],
                self._velocity_codes[index], self._velocity_scales[index])

    def get_config(self):
        return {**super().get_config(), "block_size": self.block_size, "min_8bit_size": self.min_8bit_size}


def adam_update(grad, states, alpha, one_minus_beta_1, one_minus_beta_2, epsilon, block_size, local_step,
                stochastic: bool = True):
    """Adam's step on 8-bit moments: (the step to subtract from the weight, the four new states).

    `states` are the flat (m codes, m scales, sqrt(v) codes, sqrt(v) scales); `grad` is flat, dense, float32;
    `local_step` is Keras's (iterations + 1, as float32). Keras's Adam.update_step on the decoded moments, op for
    op. The new scales are bounds computed before the new moments, from the old scales and the block's largest
    |gradient|:

        |m'| = |beta_1 m + (1 - beta_1) g| <= beta_1 TOP s + (1 - beta_1) max|g| = TOP s'
        sqrt(v') = sqrt(beta_2 v + (1 - beta_2) g^2) <= TOP sqrt(beta_2 s^2 + (1 - beta_2) (max|g| / TOP)^2)

    so the moments are encoded in the pass that computes them (kmp.scaling.quantize says why that matters).

    sqrt(v) is rounded stochastically, m to nearest. Rounded to nearest, a moment whose change in a step is under
    half its code's step comes back to the same code: sqrt(v) moves by about 0.05% a step (beta_2 = 0.999), so it
    stops following Adam's while its block's scale is held up by other elements. Rounded up with the probability
    of the fraction past the code below, each code is sqrt(v) on average. m moves by a tenth of its distance to
    the gradient a step and follows it rounded to nearest, with less noise (benchmarks/eight_bit_fidelity.py
    measured both). The noise is a hash of the element's place in its block, the step and its gradient's top
    bits: the same on every replica and on both of kmp's paths, and a run gives the same codes again.
    `stochastic=False` rounds sqrt(v) to nearest too (for that benchmark and the tests that show the difference).
    """
    n = states[0].shape[0]  # the codes' length, static
    step, *new = _adam_update_function(int(block_size), bool(stochastic))(
        grad, *states, *(tf.cast(x, tf.float32) for x in (alpha, one_minus_beta_1, one_minus_beta_2, epsilon)),
        tf.cast(local_step, tf.int32))
    shapes = (n, -(-n // block_size)) * 2
    return tf.ensure_shape(step, [n]), tuple(tf.ensure_shape(x, [size]) for x, size in zip(new, shapes))


# One tf.function per block size, of any length: in a traced step each variable's update is then one op, traced
# once, not some sixty ops traced again for each variable. Compiled (once per length; inlined inside an XLA
# step), the decode, update and encode are one pass that holds no float32 moment: run by TensorFlow op by
# op, each variable's update held 24 bytes per element of temporaries (benchmarks/memory.py).
@functools.lru_cache(maxsize=None)
def _adam_update_function(block_size: int, stochastic: bool):
    vector, scalar = tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)
    update = functools.partial(_adam_update, block_size=block_size, stochastic=stochastic)
    return tf.function(update, autograph=False, jit_compile=True, input_signature=[
        vector, tf.TensorSpec([None], tf.uint8), vector, tf.TensorSpec([None], tf.uint8), vector, *[scalar] * 4,
        tf.TensorSpec([], tf.int32)])


def _adam_update(grad, m_codes, m_scales, r_codes, r_scales, alpha, one_minus_beta_1, one_minus_beta_2, epsilon,
                 local_step, block_size, stochastic):
    largest = _block_maxima(grad, block_size)
    m = quantize.decode_any(m_codes, m_scales, True, block_size)
    v = tf.square(quantize.decode_any(r_codes, r_scales, False, block_size))
    m = m + (grad - m) * one_minus_beta_1
    v = v + (tf.square(grad) - v) * one_minus_beta_2
    r = tf.sqrt(v)
    step = (m * alpha) / (r + epsilon)
    m_scales = m_scales + (largest * quantize.SIGNED.inverse_top - m_scales) * one_minus_beta_1
    r_squared = tf.square(r_scales)
    r_scales = tf.sqrt(r_squared + (tf.square(largest * quantize.UNSIGNED.inverse_top) - r_squared) * one_minus_beta_2)
    noise = None
    if stochastic:
        # The noise's key: the element's place in its block (each variable and ZeRO shard starts on a block), the
        # step, and the sign, exponent and top 3 significand bits of its gradient, which differ from block to block.
        # Not all the gradient's bits: kmp's two paths reduce the gradient in different orders, an ulp apart.
        top = tf.bitwise.left_shift(tf.bitwise.right_shift(tf.bitcast(grad, tf.int32), 20), 8)
        key = (tf.range(tf.shape(grad)[0]) % block_size ^ top) ^ local_step * np.int32(-1640531527)
        noise = quantize.dither(key, 0x2545F491)
    # The codes take sqrt(|v|), which is r: as another expression, XLA computes it again in the loop that encodes,
    # instead of writing r to memory for that loop and the weight's (benchmarks/RESULTS.md, eight_bit_update).
    return (step, quantize.encode_any(m, m_scales, True, block_size), m_scales,
            quantize.encode_any(tf.sqrt(tf.abs(v)), r_scales, False, block_size, noise), r_scales)


def _block_maxima(grad, block_size):
    """Each block's largest |grad|, as max(max, -min): XLA on CPU reads the gradient for each reduction instead of
    writing |grad| to memory for one. Float reductions, cheaper than block_absmax's integer one; under XLA on CPU
    they drop NaN, so a NaN gradient leaves finite codes (the step is NaN anyway; loss scaling skips such steps).

    A block is first reduced as 16 columns (element i to column i % 16; one column where 16 does not divide the
    block), the max and min in one pass: XLA on CPU vectorizes a reduction across rows, not along one (about 2x
    faster on P1's gradient; benchmarks/RESULTS.md)."""
    lanes = 16 if block_size % 16 == 0 else 1
    columns = tf.reshape(quantize.blocks(grad, block_size), [-1, block_size // lanes, lanes])
    return tf.reduce_max(tf.maximum(tf.reduce_max(columns, axis=1), -tf.reduce_min(columns, axis=1)), axis=1)


def _read(variable):
    # A TensorFlow variable, or the flat buffers' masked one, reads with read_value; a Keras variable converts itself.
    return variable.read_value() if hasattr(variable, "read_value") else variable


@keras.saving.register_keras_serializable(package="kmp")
class Adam8bit(_EightBitStates, keras.optimizers.Adam):
    """keras.optimizers.Adam with 8-bit moments (see kmp.scaling.eight_bit). `block_size`: elements per scale."""


@keras.saving.register_keras_serializable(package="kmp")
class AdamW8bit(_EightBitStates, keras.optimizers.AdamW):
    """keras.optimizers.AdamW with 8-bit moments (see kmp.scaling.eight_bit). `block_size`: elements per scale."""


_EIGHT_BIT = {keras.optimizers.Adam: Adam8bit, keras.optimizers.AdamW: AdamW8bit}


def with_states(optimizer, states: str):
    """`optimizer` with `states` ("32bit": itself; "8bit": an Adam8bit/AdamW8bit copy of its settings)."""
    problems = []
    if states not in STATES:
        problems.append(Problem("states", f"one of {', '.join(map(repr, STATES))}", states))
    elif states == "8bit" and type(optimizer) not in _EIGHT_BIT and not isinstance(optimizer, _EightBitStates):
        problems.append(Problem("states", "'32bit' for this optimizer (8-bit states are for Keras's Adam and AdamW)",
                                f"'8bit' with {type(optimizer).__name__}", "Use Adam or AdamW, or states='32bit'."))
    elif states == "8bit" and optimizer.built and not isinstance(optimizer, _EightBitStates):
        problems.append(Problem("optimizer", "an optimizer not built yet (its float32 moments would be lost)",
                                f"a built {type(optimizer).__name__}", "Pass a new optimizer."))
    elif states == "8bit" and getattr(optimizer, "amsgrad", False):
        problems.append(Problem("states", "'32bit' with amsgrad=True", "'8bit'", "Drop amsgrad, or keep 32-bit states."))
    check(problems, "kmp.wrap arguments")
    if states == "32bit" or isinstance(optimizer, _EightBitStates):
        return optimizer
    return _EIGHT_BIT[type(optimizer)].from_config(optimizer.get_config())


def states_of(optimizer) -> str:
    return "8bit" if isinstance(optimizer, _EightBitStates) else "32bit"


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable
