"""What an epoch's end costs: P1's fit() of many short epochs against one epoch of the same steps.

P1 (40 x Dense(256), batch 64, Adam) with kmp's flat buffers under
MirroredStrategy on two logical CPUs, beside stock Keras on one device with
whole-step XLA (the floor) and stock Keras under the same strategy. Each
round times, for every model, one fit() of `--epochs` epochs of
`--steps / --epochs` steps and one fit() of a single epoch of `--steps`
steps: the same steps, so the difference over `--epochs - 1` is what each
further epoch costs besides its steps (Keras's epoch loop, the input
iterator, and kmp's copies there). No callback of the user's; no
validation, an epoch's end that nothing reads, or with `--validation`
each epoch validated on 2 batches (in both fits: the difference then
holds each further validation too).

    python benchmarks/p1_epochs.py [--policy mixed_float16] [--rounds 7] [--epochs 10] [--steps 30] [--validation]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import mlp, regression_data, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--validation", action="store_true", help="validate each epoch on 2 batches")
    args = parser.parse_args()
    if args.epochs < 2 or args.steps % args.epochs:
        parser.error("--epochs must be at least 2 and divide --steps")
    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    batch = 64
    x, y = regression_data(batch, args.steps)
    keras.config.set_dtype_policy(args.policy)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def built(strategy, wrapped, jit_compile):
        with strategy.scope() if strategy else keras.name_scope("one_device"):
            keras.utils.set_random_seed(0)
            model = mlp()
            optimizer = keras.optimizers.Adam(1e-4)
            model.compile(optimizer=kmp.wrap(optimizer) if wrapped else optimizer, loss="mse",
                          jit_compile=jit_compile)
        return model

    models = {
        "kmp prepared, flat buffers, MirroredStrategy": kmp.prepare(built(mirrored, True, "auto"),
                                                                    flat_buffers=True),
        "stock Keras, MirroredStrategy": built(mirrored, False, False),
        "stock Keras, ONE device, whole-step XLA (the floor)": built(None, False, True),
    }

    def timed(model, epochs):
        rows = batch * args.steps // epochs
        start = time.perf_counter()
        model.fit(x[:rows], y[:rows], batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  validation_data=(x[:2 * batch], y[:2 * batch]) if args.validation else None)
        return time.perf_counter() - start

    for model in models.values():  # traced and compiled, and warm
        for epochs in (1, args.epochs, 1, args.epochs):
            timed(model, epochs)
    times = {(name, epochs): [] for name in models for epochs in (1, args.epochs)}
    for _ in range(args.rounds):
        for (name, epochs), seconds in times.items():
            seconds.append(timed(models[name], epochs))
    print(f"P1, {args.policy}: {args.steps} steps as one epoch and as {args.epochs} epochs of "
          f"{args.steps // args.epochs}{', each validated' if args.validation else ''}; "
          f"medians of {args.rounds} interleaved rounds")
    many = {}
    for name in models:
        one, many[name] = (statistics.median(times[(name, e)]) for e in (1, args.epochs))
        per_epoch = (many[name] - one) / (args.epochs - 1)
        print(f"{name}: one epoch {one:.3f} s; {args.epochs} epochs {many[name]:.3f} s; "
              f"each further epoch {per_epoch * 1e3:.1f} ms")
    ours, *_, floor = many.values()
    print(f"kmp's fit() of {args.epochs} epochs against the floor's: {ours / floor:.2f}x")


if __name__ == "__main__":
    main()
