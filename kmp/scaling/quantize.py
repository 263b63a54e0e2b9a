"""Block-wise 8-bit floating-point codes for flat float32 optimizer moments.

Why: Adam keeps two float32 moments per weight, 8 bytes a weight. Stored as one byte per element plus one float32
scale per block of 256, they take 1 + 4/256 bytes per element per moment instead of 4 (about 3.9x less).

Each byte is a small float, x / scale of its block rounded to nearest (ties to even), with no infinities or NaN:

- signed (Adam's first moment): 1 sign, 4 exponent and 3 significand bits (FP8 E4M3's fields, another bias, no
  NaN). Magnitudes 2**-15 * 1.125 .. 1.875 (TOP), each within 1/16 of its value;
- unsigned (the square root of Adam's second moment): 4 exponent and 4 significand bits. Magnitudes
  2**-15 * 1.0625 .. 1.9375, each within 1/32 of its value.

Code 0 is 0.0 in both; there are no subnormals (and a subnormal float32 counts as 0). A value that rounds to
2**-15 or less becomes 0 when signed, the smallest code when unsigned and positive (Adam divides by it: rounded
up, a step only gets smaller). Above TOP, the top code.

Why small floats and not a code book (bitsandbytes' dynamic map): a float's code is its own float32 bits, rounded
and shifted, and its value those bits shifted back. Both are a few integer operations an element, which XLA on CPU
vectorizes into the update's loop; a code book takes a search to encode and a gather to decode, passes XLA on CPU
runs several times slower (benchmarks/RESULTS.md). And a float keeps the same relative precision across its 15
binades, so a block's scale only has to bound the block, not equal its largest magnitude: kmp's 8-bit Adam
(kmp.scaling.eight_bit) computes the new scale from the old one and the gradient, before the new moments exist,
and encodes them in the same pass that computes them (no second pass for a block maximum).

The scale of a block can be 0 (an all-zero block: it decodes to zeros, whatever its codes). A block with an inf or
NaN scale decodes to inf or NaN throughout. block_absmax sees inf and NaN, which XLA's float reduce_max on CPU drops.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

BLOCK_SIZE = 256
_TINY, _TINY_BITS, _INF_BITS = 2.0 ** -126, 0x00800000, 0x7F800000  # 2**-126, its bit pattern, and inf's


class Format:
    """A byte layout: `signed` takes the top bit for the sign, the exponent the next bits, the significand the rest."""

    def __init__(self, signed: bool, significand_bits: int):
        self.signed, self.significand_bits = signed, significand_bits
        self.shift = 23 - significand_bits  # float32 bits -> code bits
        self.largest_code = 0x7F if signed else 0xFF
        top_exponent = self.largest_code >> significand_bits
        # The top exponent is float32's 0: the codes cover 2**-top_exponent .. TOP.
        self.base = (127 - top_exponent) << significand_bits
        self.top = float(2.0 - 2.0 ** -significand_bits)
        # Scales are multiplied by it, never divided by top: XLA would make a division a multiplication anyway.
        self.inverse_top = float(np.float32(1.0 / self.top))

    def values(self) -> np.ndarray:
        """The float32 value of each of the 256 codes, in code order (tests and docs)."""
        return decode_codes(tf.range(256, dtype=tf.int32), self).numpy()


SIGNED, UNSIGNED = Format(True, 3), Format(False, 4)
FORMATS = {True: SIGNED, False: UNSIGNED}


def encode_codes(x: tf.Tensor, form: Format, noise: tf.Tensor | None = None) -> tf.Tensor:
    """float32 x (already divided by its scale) -> int32 codes 0..255: the nearest code value, ties to even; with
    `noise` (int32, as x, uniform bits: `dither`), rounded stochastically instead, up with the probability of the
    fraction of a step x is past the code below, so a code's expected value is x."""
    bits = tf.bitcast(x, tf.int32)
    magnitude = tf.minimum(bits & 0x7FFFFFFF, _INF_BITS)  # NaN as inf: no int32 overflow below
    shift = form.shift
    if noise is None:
        offset = ((1 << (shift - 1)) - 1) + (tf.bitwise.right_shift(magnitude, shift) & 1)
    else:
        offset = noise & ((1 << shift) - 1)
    code = tf.clip_by_value(tf.bitwise.right_shift(magnitude + offset, shift) - form.base, 0, form.largest_code)
    if form.signed:
        return tf.where(code > 0, code | (tf.bitwise.right_shift(bits, 24) & 0x80), 0)
    return tf.where(x > 0.0, tf.maximum(code, 1), 0)


def dither(key: tf.Tensor, salt: int) -> tf.Tensor:
    """Uniform int32 bits from int32 `key` (any shape), a different stream per `salt`: a multiply-xorshift hash
    (MurmurHash3's 32-bit finalizer), the same on every device and path, nothing drawn or stored."""
    h = key ^ np.int32(salt)
    for multiplier, shift in ((np.int32(-2048144789), 16), (np.int32(-1028477387), 13), (None, 16)):
        h = h ^ (tf.bitwise.right_shift(h, shift) & ((1 << (32 - shift)) - 1))  # a logical shift
        if multiplier is not None:
            h = h * multiplier
    return h


