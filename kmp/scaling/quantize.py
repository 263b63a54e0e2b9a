"""Block-wise 8-bit quantization of flat float32 optimizer moments, as bitsandbytes stores 8-bit Adam states.

Why: Adam keeps two float32 moments per weight, 8 bytes a weight. Stored as one uint8 code index per element plus
one float32 scale per block of 256, they take 1 + 4/256 bytes per element per moment instead of 4 (about 3.9x less).
Each block is scaled by its own largest magnitude (absmax), so one outlier costs precision in its block only.

The code book is bitsandbytes' dynamic ("tree") map: a decimal exponent picks one of seven decades (1e-7..1) and the
remaining bits a linear fraction inside it, so small moments keep their relative precision. 8-bit Adam quantizes
the first moment with the signed map and the second (never negative) with the unsigned one, block size 256.

Read from bitsandbytes-foundation/bitsandbytes at commit 95f9af309d4d5793847169c39288dcd3fcbdf564:
- bitsandbytes/functional.py: create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8),
  quantize_blockwise / dequantize_blockwise (which call the kernels below);
- bitsandbytes/backends/default/ops.py: the reference kernels, scaled = clamp(x / absmax, -1, 1), then
  bucketize(scaled, (code[:-1] + code[1:]) / 2) (ties to the lower code), and code[q] * absmax to decode;
- bitsandbytes/optim/optimizer.py: Optimizer2State gives state1 the "dynamic" map (signed=True), state2 the
  "udynamic" map (signed=False), blocksize 256, ceil(n / 256) absmax values per state;
- csrc/kernels.cu: the fused 8-bit blockwise optimizer kernel re-quantizes the states after each update.

Where this differs from bitsandbytes, on purpose:
- q is the index of the exactly nearest code value to the float32 quotient x / absmax (ties to the lower index):
  the midpoints are the exact ones rounded down to float32, which makes the float32 comparison exact.
  bitsandbytes rounds its float32 midpoints to nearest, so a quotient within one ulp of a midpoint can differ.
- tf.searchsorted is not used: under XLA, TensorFlow lowers it to an n x 255 comparison matrix (1 KB per element,
  seen in the optimized HLO). The lower bound is read from the float's bits instead (_search_tables): its sign and
  exponent, then leading significand bits, pick a bucket with at most one midpoint, and one comparison with that
  midpoint decides. Four lookups in tables of at most 512 entries, which XLA fuses with the divide into one loop;
  an 8-step binary search took 8 dependent gathers an element. Codes the tables cannot serve use that search.
- A block whose absmax is 0 or subnormal (below 2**-126) stores absmax 0 and decodes to exact zeros, never NaN
  (bitsandbytes' reference kernel divides by max(absmax, 1e-38)). TensorFlow on CPU flushes subnormals anyway;
  deciding it here gives the same result where they are not flushed.
- That CUDA kernel also moves a state1 code whose sign differs from the value's (a small negative rounded to the
  code 0) one step outwards. quantize does not: it is a plain nearest-value map.
- The map's values come from the source's float32 operations as written (torch.linspace's CPU kernel, the mean, the
  decade scale). A torch build that fuses linspace's multiply-add (FMA) gets about 40 values one ulp apart.

Non-finite input: a block holding inf or NaN gets absmax NaN and decodes to NaN throughout (its q bytes are
meaningless); other blocks are unaffected. The optimizer skips overflowing steps, so it never stores such a block.
Values outside the map's range (negatives with the unsigned map) take the nearest end code.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

BLOCK_SIZE = 256
_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
_TINY_BITS, _INF_BITS = 0x00800000, 0x7F800000  # the bit patterns of 2**-126 and of inf


def _linspace32(start: float, end: float, steps: int) -> np.ndarray:
    # torch.linspace's CPU kernel in float32 arithmetic: the first half counts up from start, the rest down from end.
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float32((end32 - start32) / np.float32(steps - 1))
    return np.array([start32 + step * np.float32(i) if i < steps // 2 else end32 - step * np.float32(steps - 1 - i)
                     for i in range(steps)], np.float32)


@functools.lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> np.ndarray:
    values = [np.float32(0.0), np.float32(1.0)]
    for i in range(7):  # max_exponent_bits = 7 decades, 10**-6 .. 10**0 times fractions in [0.1, 1]
        # With the sign bit taken, the signed map has half as many fractions per decade.
        bounds = _linspace32(0.1, 1.0, 2 ** i + 1 if signed else 2 ** (i + 1) + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (i - 6))
        values += list(scale * means) + (list(-scale * means) if signed else [])
    assert len(values) == 256  # total_bits = 8 leaves no extra items (additional_items == 0)
    return np.sort(np.array(values, np.float32))


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 float32 values of bitsandbytes' create_dynamic_map(signed=signed), sorted ascending."""
    return _dynamic_map(bool(signed)).copy()


