"""The 8-bit Adam update against the 32-bit one, inside one XLA function, on one device.

P1's 2.6M parameters as one flat buffer each (weights, gradients, moments),
each row one `tf.function(jit_compile=True)`:

- 32-bit Adam (kmp.engine.fused's rule on float32 moments);
- 8-bit Adam (kmp.scaling.eight_bit.adam_update, what kmp.engine.rules.EightBitAdam
  runs: decode both moments, Keras's rule, new scales from the gradient's
  block maxima, encode both again);
- encode of both moments alone, with given scales;
- decode of both moments alone;
- the same with the gradient's block maxima reduced row by row (a block a row of 256; the update
  reduces 16 columns first, see kmp.scaling.eight_bit._block_maxima);
- the gradient's block maxima alone (the one reduction of the 8-bit update), both ways;
- a copy of one buffer times 2 (the memory-bandwidth floor of one pass).

What the 8-bit states cost per step beyond 32-bit Adam is the difference of
the first two rows; the flat engine runs the same computation in its step.

    python benchmarks/eight_bit_update.py [--rounds 15] [--calls 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import interleaved, report

import tensorflow as tf  # noqa: E402  (common sets the log level first)

from kmp.engine import fused  # noqa: E402
from kmp.scaling import eight_bit  # noqa: E402
from kmp.scaling.eight_bit import adam_update  # noqa: E402
from kmp.scaling import quantize  # noqa: E402

N = 2_631_936  # P1's 2,631,937 parameters, in whole blocks of 256 and units of 16
HYPER = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "block_size": quantize.BLOCK_SIZE}


class _Slot:
    """A buffer as the rules see it: read_value and assign (here a tensor kept in a Python cell)."""

    def __init__(self, value):
        self.value = value

    def read_value(self):
        return self.value

    def assign(self, value):
        self.value = value


def _scalars():
    return fused._Adam.scalars(HYPER, tf.constant(1e-3), tf.constant(10.0), tf.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5, help="calls per timing (ms per call reported)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w, g = (tf.constant(rng.standard_normal(N).astype(np.float32) * s) for s in (1.0, 1e-3))
    m = tf.constant(rng.standard_normal(N).astype(np.float32) * np.float32(1e-3))
    v = tf.constant(np.square(rng.standard_normal(N).astype(np.float32) * np.float32(1e-3)))
    (mq, ms), (rq, rs) = quantize.quantize(m, True), quantize.quantize(tf.sqrt(v), False)

    def adam32(w, g, m, v):
        slots = (_Slot(m), _Slot(v))
        new_w = fused._Adam.update(_scalars(), HYPER, w, g, slots)
        return new_w, slots[0].value, slots[1].value

    def adam8(w, g, mq, ms, rq, rs):
        s = _scalars()
        step, states = adam_update(g, (mq, ms, rq, rs), s["alpha"], s["one_minus_beta_1"], s["one_minus_beta_2"],
                                   s["epsilon"], quantize.BLOCK_SIZE, tf.constant(10.0))
        return (w - step, *states)

    def rows(grad, block_size=quantize.BLOCK_SIZE):
        blocks = quantize.blocks(grad, block_size)
        return tf.maximum(tf.reduce_max(blocks, axis=1), -tf.reduce_min(blocks, axis=1))

    def adam8_rows(w, g, mq, ms, rq, rs):
        # The update's own Python function, traced here with the row-by-row maxima (adam_update's
        # cached tf.function keeps the first trace it got).
        s = _scalars()
        columns, eight_bit._block_maxima = eight_bit._block_maxima, rows
        try:
            step, *states = eight_bit._adam_update(
                g, mq, ms, rq, rs, s["alpha"], s["one_minus_beta_1"], s["one_minus_beta_2"], s["epsilon"],
                tf.constant(10, tf.int32), quantize.BLOCK_SIZE, True)
        finally:
            eight_bit._block_maxima = columns
        return (w - step, *states)

    functions = {
        "32-bit Adam": (adam32, (w, g, m, v)),
        "8-bit Adam": (adam8, (w, g, mq, ms, rq, rs)),
        "8-bit Adam, block maxima row by row": (adam8_rows, (w, g, mq, ms, rq, rs)),
        "encode both moments": (lambda m, v, ms, rs: (quantize.encode(m, ms, True), quantize.encode(v, rs, False)),
                                (m, tf.sqrt(v), ms, rs)),
        "decode both moments": (lambda mq, ms, rq, rs: (quantize.decode(mq, ms, True),
                                                        quantize.decode(rq, rs, False)), (mq, ms, rq, rs)),
        "the gradient's block maxima": (lambda g: eight_bit._block_maxima(g, quantize.BLOCK_SIZE), (g,)),
        "the same, row by row": (rows, (g,)),
        "copy of one buffer (x * 2)": (lambda w: w * 2.0, (w,)),
    }

    def timer(function, inputs):
        compiled = tf.function(function, jit_compile=True)

        def measure():
            start = time.perf_counter()
            for _ in range(args.calls):
                out = compiled(*inputs)
            tf.nest.map_structure(lambda t: t.numpy(), out)
            return (time.perf_counter() - start) * 1000 / args.calls

        return measure

    times = interleaved({name: timer(*spec) for name, spec in functions.items()}, args.rounds, warmup=2)
    report(f"P1's {N:,} parameters, one device, one XLA function each", times, "32-bit Adam")


if __name__ == "__main__":
    main()
