"""P1 and P2 (ms per training step): time of kmp vs stock Keras, side by side.

P1 (target <= 0.30x): the issues' MLP (40 x Dense(256), batch 64, Adam) in
mixed_float16 under MirroredStrategy on two logical CPU devices: `fit()` with
kmp vs `fit()` with Keras's own LossScaleOptimizer. kmp rows: prepared
(`kmp.prepare(model)`: XLA per replica, fused update, the default), and its
parts switched off one at a time. Reference rows: float32 under the
strategy, and one device (Keras with and without whole-step XLA).

P2 (target <= 1.05x): kmp's dynamic loss scaling vs a static scale, on the
same step, on one device and under the strategy.

Issue 12's P1 targets (`--issue12`: only the three rows they compare, no P2):
kmp prepared under the strategy <= 1.15x stock Keras on ONE device with
whole-step XLA (same global batch), and <= 0.45x stock Keras under the
strategy.

    python benchmarks/p1_p2_step_time.py [--rounds 5] [--steps 30]
    python benchmarks/p1_p2_step_time.py --issue12 [--rounds 3] [--steps 15]

Run it on a quiet machine: it reports medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import time

from common import fit_ms_per_step, interleaved, mlp, regression_data, report, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--issue12", action="store_true", help="only the rows issue 12 compares; no P2")
    args = parser.parse_args()

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    default = tf.distribute.get_strategy()
    x, y = regression_data(args.batch, args.steps)

    def compiled(strategy, policy, make_optimizer, prepare=None, jit_compile="auto"):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp()
            model.compile(optimizer=make_optimizer(), loss="mse", jit_compile=jit_compile)
        if prepare is not None:
            kmp.prepare(model, jit_compile=prepare)
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)  # trace
        keras.config.set_dtype_policy("float32")
        return lambda: fit_ms_per_step(model, x, y, args.batch)

    adam = lambda: keras.optimizers.Adam(1e-4)
    keras_lso = lambda: keras.optimizers.LossScaleOptimizer(adam())
    kmp_dynamic = lambda: kmp.LossScaleOptimizer(adam(), log_overflows=False)
    kmp_unfused = lambda: kmp.LossScaleOptimizer(adam(), log_overflows=False, fused=False)
    kmp_static = lambda: kmp.LossScaleOptimizer(adam(), static_scale=2.0**12, log_overflows=False)

    p1 = {  # built lazily: --issue12 builds three
        "Mirrored, mixed_float16, Keras LSO (stock)": lambda: compiled(mirrored, "mixed_float16", keras_lso),
        "Mirrored, mixed_float16, kmp prepared": lambda: compiled(mirrored, "mixed_float16", kmp_dynamic, "auto"),
        "  same, unfused update": lambda: compiled(mirrored, "mixed_float16", kmp_unfused, "auto"),
        "  same, no XLA (prepare(jit_compile=False))":
            lambda: compiled(mirrored, "mixed_float16", kmp_dynamic, False),
        "Mirrored, float32, Keras Adam (stock)": lambda: compiled(mirrored, "float32", adam),
        "one device, mixed_float16, Keras LSO": lambda: compiled(default, "mixed_float16", keras_lso),
        "one device, mixed_float16, Keras LSO + XLA":
            lambda: compiled(default, "mixed_float16", keras_lso, None, True),
        "one device, mixed_float16, kmp": lambda: compiled(default, "mixed_float16", kmp_dynamic),
    }
    stock, prepared, one_xla = ("Mirrored, mixed_float16, Keras LSO (stock)", "Mirrored, mixed_float16, kmp prepared",
                                "one device, mixed_float16, Keras LSO + XLA")

    def built(names):
        measures = {}
        for name in names:
            start = time.perf_counter()
            measures[name] = p1[name]()
            print(f"{name}: build + first fit() (trace, compile, 2 steps) {time.perf_counter() - start:.1f} s")
        return measures

    if args.issue12:
        times = interleaved(built([stock, prepared, one_xla]), args.rounds)
        report("Issue 12, P1: kmp prepared vs one device with whole-step XLA (target <= 1.15x)", times, one_xla)
        report("Issue 12, P1: kmp prepared vs stock Keras under Mirrored (target <= 0.45x)", times, stock)
        return
    report("P1: step time (target: kmp <= 0.30x stock under Mirrored)",
           interleaved(built(p1), args.rounds), baseline=stock)

    p2 = {
        "one device, kmp static scale": compiled(default, "mixed_float16", kmp_static),
        "one device, kmp dynamic scale": compiled(default, "mixed_float16", kmp_dynamic),
        "Mirrored, kmp static scale": compiled(mirrored, "mixed_float16", kmp_static, "auto"),
        "Mirrored, kmp dynamic scale": compiled(mirrored, "mixed_float16", kmp_dynamic, "auto"),
    }
    times = interleaved(p2, args.rounds)
    report("P2: dynamic vs static scale, one device (target <= 1.05x)",
           {k: v for k, v in times.items() if k.startswith("one")}, baseline="one device, kmp static scale")
    report("P2: dynamic vs static scale, Mirrored (target <= 1.05x)",
           {k: v for k, v in times.items() if k.startswith("Mirrored")}, baseline="Mirrored, kmp static scale")


if __name__ == "__main__":
    main()