def zero_code(signed: bool) -> int:
    """The index of 0.0 in dynamic_map(signed): what a zero quantizes to, in any block."""
    return int(np.flatnonzero(_dynamic_map(bool(signed)) == 0.0)[0])


def _lower_midpoints(code) -> np.ndarray:
    """The 255 midpoints of neighbouring code values, each rounded down to float32, then +inf: 256 entries.

    For a float32 v, v <= m exactly iff v <= (m rounded down), so comparing float32 values to these is exact.
    """
    code = tf.get_static_value(code) if tf.is_tensor(code) else code
    code = np.asarray(code, np.float32) if code is not None else None
    if code is None or code.shape != (256,) or not np.all(np.isfinite(code)) or not np.all(np.diff(code) > 0):
        raise ValueError("code must be 256 finite float32 values, strictly increasing, known when tracing.")
    low, high = np.abs(code[:-1]), np.abs(code[1:])
    if not np.all((np.minimum(low, high) == 0) | (np.maximum(low, high) < 2.0 ** 27 * np.minimum(low, high))):
        raise ValueError("code has neighbours over 2**27 apart: their float64 midpoint would not be exact.")
    exact = (code[:-1].astype(np.float64) + code[1:]) / 2.0  # exact: 24-bit significands within 2**27 of each other
    mid = exact.astype(np.float32)
    mid = np.where(mid > exact, np.nextafter(mid, np.float32(-np.inf)), mid)
    return np.append(mid, np.float32(np.inf))


def _static_length(x: tf.Tensor, block_size: int) -> int:
    """x's static length, checked: a 1-D tensor of at least one element, and a whole block size."""
    n = x.shape[0] if x.shape.rank == 1 else None
    if n is None or n < 1 or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"Need a 1-D tensor of static length >= 1 and block_size >= 1, got {x.shape}, {block_size}.")
    return n


def _blocks(x: tf.Tensor, block_size: int) -> tf.Tensor:
    """x (its length known when the program runs) zero padded to whole blocks: [ceil(n / block_size), block_size]."""
    n = tf.shape(x)[0]
    return tf.reshape(tf.pad(x, [[0, -n % block_size]]), [-1, block_size])


