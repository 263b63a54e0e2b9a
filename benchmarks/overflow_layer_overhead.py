"""What naming the overflowing layer costs on steps that do not overflow.

`kmp.prepare(model)` wraps the train step with kmp.overflow_layer's
diagnosis (`find_overflow_layer=True`, the default): on a clean step it reads
the skipped-steps counter twice and takes no branch. Side by side, in
interleaved rounds: the issues' MLP (40 x Dense(256), batch 64, Adam,
mixed_float16), prepared with the diagnosis on and off, on one device
(without XLA, in float32: see below; and with Keras's whole-step XLA) and
under MirroredStrategy on two logical CPUs (XLA per replica). Also printed: the first fit() of each
variant (tracing and compiling, where the second traced forward pass costs).

    python benchmarks/overflow_layer_overhead.py [--rounds 5] [--steps 30] [--depth 40 --width 256]

A small MLP (--depth 4 --width 64 --steps 200) shows the fixed cost per
step, which a large step hides.
"""

from __future__ import annotations

import argparse
import time

from common import fit_ms_per_step, interleaved, mlp, regression_data, report, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
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
    x, y = regression_data(args.batch, args.steps, args.width)
    first_fit = {}

    def variant(name, strategy, find, jit_compile="auto", policy="mixed_float16"):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(args.depth, args.width)
            model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4)), loss="mse",
                          jit_compile=jit_compile)
        kmp.prepare(model, find_overflow_layer=find)
        start = time.perf_counter()
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)
        first_fit[name] = time.perf_counter() - start
        print(f"built {name}: first fit {first_fit[name]:.1f} s", flush=True)
        keras.config.set_dtype_policy("float32")
        assert int(model.optimizer.skipped_steps.numpy()) == 0, "a variant overflowed: not a clean-step timing"
        def measure():
            ms = fit_ms_per_step(model, x, y, args.batch)
            print(f"  {name}: {ms:.1f} ms/step", flush=True)
            return ms

        return measure

    # Without XLA, TensorFlow's CPU float16 matmul takes seconds per step of
    # this MLP here: that row runs in float32 (the step and its wrapper are the same).
    groups = [
        ("one device, no XLA (float32)", default, False, "float32"),
        ("one device, Keras's whole-step XLA", default, True, "mixed_float16"),
        ("MirroredStrategy, 2 logical CPUs, XLA per replica", mirrored, "auto", "mixed_float16"),
    ]
    variants = {}
    for title, strategy, jit, policy in groups:
        for find in (False, True):
            name = f"{title}: find_overflow_layer={find}"
            variants[name] = variant(name, strategy, find, jit, policy)
    times = interleaved(variants, args.rounds)
    for title, *_ in groups:
        off, on = f"{title}: find_overflow_layer=False", f"{title}: find_overflow_layer=True"
        report(f"{title} (ms per step, steady state)", {off: times[off], on: times[on]}, off)
    print("\nfirst fit() of 2 steps (s): tracing and compiling")
    for name, seconds in first_fit.items():
        print(f"  {name:75s} {seconds:6.1f}")


if __name__ == "__main__":
    main()
