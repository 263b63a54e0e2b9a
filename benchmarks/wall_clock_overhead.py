"""What `wall_clock_breakdown` costs: the same prepared model timed with it off and on.

kmp.engine.wall_clock places six `tf.timestamp()` ops in the traced step, each
after the values of the part before it, and times each call of the train
function on the host. Measured side by side: the issues' MLP (40 x
Dense(256), batch 64, Adam, mixed_float16), prepared, breakdown off and on:

- under MirroredStrategy on two logical CPUs (XLA per replica both ways);
- on one device, where "off" is Keras's whole-step XLA and "on" compiles
  the forward/backward and the update apart (a stamp cannot sit inside one
  XLA computation): that difference is part of what the breakdown costs.

The two models of a pair take single steps in alternation
(`model.train_function`, the loss read back), the median step is reported,
and the first fit() of each (setup, tracing, XLA compilation). The on/off
ratio is the overhead; the issue's bound is 1.05.

    python benchmarks/wall_clock_overhead.py [--steps 300] [--depth 40 --width 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import alternating_steps, mlp, regression_data, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
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
    # A line every 10**6 steps: the per-step cost (stamps, host timing) without the prints.
    quiet = 10**6

    def variant(strategy, breakdown):
        keras.config.set_dtype_policy("mixed_float16")
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(args.depth, args.width)
            model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-4)), loss="mse")
        kmp.prepare(model, wall_clock_breakdown=quiet if breakdown else False)
        start = time.perf_counter()
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)
        first_fit = time.perf_counter() - start
        keras.config.set_dtype_policy("float32")
        data = strategy.experimental_distribute_dataset(dataset) if strategy is mirrored else dataset
        return model, iter(data), first_fit

    groups = [
        ("MirroredStrategy, 2 logical CPUs, XLA per replica", mirrored),
        ("one device (off: whole-step XLA; on: XLA parts)", default),
    ]
    print(f"MLP {args.depth} x Dense({args.width}), batch {args.batch}, mixed_float16; "
          f"median of {args.steps} alternating steps")
    print(f"{'':52s} {'off ms':>8s} {'on ms':>8s} {'on/off':>7s}   first fit() off / on (s)")
    for title, strategy in groups:
        pair = {on: variant(strategy, on) for on in (False, True)}
        times = alternating_steps(pair, args.steps)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{title:52s} {off:8.2f} {on:8.2f} {on / off:7.3f}   {pair[False][2]:.1f} / {pair[True][2]:.1f}")


if __name__ == "__main__":
    main()
