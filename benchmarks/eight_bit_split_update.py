"""The flat 8-bit update with a float32 run: one weights buffer, joined, against buffers of its own.

P1's sizes: 2,632,192 flat elements, of which the first 10,752 (its 40
biases and output layer, padded) keep float32 Adam states under
`min_8bit_size`. Four XLA updates of the same elements, alone, in
alternation (median ms):

- every element 8-bit, one buffer (what `min_8bit_size=0` steps);
- codes over every element and the 8-bit rule on the whole weights buffer,
  whose float32 run is scratch; that run's weights in a buffer of their
  own, stepped by Adam (what kmp.engine.buffers ships where it steps in place);
- one buffer, the float32 run stepped by Adam and the rest by the 8-bit
  update, the new weights joined (XLA on CPU writes the join apart and
  copies it into the variable);
- the float32 run's weights, gradient and states in tensors of their own,
  each updated in place.

    python benchmarks/eight_bit_split_update.py [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    from kmp.engine import fused
    from kmp.scaling.eight_bit import adam_update

    n, kept = 2632192, 10752
    rest = n - kept
    h = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}
    s = {**fused._Adam.scalars(h, tf.constant(1e-4), tf.constant(3.0), tf.float32), "lr": tf.constant(1e-4)}
    grad = tf.constant(np.random.default_rng(0).normal(size=n).astype("float32") * 1e-3)
    grad_kept, grad_rest = tf.constant(grad[:kept]), tf.constant(grad[kept:])

    def zeros(size, dtype=tf.float32):
        return tf.Variable(tf.zeros([size], dtype))

    def codes(size):
        return [zeros(size, tf.uint8), zeros(size // 256), zeros(size, tf.uint8), zeros(size // 256)]

    def eight_bit(value, g, states):
        step, new = adam_update(g, [x.read_value() for x in states], s["alpha"], s["one_minus_beta_1"],
                                s["one_minus_beta_2"], s["epsilon"], 256, tf.constant(3.0))
        for state, value_ in zip(states, new):
            state.assign(value_)
        return value - step

    every, every_codes = zeros(n), codes(n)
    joined, joined_codes, joined_m, joined_v = zeros(n), codes(rest), zeros(kept), zeros(kept)
    apart, apart_kept, apart_codes, apart_m, apart_v = zeros(rest), zeros(kept), codes(rest), zeros(kept), zeros(kept)

    @tf.function(jit_compile=True)
    def every_8bit(g):
        every.assign(eight_bit(every.read_value(), g, every_codes))

    @tf.function(jit_compile=True)
    def one_buffer_joined(g):
        value = joined.read_value()
        adam = fused._Adam.update(s, h, value[:kept], g[:kept], [joined_m, joined_v])
        joined.assign(tf.concat([adam, eight_bit(value[kept:], g[kept:], joined_codes)], axis=0))

    @tf.function(jit_compile=True)
    def buffers_apart(g_kept, g_rest):
        apart_kept.assign(fused._Adam.update(s, h, apart_kept.read_value(), g_kept, [apart_m, apart_v]))
        apart.assign(eight_bit(apart.read_value(), g_rest, apart_codes))

    scratch, scratch_codes = zeros(n), codes(n)
    scratch_kept, scratch_m, scratch_v = zeros(kept), zeros(kept), zeros(kept)

    @tf.function(jit_compile=True)
    def kept_weights_apart(g):
        scratch_kept.assign(fused._Adam.update(s, h, scratch_kept.read_value(), g[:kept], [scratch_m, scratch_v]))
        scratch.assign(eight_bit(scratch.read_value(), g, scratch_codes))

    runs = {"every element 8-bit, one buffer": lambda: every_8bit(grad),
            "codes over all, float32 run's weights apart (shipped)": lambda: kept_weights_apart(grad),
            "float32 run, one buffer, joined": lambda: one_buffer_joined(grad),
            "float32 run in buffers of its own": lambda: buffers_apart(grad_kept, grad_rest)}
    times = {name: [] for name in runs}
    for run in runs.values():
        run()
    names = list(runs)
    for k in range(args.rounds + 10):
        for name in names if k % 2 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            float(tf.reduce_sum(every[:1]))  # waits for what was queued
            if k >= 10:
                times[name].append((time.perf_counter() - start) * 1000)
    first = statistics.median(times[names[0]])
    print("the flat 8-bit update of P1's elements alone: ms, median (ratio to every element 8-bit)")
    for name, values in times.items():
        print(f"  {name:55s} {statistics.median(values):6.2f} ({statistics.median(values) / first:.2f}x)")


if __name__ == "__main__":
    main()
