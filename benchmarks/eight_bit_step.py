"""P1's training step with 8-bit Adam states against 32-bit ones, single steps in alternation.

P1 (40 x Dense(256), batch 64, Adam, mixed_float16), kmp.prepare with the
flat buffers, on one device or (--two) MirroredStrategy on two logical CPUs
at ZeRO stage 0. Three models: 32-bit states, 8-bit as shipped (the 40
biases, under min_8bit_size, in float32), and 8-bit for every variable
(min_8bit_size=0). Single `train_function` calls, the loss read back, the
models in alternation (the order changes each round: drift hits all alike),
benchmarks/common.py's alternating_steps; median ms and the ratios.

    python benchmarks/eight_bit_step.py [--two] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics

from common import alternating_steps, mlp, regression_data, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--two", action="store_true", help="MirroredStrategy on two logical CPUs")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.two:
        use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if args.two else tf.distribute.get_strategy()
    x, y = regression_data(64, 200, 256)

    def prepared(states, **settings):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = mlp(40, 256)
            inner = kmp.Adam8bit(1e-4, **settings) if settings else keras.optimizers.Adam(1e-4)
            model.compile(optimizer=kmp.wrap(inner, states=states), loss="mse")
        kmp.prepare(model, flat_buffers=True)
        model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)  # trace, compile
        keras.config.set_dtype_policy("float32")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat()
        model.make_train_function()
        return model, iter(strategy.experimental_distribute_dataset(data) if args.two else data)

    times = alternating_steps({"32bit": prepared("32bit"), "8bit": prepared("8bit"),
                               "8bit, every variable": prepared("8bit", min_8bit_size=0)}, args.steps, warmup=10)
    where = "MirroredStrategy on two logical CPUs, stage 0" if args.two else "one device"
    print(f"P1, flat buffers, {where}: ms per step, median (min)")
    for states, values in times.items():
        print(f"  {states:21s} {statistics.median(values):7.1f} ({min(values):.1f})")
    for states in ("8bit", "8bit, every variable"):
        print(f"  {states} / 32-bit: {statistics.median(times[states]) / statistics.median(times['32bit']):.3f}x")


if __name__ == "__main__":
    main()
