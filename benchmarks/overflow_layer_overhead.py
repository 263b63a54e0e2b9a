"""What naming the overflowing layer costs on steps that do not overflow.

`kmp.prepare(model)` wraps the train step with kmp.engine.overflow_layer's
diagnosis (`find_overflow_layer=True`, the default): on a clean step it reads
the skipped-steps counter twice and takes no branch. Measured side by side:
an MLP (the issues' 40 x Dense(256) by default, batch 64, Adam) prepared
with the diagnosis on and off, on one device (without XLA, in float32: see
below; and mixed_float16 with Keras's whole-step XLA) and, in mixed_float16,
under MirroredStrategy on two logical CPUs (XLA per replica).

The two models of a pair take single training steps in alternation
(`model.train_function` on a repeating dataset, the loss read back after
each step), so the drift of a shared machine hits both alike; the median
step is reported. Also printed: the first fit() of each variant (tracing
and compiling, where the second traced forward pass costs).

    python benchmarks/overflow_layer_overhead.py [--steps 400] [--depth 40 --width 256]

A small MLP (--depth 4 --width 64) shows the fixed cost per step, which a
large step hides.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import alternating_steps, mlp, regression_data, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    default = tf.distribute.get_strategy()
    x, y = regression_data(args.batch, 20, args.width)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()

    def variant(strategy, find, jit_compile, policy):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(args.depth, args.width)
            model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4)), loss="mse",
                          jit_compile=jit_compile)
        kmp.prepare(model, find_overflow_layer=find)
        start = time.perf_counter()
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)
        first_fit = time.perf_counter() - start
        keras.config.set_dtype_policy("float32")
        data = strategy.experimental_distribute_dataset(dataset) if strategy is mirrored else dataset
        return model, iter(data), first_fit

    # Without XLA, TensorFlow's CPU float16 matmul takes seconds per step of
    # the large MLP here: that pair runs in float32 (the step and its wrapper
    # are the same).
    groups = [
        ("one device, no XLA (float32)", default, False, "float32"),
        ("one device, Keras's whole-step XLA (mixed_float16)", default, True, "mixed_float16"),
        ("MirroredStrategy, 2 logical CPUs, XLA per replica (mixed_float16)", mirrored, "auto", "mixed_float16"),
    ]
    print(f"MLP {args.depth} x Dense({args.width}), batch {args.batch}; median of {args.steps} alternating steps")
    print(f"{'':68s} {'off ms':>8s} {'on ms':>8s} {'on/off':>7s}   first fit() off / on (s)")
    for title, strategy, jit, policy in groups:
        pair = {find: variant(strategy, find, jit, policy) for find in (False, True)}
        times = alternating_steps(pair, args.steps)
        for model, _, _ in pair.values():
            assert int(model.optimizer.skipped_steps.numpy()) == 0, "an overflow: not a clean-step timing"
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{title:68s} {off:8.2f} {on:8.2f} {on / off:7.3f}   {pair[False][2]:.1f} / {pair[True][2]:.1f}")


if __name__ == "__main__":
    main()
