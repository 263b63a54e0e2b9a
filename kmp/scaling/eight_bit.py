"""8-bit Adam and AdamW: the two moments stored block-wise quantized, as bitsandbytes' Adam8bit keeps them.

    kmp.wrap(keras.optimizers.AdamW(1e-3), states="8bit")     # the same settings, 8-bit moments
    kmp.AdamW8bit(1e-3, weight_decay=0.01)                    # or the class itself (kmp.Adam8bit too)

Why: Adam's two float32 moments are 8 bytes per parameter on every replica,
twice the float32 weights. Stored as one byte per element (an index into
bitsandbytes' dynamic map, kmp.scaling.quantize) plus one float32 scale per block
of `block_size` elements of each variable, they take 2 + 8/256 bytes.

The update is Keras's Adam.update_step on the dequantized moments, op for
op (AdamW's decay is Keras's, before it); the new moments are quantized
again after the weight has been moved with their exact values, as
bitsandbytes' kernels do:

    m = dequantize(m8, m_scale, signed map);  v = dequantize(v8, v_scale, unsigned map)
    m += (g - m) * (1 - beta_1);              v += (g^2 - v) * (1 - beta_2)
    w -= lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)
    m8, m_scale = quantize(m);                v8, v_scale = quantize(v)

What differs from bitsandbytes: every variable is quantized (bitsandbytes
keeps 32-bit states for tensors under 4096 elements, `min_8bit_size`), and
the blocks are per variable. On kmp.prepare's flat buffers the same update
runs on whole buffers of codes and scales (kmp.engine.rules.EightBitAdam;
kmp.engine.buffers starts each variable on a block, so the blocks are these), and
ZeRO stage 1 shards them by whole blocks. kmp's per-variable fused update
(kmp.engine.fused) is for float32 states: without the flat buffers this class's
update_step runs. `amsgrad` is not offered.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from kmp.distribute.same_start import same_start
from kmp.errors import Problem, check
from kmp.scaling import quantize

STATES = ("32bit", "8bit")


class _EightBitStates:
    """Adam's build and update_step with 8-bit moments (mixed into Keras's Adam and AdamW)."""

    def __init__(self, *args, block_size=quantize.BLOCK_SIZE, **kwargs):
        problems = []
        if kwargs.get("amsgrad"):
            problems.append(Problem("amsgrad", "False (8-bit states keep no float32 velocity maximum)", True,
                                    "Use the 32-bit optimizer for amsgrad."))
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            problems.append(Problem("block_size", "an integer >= 1 (bitsandbytes uses 256)", block_size))
        check(problems, f"kmp.{type(self).__name__} arguments")
        super().__init__(*args, **kwargs)
        self.block_size = block_size

    def build(self, var_list):
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)  # iterations, indices; not Adam's float32 slots
        self._moment_codes, self._moment_scales, self._velocity_codes, self._velocity_scales = [], [], [], []
        strategy = self._distribution_strategy
        for variable in var_list:
            size = math.prod(variable.shape)
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
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.reshape(ops.cast(tf.convert_to_tensor(gradient), dtype), [-1])
        local_step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        m, v = (moment.read_value() for moment in self._moments(index))
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = m + (gradient - m) * (1 - self.beta_1)
        v = v + (ops.square(gradient) - v) * (1 - self.beta_2)
        self.assign_sub(variable, ops.reshape(ops.divide(ops.multiply(m, alpha), ops.add(ops.sqrt(v), self.epsilon)),
                                              variable.shape))
        for moment, value in zip(self._moments(index), (m, v)):
            q, scale = quantize.quantize(value, moment.code, self.block_size)
            self.assign(moment.codes, q)
            self.assign(moment.scales, scale)

    def moments(self, variable) -> tuple[tf.Tensor, tf.Tensor]:
        """(m, v) of `variable` as float32, dequantized (for inspection and tests)."""
        m, v = (moment.read_value() for moment in self._moments(self._get_variable_index(variable)))
        return ops.reshape(m, variable.shape), ops.reshape(v, variable.shape)

    def _moments(self, index) -> tuple[Moment, Moment]:
        """Variable `index`'s first (signed map) and second (unsigned map) moments."""
        return (Moment(self._moment_codes[index], self._moment_scales[index], True, self.block_size),
                Moment(self._velocity_codes[index], self._velocity_scales[index], False, self.block_size))

    def get_config(self):
        return {**super().get_config(), "block_size": self.block_size}


class Moment:
    """One 8-bit moment, its codes and scales (variables, or the flat buffers), read and assigned as float32."""

    def __init__(self, codes, scales, signed: bool, block_size: int):
        self.codes, self.scales, self.block_size = codes, scales, block_size
        self.code = quantize.dynamic_map(signed)

    def read_value(self):
        return quantize.dequantize(_read(self.codes), _read(self.scales), self.code, self.block_size)

    def assign(self, value):
        codes, scales = quantize.quantize(value, self.code, self.block_size)
        self.codes.assign(codes)
        self.scales.assign(scales)


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
