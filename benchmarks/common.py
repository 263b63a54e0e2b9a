"""Shared set-up for kmp's benchmarks: devices, the MLP of the issues, timing.

Benchmarks report ratios measured side by side in one process: variants run
in interleaved rounds, so drift on a shared machine hits all of them alike,
and the median of the rounds is reported.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

# Benchmark the kmp of this checkout: a script's own folder (benchmarks/) is
# first on sys.path and the checkout's root is not, so an installed kmp (an
# older copy, here) would be imported instead.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def use_two_logical_cpus() -> None:
    """Split the CPU in two logical devices (before TF initializes)."""
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


def mlp(depth: int = 40, width: int = 256, float32_output: bool = True):
    """The issues' MLP: `depth` Dense(width) layers, a float32 regression head."""
    import keras

    inputs = keras.Input((width,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="relu")(x)
    x = keras.layers.Dense(1)(x)
    if float32_output:
        x = keras.layers.Activation("linear", dtype="float32")(x)
    return keras.Model(inputs, x)


def regression_data(batch: int, steps: int, width: int = 256, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    return x, y


def fit_ms_per_step(model, x, y, batch: int) -> float:
    """Wall milliseconds per step of `fit` in steady state (already warmed up).

    Timed from the end of the first step to the end of the last, so fit()'s
    fixed cost per call is left out: on this 2-core VM it varies between
    calls by whole seconds (setting up and tearing down the distributed
    input), a noise that per-step timing does not have. Each step's logs are
    read back (Keras does that for any callback with batch hooks), for every
    variant alike.
    """
    return fit_times(model, x, y, batch)[0]


def fit_times(model, x, y, batch: int) -> tuple[float, float]:
    """(steady ms per step as fit_ms_per_step, wall seconds of the whole fit() call)."""
    steady, whole, _ = fit_phases(model, x, y, batch)
    return steady, whole


def fit_phases(model, x, y, batch: int) -> tuple[float, float, float]:
    """fit_times, and the seconds from the callbacks' on_train_end to fit() returning.

    That exit is where stock Keras destroys fit()'s input iterator, which
    can wait, idle, for seconds: until the next wake of tf.data's autotuning
    loop (benchmarks/RESULTS.md, P6). A prepared model's iterator is
    destroyed on kmp's thread instead (kmp/engine/iterators.py).
    """
    marks = []
    ended = []
    clock = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: marks.append(time.perf_counter()),
                                           on_train_end=lambda logs: ended.append(time.perf_counter()))
    # The clock reads no weights: kmp's flat-buffer engine need not copy them out around it.
    clock.kmp_reads_weights = False
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
    end = time.perf_counter()
    return (marks[-1] - marks[0]) * 1000 / (len(marks) - 1), end - start, end - ended[-1]


def interleaved(variants: dict, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Runs each `name -> callable returning ms` once per round, in turn.

    The first `warmup` rounds are not recorded (lazy initialization, caches).
    What was built before is frozen out of Python's cyclic garbage collector
    (gc.freeze): with several models in one process (over a million objects
    with P6's six), a full collection takes about a second and lands inside
    whichever fit() is running, a pause a process holding one model does not have.
    """
    gc.collect()
    gc.freeze()
    for _ in range(warmup):
        for measure in variants.values():
            measure()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, measure in variants.items():
            times[name].append(measure())
    return times


def report(title: str, times: dict[str, list[float]], baseline: str) -> None:
    base = statistics.median(times[baseline])
    width = max(44, *(len(name) for name in times))
    print(f"\n{title}")
    print(f"{'variant':{width}s} {'median ms':>15s} {'spread':>14s} {'ratio':>7s}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{name:{width}s} {median:15.1f} {spread:>14s} {median / base:7.2f}x")


def alternating_steps(models: dict, steps: int, warmup: int = 20) -> dict[object, list[float]]:
    """ms of single `model.train_function(iterator)` calls, the loss read back, for each
    `key -> (model, iterator, ...)` (a pair, or more), in alternation (the order flips each round),
    so the drift of a shared machine hits them alike. The first `warmup` rounds are not kept."""
    keys = list(models)
    times = {key: [] for key in keys}
    for k in range(steps + warmup):
        for key in keys if k % 2 else keys[::-1]:
            model, iterator = models[key][:2]
            start = time.perf_counter()
            float(model.train_function(iterator)["loss"])
            if k >= warmup:
                times[key].append((time.perf_counter() - start) * 1000)
    return times
