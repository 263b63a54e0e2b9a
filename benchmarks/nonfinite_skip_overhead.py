"""What kmp's non-finite skip costs where no loss scaling is needed.

With `gradient_clipping` in float32 or bfloat16, `kmp.wrap` returns kmp's
optimizer with a static scale of 1 (it clips the all-reduced gradient and
skips a step whose gradient is not finite) instead of a Keras optimizer with
`global_clipnorm`. Measured side by side on one device, plain `fit()` (no
kmp.prepare): the same model with Keras's `Adam(global_clipnorm=1.0)` and
with `kmp.LossScaleOptimizer(Adam(), static_scale=1.0, gradient_clipping=1.0)`,
single training steps in alternation, median step reported.

    python benchmarks/nonfinite_skip_overhead.py [--steps 300] [--depth 4 --width 64]
"""

from __future__ import annotations

import argparse
import statistics

from common import alternating_steps, mlp, regression_data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import kmp

    x, y = regression_data(args.batch, 20, args.width)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()

    def variant(skip, policy):
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        model = mlp(args.depth, args.width)
        if skip:
            optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4), static_scale=1.0, gradient_clipping=1.0)
        else:
            optimizer = keras.optimizers.Adam(1e-4, global_clipnorm=1.0)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)
        keras.config.set_dtype_policy("float32")
        return model, iter(dataset)

    print(f"MLP {args.depth} x Dense({args.width}), batch {args.batch}, one device, plain fit(); "
          f"median of {args.steps} alternating steps")
    print(f"{'':16s} {'Keras ms':>9s} {'kmp ms':>8s} {'kmp/Keras':>10s}")
    for policy in ("float32", "mixed_bfloat16"):
        pair = {skip: variant(skip, policy) for skip in (False, True)}
        times = alternating_steps(pair, args.steps)
        plain, skip = statistics.median(times[False]), statistics.median(times[True])
        print(f"{policy:16s} {plain:9.3f} {skip:8.3f} {skip / plain:10.3f}")


if __name__ == "__main__":
    main()
