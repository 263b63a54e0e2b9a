"""8-bit against 32-bit states on the demo's model, over seeds and neighbouring learning rates, in one process.

`kmp demo --seed N [--states 8bit]` trains on the bundled digits
(mixed_float16, AdamW 2e-3, batch 32, 10 epochs) and reports the test
accuracy of 359 images. One run's figure moves by points with the smallest
change (a learning rate one part in ten thousand away), so a per-seed
comparison mostly measures that noise. This trains the demo's model as
`kmp demo` does, for every seed and every learning rate in
{rate, rate x (1 + d), rate x (1 - d)}, with 32-bit and 8-bit states, and
reports each pair and, over all pairs: the mean, the lowest run, and how
many 8-bit runs are within 0.5 points of their 32-bit twin or above it.

    python benchmarks/eight_bit_demo_accuracy.py [--seeds 5] [--delta 1e-4] [--flat-buffers false]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=2e-3)
    parser.add_argument("--delta", type=float, default=1e-4, help="the rates' relative step")
    parser.add_argument("--flat-buffers", choices=("auto", "false"), default="auto",
                        help="kmp.prepare's flat_buffers ('false': the per-variable path)")
    args = parser.parse_args()
    import keras

    import kmp
    from kmp.cli.main import DEMO_SCALE_POWER, DEMO_WINDOW
    from kmp.data.datasets import load_digits

    def accuracy(seed: int, rate: float, states: str) -> float:
        # As kmp demo builds and trains its model (kmp/cli/main.py), without its callbacks.
        (x, y), (x_test, y_test) = load_digits(seed=seed)
        keras.utils.set_random_seed(seed)
        with kmp.precision_scope("mixed_float16") as chosen:
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(256, activation="relu")(inputs)
            hidden = keras.layers.Dense(256, activation="relu")(hidden)
            model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(10)(hidden), activation="softmax"))
            optimizer = kmp.wrap(keras.optimizers.AdamW(rate), precision=chosen, states=states,
                                 initial_scale=2.0 ** DEMO_SCALE_POWER, dynamic_growth_steps=DEMO_WINDOW)
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            kmp.prepare(model, flat_buffers="auto" if args.flat_buffers == "auto" else False)
            model.fit(x, y, batch_size=32, epochs=10, verbose=0)
            return 100 * model.evaluate(x_test, y_test, verbose=0)[1]

    pairs = []
    print(f"test accuracy (%), flat_buffers={args.flat_buffers}: seed, rate, 32-bit, 8-bit, 8-bit - 32-bit")
    for seed in range(args.seeds):
        for rate in (args.rate, args.rate * (1 + args.delta), args.rate * (1 - args.delta)):
            a, b = accuracy(seed, rate, "32bit"), accuracy(seed, rate, "8bit")
            pairs.append((a, b))
            print(f"  {seed}  {rate:.7f}  {a:6.2f}  {b:6.2f}  {b - a:+.2f}", flush=True)
    full, eight = zip(*pairs)
    within = sum(b >= a - 0.5 - 1e-9 for a, b in pairs)
    print(f"over {len(pairs)} pairs: 32-bit mean {statistics.mean(full):.2f}, lowest {min(full):.2f}; "
          f"8-bit mean {statistics.mean(eight):.2f}, lowest {min(eight):.2f}; "
          f"8-bit within 0.5 points or above in {within} of {len(pairs)}")


if __name__ == "__main__":
    main()
