"""What a multi-epoch fit() waits for between its epochs: the teardown of each epoch's input iterator.

Destroying a tf.data iterator with autotuning waits until tf.data's autotune
thread next wakes (kmp/engine/iterators.py says why). Keras destroys each
epoch's iterator when the next epoch starts, and the last when fit() returns;
a prepared model's are destroyed on kmp's thread instead.

Stock Keras and the same model prepared by kmp, one device, fed numpy arrays
(Keras's own tf.data pipeline, autotuned), whole-step XLA for both, in
interleaved rounds. Per fit(): the whole call, the steps' sum, and the time
in neither (epoch starts, the exit).

    python benchmarks/input_teardown.py [--rounds 3] [--epochs 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (sets up sys.path and TF's logging first)
import keras
import numpy as np

import kmp

WIDTH, DEPTH, BATCH = 2048, 4, 256


def build(prepared: bool):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH) for _ in range(DEPTH)]
                             + [keras.layers.Dense(1)])
    model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-4)), loss="mse", jit_compile=True)
    return kmp.prepare(model) if prepared else model


def timed_fit(model, x, y, epochs: int) -> tuple[float, float, float]:
    """(whole fit() s, the steps' s, the rest: s outside any step)."""
    spans, begun = [], []
    clock = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs=None: begun.append(time.perf_counter()),
                                           on_train_batch_end=lambda b, logs=None: spans.append(
                                               time.perf_counter() - begun[-1]))
    clock.kmp_reads_weights = False  # logs only: the flat buffers need not be copied out for it
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False, callbacks=[clock])
    whole = time.perf_counter() - start
    return whole, sum(spans), whole - sum(spans)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * args.steps, WIDTH)).astype("float32")
    y = rng.random((BATCH * args.steps, 1)).astype("float32")
    models = {"stock Keras": build(False), "kmp prepared": build(True)}
    for model in models.values():
        model.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, verbose=0)  # trace and compile
    times = common.interleaved({name: (lambda m=m: timed_fit(m, x, y, args.epochs)) for name, m in models.items()},
                               args.rounds, warmup=0)
    print(f"\n{args.epochs} epochs of {args.steps} steps, one device, numpy input; median of {args.rounds} rounds (range)")
    print(f"{'variant':14s} {'whole fit() s':>20s} {'steps s':>8s} {'outside steps s':>22s}")
    for name, runs in times.items():
        whole, steps, rest = (sorted(r[i] for r in runs) for i in range(3))
        print(f"{name:14s} {statistics.median(whole):8.2f} ({whole[0]:.2f}-{whole[-1]:.2f}) "
              f"{statistics.median(steps):8.2f} {statistics.median(rest):8.2f} ({rest[0]:.2f}-{rest[-1]:.2f})")


if __name__ == "__main__":
    main()
