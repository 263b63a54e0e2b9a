"""P1's whole fit() call, part by part: what a warm kmp fit() spends besides its steps.

P1 (40 x Dense(256), batch 64, Adam) with kmp's flat buffers under
MirroredStrategy on two logical CPUs, 30 steps per fit(). After three
warm-up calls, whole fit() calls of 30 steps and of one step are timed in
`--calls` interleaved rounds, each with the input kmp chooses (global
batches split in the step) and with tf.distribute's per-replica iterator;
the difference between the two lengths gives a step, and what one call costs
besides its steps. kmp's own copies are timed in those calls as fit() makes
them (the store, the check, any load: `FlatBuffers.store`,
`written_since_store` and `load` of this model, wrapped), beside the step.
Then one call runs under cProfile and its time is split into:

- the steps (Keras's train function, kmp's wrappers included);
- Keras distributing the dataset (`experimental_distribute_dataset`, once
  per fit() under a strategy);
- making the epoch's input iterator: tf.distribute's MultiDeviceIterator,
  whose own tf.functions are traced anew each time, or, where kmp splits the
  batches in the step (kmp.engine.host_batches), a plain tf.data iterator;
- kmp's copies between the flat buffers and the Keras variables (a store
  after the last step; before the first, a check of what was written since
  the last store, and a load of that);
- the rest (callbacks, Keras's setup and teardown).

cProfile slows Python-heavy parts more than the steps, so the split is
read as proportions of the profiled call.

    python benchmarks/p1_fit_parts.py [--policy mixed_float16] [--calls 5]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from common import mlp, regression_data, use_two_logical_cpus

# part -> (file suffix, function name)s: the profiled call's cumulative time in those functions.
# The steps: kmp's own loop (kmp.engine.prepare._own_loop), which calls Keras's train function
# only where it does not run the steps itself; the larger of the two is the steps' time.
_STEPS = [("kmp/engine/prepare.py", "function"), ("keras/src/backend/tensorflow/trainer.py", "function")]
_PARTS = {
    "distributing the data": [("tensorflow/python/distribute/distribute_lib.py", "experimental_distribute_dataset")],
    "the input iterator": [("tensorflow/python/distribute/input_lib.py", "_create_iterators_per_worker"),
                           ("tensorflow/python/data/ops/iterator_ops.py", "_create_iterator")],
    "the copies": [("kmp/engine/buffers.py", "_copy"), ("kmp/engine/buffers.py", "written_since_store")],
}


def _cumulative(stats, functions) -> float:
    return sum(row[3] for (file, _, function), row in stats.stats.items()
               if any(file.endswith(suffix) and function == name for suffix, name in functions))


def _time_copies(model) -> list:
    """The seconds of each copy kmp's engine makes for `model` from now on (this instance's methods
    wrapped), appended to the list returned."""
    from kmp.engine import engine

    buffers, seconds = engine.engine_of(model).buffers, []

    def timed(method):
        def timed_method(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)
        return timed_method

    for name in ("store", "load", "written_since_store"):
        setattr(buffers, name, timed(getattr(buffers, name)))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    batch = 64
    x, y = regression_data(batch, args.steps)
    keras.config.set_dtype_policy(args.policy)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        keras.utils.set_random_seed(0)
        model = mlp()
        model.compile(optimizer=kmp.wrap(keras.optimizers.Adam(1e-4)), loss="mse")
    kmp.prepare(model, flat_buffers=True)

    def fit():
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)

    from kmp.engine import host_batches

    split_in_step = host_batches.possible

    def timed(steps, host):
        # kmp's choice is made per fit() (kmp.engine.host_batches): off, the same train function
        # takes tf.distribute's iterator.
        host_batches.possible = split_in_step if host else (lambda strategy: False)
        try:
            start = time.perf_counter()
            model.fit(x[:batch * steps], y[:batch * steps], batch_size=batch, epochs=1, verbose=0)
            return time.perf_counter() - start
        finally:
            host_batches.possible = split_in_step

    for _ in range(3):
        fit()
        timed(args.steps, False)
    copies = _time_copies(model)
    # Interleaved rounds: whole fit() calls of `steps` and of one step, each input path.
    rounds = {(steps, host): [] for steps in (args.steps, 1) for host in (True, False)}
    copied = []  # seconds of kmp's copies in each call of `steps`, host batches
    for _ in range(args.calls):
        for key, times in rounds.items():
            copies.clear()
            times.append(timed(*key))
            if key == (args.steps, True):
                copied.append(sum(copies))
    whole = rounds[(args.steps, True)]
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(fit)
    profiled = time.perf_counter() - start
    stats = pstats.Stats(profile)
    parts = {"the steps": max(_cumulative(stats, [f]) for f in _STEPS)}
    parts.update({name: _cumulative(stats, functions) for name, functions in _PARTS.items()})
    parts["the rest"] = profiled - sum(parts.values())
    print(f"P1, {args.policy}, flat buffers, MirroredStrategy on two logical CPUs, fit() of {args.steps} steps")
    print(f"whole fit(): {statistics.median(whole):.3f} s (median of {args.calls}: "
          f"{', '.join(f'{w:.3f}' for w in whole)})")
    for host, name in ((True, "host batches split in the step"), (False, "tf.distribute's iterator")):
        many, one = (statistics.median(rounds[(steps, host)]) for steps in (args.steps, 1))
        per_step = (many - one) / (args.steps - 1)
        print(f"input from {name}: fit() of {args.steps} steps {many:.3f} s, of 1 step {one:.3f} s; "
              f"per call besides the steps {one - per_step:.3f} s ({per_step * 1e3:.1f} ms per step)")
        if host:
            own = statistics.median(copied)
            print(f"  kmp's copies per call: {own * 1e3:.1f} ms (median; {', '.join(f'{c * 1e3:.1f}' for c in copied)}),"
                  f" {own / per_step:.2f} of a step")
    print(f"one fit() under cProfile: {profiled:.3f} s")
    for name, seconds in parts.items():
        print(f"  {name:20s} {seconds:6.3f} s  {seconds / profiled:5.1%}")


if __name__ == "__main__":
    main()
