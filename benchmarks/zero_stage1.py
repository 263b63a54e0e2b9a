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

Measured 2026-11-25 on this 2-core VM (`--rounds 5 --steps 30`, 10 min):

    MLP 40x256, mixed_float16, batch 64         median ms   spread       ratio
    kmp, flat buffers, stage 0                   69.7       68.5-75.8    1.00x
    kmp, flat buffers, stage 1                   76.1       65.5-78.6    1.09x
    stock Keras, Mirrored                        73.3       70.1-88.0    1.05x
    stock Keras, one device, whole-step XLA      45.2       37.9-46.5    0.65x
    whole fit() s: 2.77 | 3.00 | 2.80 | 2.59
    bytes per device, optimizer state | flat copies:
      stage 0  21,055,496 | 31,583,244      stage 1  21,055,496 | 21,055,500

    4 x Dense(2048), float32, batch 16
    kmp, flat buffers, stage 0                  346.0      339.4-414.5   1.00x
    kmp, flat buffers, stage 1                  375.3      372.3-384.6   1.08x
    stock Keras, Mirrored                       493.0      480.2-515.4   1.42x
    stock Keras, one device, whole-step XLA      76.7       72.7-80.0    0.22x
    whole fit() s: 21.02 | 20.99 | 15.79 | 2.38
    bytes per device, optimizer state | flat copies:
      stage 0 134,299,656 | 201,449,484     stage 1 134,299,656 | 134,299,660

Again 2026-11-25, later (`--quick`: the MLP only, 3 rounds of 15 steps;
this run's machine was slower throughout), with the 8-bit rows and
Keras's copy of the state in host memory at stage 1 (kmp.engine.zero.to_host):

    MLP 40x256, mixed_float16, batch 64         median ms   spread       ratio
    kmp, flat buffers, stage 0                  103.8       93.0-109.8   1.00x
    kmp, flat buffers, stage 1                  121.9      104.1-127.8   1.17x
    kmp, 8-bit states, stage 0                  265.0      229.5-269.7   2.55x
    kmp, 8-bit states, stage 1                  171.5      170.5-191.2   1.65x
    stock Keras, Mirrored                       140.2      116.1-146.0   1.35x
    stock Keras, one device, whole-step XLA      60.0       53.7-60.5    0.58x
    whole fit() s: 2.83 | 2.93 | 5.55 | 3.93 | 2.91 | 0.99
    bytes per device, optimizer state | flat copies (CPU:0 is also the host):
      32-bit stage 0  CPU:0 21,055,496 | 31,583,244   CPU:1 21,055,496 | 31,583,244
      32-bit stage 1  CPU:0 21,055,496 | 21,055,500   CPU:1          0 | 21,055,500
      8-bit  stage 0  CPU:0  5,346,130 | 15,875,408   CPU:1  5,346,130 | 15,875,408
      8-bit  stage 1  CPU:0  5,346,130 | 13,202,088   CPU:1          0 | 13,202,088

The 8-bit update (dequantize, Adam, quantize by an 8-step search) is the
larger part of its step, so there stage 1, which halves it, is faster than
stage 0 (0.65x); for 32-bit states it is not.

Stage 1 is 8-9% slower per step here (first run): on two logical devices that share
two cores and one memory, the two replicas' updates already ran in
parallel, and halving each costs a gather of the whole weights (kmp.engine.zero
says which gathers were tried). The flat slots shrink by half; in the first
run Keras's slot variables (the optimizer-state column) stayed whole on
each replica, since then they are held once in host memory (docs/zero.md). The
whole fit() of the larger model varies by several seconds between calls
(11-21 s for the same 30 steps measured apart): its steady ms per step is
the figure to compare.
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