def _search_tables(mid: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """Tables that give #{mid < v} for a float32 v from its bits, or None if `mid` does not allow them.

    A float's top 9 bits (sign, exponent) pick its binade, which is cut into 2**k equal buckets of its significand,
    k the fewest that leave at most one midpoint in each: bucket = base[binade] + (significand >> shift[binade]).
    With low[bucket] = #{mid < the bucket's lowest value}, #{mid < v} = low + (v > mid[low]) for every v in the
    bucket (the next midpoint is past it). Returns (base, shift, low, mid[low]); a dynamic map needs a few
    hundred buckets, every entry computed from `mid`, none assumed.
    """
    finite = mid[np.isfinite(mid)]
    if not np.all((finite == 0) | (np.abs(finite) >= _TINY)):
        return None  # a subnormal midpoint: CPUs that flush subnormals to zero would compare differently
    base, shift, low, shared = np.zeros(512, np.int32), np.zeros(512, np.int32), [], {}
    for top in range(512):
        if top & 0xFF == 0xFF:  # inf and NaN: 0, as NaN compares (_count_below sets +inf apart)
            k, q = 0, np.zeros(1, np.int64)
        else:
            for k in range(10):
                first = (top << 23) | (np.arange(2 ** k, dtype=np.int64) << (23 - k))
                ends = np.stack([first, first | ((1 << (23 - k)) - 1)], axis=1)
                ends = ends[:, ::-1] if top >> 8 else ends  # negative floats: the larger bits, the lower value
                counts = np.searchsorted(mid, ends.astype(np.uint32).view(np.float32), side="left")
                q = counts[:, 0]
                if np.all(counts[:, 1] - q <= 1):
                    break
            else:
                return None
        shift[top] = 23 - k
        if k == 0 and int(q[0]) in shared:  # one-bucket binades repeat a few entries
            base[top] = shared[int(q[0])]
            continue
        if k == 0:
            shared[int(q[0])] = len(low)
        base[top] = len(low)
        low += list(q)
    low = np.array(low, np.int32)
    return base, shift, low, mid[low]


@functools.lru_cache(maxsize=4)
def _cached_search_tables(mid_bytes: bytes):
    return _search_tables(np.frombuffer(mid_bytes, np.float32))


def _count_below(mid: np.ndarray, v: tf.Tensor) -> tf.Tensor:
    """#{mid < v} elementwise (int32), the lower bound of v in the 256 sorted midpoints (the last one +inf)."""
    tables = _cached_search_tables(mid.tobytes())
    if tables is None:
        # A branchless binary search, 8 gathers an element.
        q = tf.zeros(tf.shape(v), tf.int32)
        for step in (128, 64, 32, 16, 8, 4, 2, 1):
            q = tf.where(tf.gather(mid, q + (step - 1)) < v, q + step, q)
        return q
    base, shift, low, threshold = (tf.constant(t) for t in tables)
    bits = tf.bitcast(v, tf.int32)
    binade = tf.bitwise.right_shift(bits, 23) & 0x1FF
    bucket = tf.gather(base, binade) + tf.bitwise.right_shift(bits & 0x7FFFFF, tf.gather(shift, binade))
    # Four tables, each value used once: XLA then fuses all of it, and the divide, into one loop.
    q = tf.gather(low, bucket) + tf.cast(v > tf.gather(threshold, bucket), tf.int32)
    return tf.where(v == np.inf, len(mid) - 1, q)  # a block with inf or NaN is divided by 1, its inf kept


def quantize(x, code, block_size: int = BLOCK_SIZE) -> tuple[tf.Tensor, tf.Tensor]:
    """x float32 [n] -> (q uint8 [n], absmax float32 [ceil(n / block_size)]): q indexes code nearest x / absmax."""
    x = tf.convert_to_tensor(x, tf.float32)
    n = _static_length(x, block_size)
    q, absmax = _quantize_function(_lower_midpoints(code).tobytes(), int(block_size))(x)
    return tf.ensure_shape(q, [n]), tf.ensure_shape(absmax, [math.ceil(n / block_size)])


def dequantize(q, absmax, code, block_size: int = BLOCK_SIZE) -> tf.Tensor:
    """q uint8 [n], absmax float32 [ceil(n / block_size)] -> x float32 [n]: code[q] * absmax of q's block."""
    q = tf.convert_to_tensor(q, tf.uint8)
    n = _static_length(q, block_size)
    code = tf.get_static_value(code) if tf.is_tensor(code) else code
    if code is None:
        raise ValueError("code must be known when tracing.")
    values = _dequantize_function(np.asarray(code, np.float32).tobytes(), int(block_size))(
        q, tf.convert_to_tensor(absmax, tf.float32))
    return tf.ensure_shape(values, [n])


# One tf.function per code (its bytes) and block size, of any length. In a traced step each call is then one op,
# traced once, not some fifty ops traced again each time (a per-variable update makes four calls per variable);
# XLA and TensorFlow's graph optimizer inline it, so it runs the same.
@functools.lru_cache(maxsize=None)
def _quantize_function(mid: bytes, block_size: int):
    mid = np.frombuffer(mid, np.float32)
    return tf.function(lambda x: _quantize(x, mid, block_size), autograph=False,
                       input_signature=[tf.TensorSpec([None], tf.float32)])


@functools.lru_cache(maxsize=None)
def _dequantize_function(code: bytes, block_size: int):
    code = np.frombuffer(code, np.float32)
    return tf.function(lambda q, absmax: _dequantize(q, absmax, code, block_size), autograph=False,
                       input_signature=[tf.TensorSpec([None], tf.uint8), tf.TensorSpec([None], tf.float32)])


def _quantize(x, mid, block_size):
    v, absmax = scaled_blocks(x, block_size)
    return tf.cast(tf.reshape(_count_below(mid, v), [-1])[:tf.shape(x)[0]], tf.uint8), absmax


def scaled_blocks(x, block_size: int = BLOCK_SIZE) -> tuple[tf.Tensor, tf.Tensor]:
    """quantize's first half: x / absmax by blocks [ceil(n / block_size), block_size], and each block's absmax."""
    xb = _blocks(x, block_size)
    # The largest |x| of a block as the largest of its bit patterns without the sign: one integer reduction that
    # also sees inf and NaN (patterns from 0x7F800000 up), which XLA's float reduce_max on CPU drops.
    if block_size % 32 == 0:  # by 32, then by block: so XLA on CPU fuses it (whole blocks it reduces in two passes)
        by_32 = tf.reduce_max(tf.bitcast(tf.reshape(xb, [-1, 32]), tf.int32) & 0x7FFFFFFF, axis=1)
        top = tf.reduce_max(tf.reshape(by_32, [-1, block_size // 32]), axis=1)
    else:
        top = tf.reduce_max(tf.bitcast(xb, tf.int32) & 0x7FFFFFFF, axis=1)
    absmax = tf.where(top >= _TINY_BITS, tf.bitcast(top, tf.float32), 0.0)  # 0 or subnormal: a zero block
    absmax = tf.where(top < _INF_BITS, absmax, np.nan)
    return xb / tf.where(absmax > 0.0, absmax, 1.0)[:, None], absmax  # a zero block stays 0, not 0 / 0


def _dequantize(q, absmax, code, block_size):
    values = tf.gather(tf.constant(code), tf.cast(_blocks(q, block_size), tf.int32))
    return tf.reshape(values * absmax[:, None], [-1])[:tf.shape(q)[0]]
