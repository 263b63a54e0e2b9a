"""ZeRO stage 1 (docs/zero.md): step time and optimizer-state bytes, stage 0 vs stage 1, side by side.

Under MirroredStrategy on two logical CPUs, kmp prepared with the flat
buffers (Adam), at `zero_stage=0` and `zero_stage=1`, on two models:

- the issues' MLP (40 x Dense(256), 2.6M parameters, batch 64), mixed_float16;
- four Dense(2048) layers (12.6M parameters, batch 16), float32: the update
  is a larger part of the step.

Beside them, the limits: stock Keras under the strategy, and one device
with whole-step XLA (Keras, `jit_compile=True`) at the same global batch.
Rows run in interleaved rounds (benchmarks/common.py); each row reports
steady ms per step (median, spread, ratio to stage 0) and its whole fit()
seconds; then the bytes each replica device holds (kmp.measured_bytes).

    python benchmarks/zero_stage1.py [--rounds 5] [--steps 30] [--quick]

The latest figures are in benchmarks/RESULTS.md ("ZeRO stage 1"). What to
expect on two logical devices that share two cores and one memory: the two
replicas' updates already run in parallel, so halving each buys little and
stage 1 adds a gather of the whole weights (kmp.engine.zero says which
gathers were tried); the flat slots shrink by half, and Keras's copy of the
state is held once in host memory (docs/zero.md). With 8-bit states the
update is a larger part of the step, so halving it shows more. The whole
fit() of the larger model varies by seconds between calls: compare its
steady ms per step.
"""

from __future__ import annotations

import argparse
import statistics

from common import fit_times, interleaved, mlp, regression_data, report, use_two_logical_cpus

MODELS = {  # name: (depth, width, batch, policy)
    "MLP 40x256, mixed_float16": (40, 256, 64, "mixed_float16"),
    "4 x Dense(2048), float32": (4, 2048, 16, "float32"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="the MLP only, 3 rounds of 15 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 15

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for title, (depth, width, batch, policy) in list(MODELS.items())[:1 if args.quick else None]:
        x, y = regression_data(batch, args.steps, width)

        def compiled(strategy, optimizer, stage=None, jit_compile="auto"):
            keras.config.set_dtype_policy(policy)
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = mlp(depth, width)
                model.compile(optimizer=optimizer(), loss="mse", jit_compile=jit_compile)
            if stage is not None:
                kmp.prepare(model, flat_buffers=True)
            model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0)  # trace, compile
            keras.config.set_dtype_policy("float32")
            return model

        adam = lambda: keras.optimizers.Adam(1e-4)  # noqa: E731
        stock = (lambda: keras.optimizers.LossScaleOptimizer(adam())) if policy == "mixed_float16" else adam
        models = {
            "kmp, flat buffers, stage 0": compiled(mirrored, lambda: kmp.wrap(adam(), zero_stage=0), 0),
            "kmp, flat buffers, stage 1": compiled(mirrored, lambda: kmp.wrap(adam(), zero_stage=1), 1),
            "kmp, 8-bit states, stage 0": compiled(mirrored, lambda: kmp.wrap(adam(), states="8bit", zero_stage=0), 0),
            "kmp, 8-bit states, stage 1": compiled(mirrored, lambda: kmp.wrap(adam(), states="8bit", zero_stage=1), 1),
            "stock Keras, Mirrored": compiled(mirrored, stock),
            "stock Keras, one device, whole-step XLA": compiled(tf.distribute.get_strategy(), stock,
                                                                jit_compile=True),
        }
        seconds = {name: [] for name in models}

        def timed(name):
            ms, whole = fit_times(models[name], x, y, batch)
            seconds[name].append(whole)
            return ms

        times = interleaved({name: (lambda n=name: timed(n)) for name in models}, args.rounds)
        report(f"{title}, batch {batch}, {args.steps} steps", times, "kmp, flat buffers, stage 0")
        print("whole fit() seconds, median of the timed calls:")
        for name, values in seconds.items():
            print(f"  {name:44s} {statistics.median(values[-args.rounds:]):6.2f} s")
        print("bytes per replica device (kmp.measured_bytes): optimizer state | flat copies")
        for name in [n for n in models if n.startswith("kmp")]:
            for device, held in kmp.measured_bytes(models[name]).items():
                print(f"  {name:28s} {device.split('/')[-1]:12s} {held.optimizer_state:>12,} | "
                      f"{held.flat_copies:>12,}")


if __name__ == "__main__":
    main()