def decode_codes(codes: tf.Tensor, form: Format) -> tf.Tensor:
    """int32 codes 0..255 -> their float32 values (before the scale)."""
    magnitude = codes & form.largest_code
    bits = tf.bitwise.left_shift(magnitude + form.base, form.shift)
    if form.signed:
        bits = bits | tf.bitwise.left_shift(codes & 0x80, 24)
    return tf.where(magnitude == 0, 0.0, tf.bitcast(bits, tf.float32))


def block_absmax(x: tf.Tensor, block_size: int = BLOCK_SIZE) -> tf.Tensor:
    """The largest |x| of each block of x [n] (zero padded): [ceil(n / block_size)], inf and NaN kept."""
    xb = blocks(x, block_size)
    # The largest bit pattern without the sign: an integer reduction that also sees inf and NaN.
    if block_size % 32 == 0:  # by 32, then by block: so XLA on CPU fuses it (whole blocks it reduces in two passes)
        by_32 = tf.reduce_max(tf.bitcast(tf.reshape(xb, [-1, 32]), tf.int32) & 0x7FFFFFFF, axis=1)
        top = tf.reduce_max(tf.reshape(by_32, [-1, block_size // 32]), axis=1)
    else:
        top = tf.reduce_max(tf.bitcast(xb, tf.int32) & 0x7FFFFFFF, axis=1)
    absmax = tf.where(top >= _TINY_BITS, tf.bitcast(top, tf.float32), 0.0)  # subnormals: CPUs flush them
    return tf.where(top <= _INF_BITS, absmax, np.nan)


def encode(x, scales, signed: bool, block_size: int = BLOCK_SIZE) -> tf.Tensor:
    """x float32 [n], scales [ceil(n / block_size)] -> uint8 codes [n] of x / the scale of its block.

    Values over TOP times their scale take the top code: the caller's scales bound the values. A zero (or subnormal)
    scale gives code 0; a non-finite one leaves its block non-finite when decoded.
    """
    x = tf.convert_to_tensor(x, tf.float32)
    n = _static_length(x, block_size)
    return tf.ensure_shape(encode_any(x, tf.convert_to_tensor(scales, tf.float32), signed, block_size), [n])


def decode(codes, scales, signed: bool, block_size: int = BLOCK_SIZE) -> tf.Tensor:
    """uint8 codes [n], scales [ceil(n / block_size)] -> float32 [n]: each code's value times its block's scale."""
    codes = tf.convert_to_tensor(codes, tf.uint8)
    n = _static_length(codes, block_size)
    return tf.ensure_shape(decode_any(codes, tf.convert_to_tensor(scales, tf.float32), signed, block_size), [n])


def encode_any(x, scales, signed, block_size, noise=None):
    """encode for x of any length (its length known when the program runs; nothing checked); `noise` as
    encode_codes', per element of x."""
    inverse = tf.where((scales >= _TINY) & (scales < np.inf), 1.0 / scales, 0.0)
    noise = None if noise is None else blocks(noise, block_size)
    codes = encode_codes(blocks(x, block_size) * inverse[:, None], FORMATS[bool(signed)], noise)
    return tf.cast(tf.reshape(codes, [-1])[:tf.shape(x)[0]], tf.uint8)


def decode_any(codes, scales, signed, block_size):
    """decode for codes of any length (nothing checked)."""
    values = decode_codes(tf.cast(blocks(codes, block_size), tf.int32), FORMATS[bool(signed)])
    # A non-finite scale times a zero code is NaN too: the whole block.
    return tf.reshape(values * scales[:, None], [-1])[:tf.shape(codes)[0]]


def quantize(x, signed: bool, block_size: int = BLOCK_SIZE) -> tuple[tf.Tensor, tf.Tensor]:
    """x float32 [n] -> (codes uint8 [n], scales [ceil(n / block_size)]), each scale its block's absmax / TOP."""
    x = tf.convert_to_tensor(x, tf.float32)
    n = _static_length(x, block_size)
    scales = tf.ensure_shape(block_absmax(x, block_size) * FORMATS[bool(signed)].inverse_top, [-(-n // block_size)])
    return encode(x, scales, signed, block_size), scales


def _static_length(x: tf.Tensor, block_size: int) -> int:
    """x's static length, checked: a 1-D tensor of at least one element, and a whole block size."""
    n = x.shape[0] if x.shape.rank == 1 else None
    if n is None or n < 1 or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"Need a 1-D tensor of static length >= 1 and block_size >= 1, got {x.shape}, {block_size}.")
    return n


def blocks(x: tf.Tensor, block_size: int) -> tf.Tensor:
    """x zero padded to whole blocks: [ceil(n / block_size), block_size]."""
    n = tf.shape(x)[0]
    return tf.reshape(tf.pad(x, [[0, -n % block_size]]), [-1, block_size])
