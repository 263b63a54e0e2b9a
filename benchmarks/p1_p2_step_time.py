"""P1 and P2 (ms per training step): time of kmp vs stock Keras, side by side.

P1 (target <= 0.30x): the issues' MLP (40 x Dense(256), batch 64, Adam) in
mixed_float16 under MirroredStrategy on two logical CPU devices: `fit()` with
kmp vs `fit()` with Keras's own LossScaleOptimizer. kmp rows: prepared
(`kmp.prepare(model)`: XLA per replica, fused update, the default), and its
parts switched off one at a time. Reference rows: float32 under the
strategy, and one device (Keras with and without whole-step XLA).

P2 (target <= 1.05x): kmp's dynamic loss scaling vs a static scale, on the
same step, on one device and under the strategy.

P1's targets (`--targets`: only the rows they compare, no P2):
kmp prepared under the strategy <= 1.15x stock Keras on ONE device with
whole-step XLA (same global batch), and <= 0.45x stock Keras under the
strategy. kmp is measured prepared per variable (`flat_buffers=False`) and
with the flat-buffer engine (`flat_buffers=True`, kmp.engine.engine), at ZeRO
stage 0 and 1 (kmp.engine.zero); besides ms per step, it prints each row's whole
fit() seconds and its first fit(). `--targets` also times float32: kmp's flat
buffers under the strategy against one device with whole-step XLA.

    python benchmarks/p1_p2_step_time.py [--rounds 5] [--steps 30]
    python benchmarks/p1_p2_step_time.py --targets [--rounds 3] [--steps 15]

Run it on a quiet machine: it reports medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import fit_times, interleaved, mlp, regression_data, report, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--targets", action="store_true", help="only the rows the targets compare; no P2")
    args = parser.parse_args()

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    from kmp.engine.engine import engine_of  # a module kmp loads only once a model is prepared

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    default = tf.distribute.get_strategy()
    x, y = regression_data(args.batch, args.steps)

    class Row:
        """A compiled, traced model; calling it times one fit() (ms per step) and keeps the whole call's seconds."""

        def __init__(self, model):
            self.model, self.seconds, self.first = model, [], None

        def __call__(self):
            ms, seconds = fit_times(self.model, x, y, args.batch)
            self.seconds.append(seconds)
            return ms

    def compiled(strategy, policy, make_optimizer, prepare=None, jit_compile="auto", flat_buffers=False):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp()
            model.compile(optimizer=make_optimizer(), loss="mse", jit_compile=jit_compile)
        if prepare is not None:
            kmp.prepare(model, jit_compile=prepare, flat_buffers=flat_buffers)
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)  # trace
        keras.config.set_dtype_policy("float32")
        if flat_buffers and engine_of(model) is None:
            raise RuntimeError("kmp.prepare(flat_buffers=True) built no flat-buffer engine")
        return Row(model)

    adam = lambda: keras.optimizers.Adam(1e-4)
    keras_lso = lambda: keras.optimizers.LossScaleOptimizer(adam())
    kmp_dynamic = lambda: kmp.LossScaleOptimizer(adam(), log_overflows=False)
    kmp_unfused = lambda: kmp.LossScaleOptimizer(adam(), log_overflows=False, fused=False)
    kmp_static = lambda: kmp.LossScaleOptimizer(adam(), static_scale=2.0**12, log_overflows=False)
    kmp_stage_1 = lambda: kmp.LossScaleOptimizer(adam(), log_overflows=False, zero_stage=1)
    kmp_wrapped = lambda: kmp.wrap(adam())  # what a user writes; at float32 no loss scaling

    p1 = {  # built lazily: --targets builds five
        "Mirrored, mixed_float16, Keras LSO (stock)": lambda: compiled(mirrored, "mixed_float16", keras_lso),
        "Mirrored, mixed_float16, kmp prepared": lambda: compiled(mirrored, "mixed_float16", kmp_dynamic, "auto"),
        "Mirrored, mixed_float16, kmp prepared, flat buffers":
            lambda: compiled(mirrored, "mixed_float16", kmp_dynamic, "auto", flat_buffers=True),
        "Mirrored, mixed_float16, kmp prepared, flat buffers, ZeRO stage 1":
            lambda: compiled(mirrored, "mixed_float16", kmp_stage_1, "auto", flat_buffers=True),
        "  same, unfused update": lambda: compiled(mirrored, "mixed_float16", kmp_unfused, "auto"),
        "  same, no XLA (prepare(jit_compile=False))":
            lambda: compiled(mirrored, "mixed_float16", kmp_dynamic, False),
        "Mirrored, float32, Keras Adam (stock)": lambda: compiled(mirrored, "float32", adam),
        "Mirrored, float32, kmp prepared, flat buffers":
            lambda: compiled(mirrored, "float32", kmp_wrapped, "auto", flat_buffers=True),
        "one device, float32, Keras Adam + XLA": lambda: compiled(default, "float32", adam, None, True),
        "one device, mixed_float16, Keras LSO": lambda: compiled(default, "mixed_float16", keras_lso),
        "one device, mixed_float16, Keras LSO + XLA":
            lambda: compiled(default, "mixed_float16", keras_lso, None, True),
        "one device, mixed_float16, kmp": lambda: compiled(default, "mixed_float16", kmp_dynamic),
    }
    stock, prepared, one_xla = ("Mirrored, mixed_float16, Keras LSO (stock)", "Mirrored, mixed_float16, kmp prepared",
                                "one device, mixed_float16, Keras LSO + XLA")
    flat = "Mirrored, mixed_float16, kmp prepared, flat buffers"
    stage_1 = "Mirrored, mixed_float16, kmp prepared, flat buffers, ZeRO stage 1"
    stock_32, flat_32, one_xla_32 = ("Mirrored, float32, Keras Adam (stock)",
                                     "Mirrored, float32, kmp prepared, flat buffers",
                                     "one device, float32, Keras Adam + XLA")

    def built(names):
        rows = {}
        for name in names:
            start = time.perf_counter()
            rows[name] = p1[name]()
            rows[name].first = time.perf_counter() - start
            print(f"{name}: build + first fit() (trace, compile, 2 steps) {rows[name].first:.1f} s")
        return rows

    if args.targets:
        rows = built([stock, prepared, flat, stage_1, one_xla, stock_32, flat_32, one_xla_32])
        times = interleaved(rows, args.rounds)
        fp16 = {name: times[name] for name in (stock, prepared, flat, stage_1, one_xla)}
        fp32 = {name: times[name] for name in (stock_32, flat_32, one_xla_32)}
        report("P1: vs one device with whole-step XLA (target for kmp <= 1.15x)", fp16, one_xla)
        report("P1: vs stock Keras under Mirrored (target for kmp <= 0.45x)", fp16, stock)
        report("P1 at float32: vs one device with whole-step XLA", fp32, one_xla_32)
        print(f"\nWhole fit() of {args.steps} steps: seconds, median (min-max) of the timed calls; "
              f"first: build + the first fit() (trace, compile, 2 steps)")
        for name, row in rows.items():
            timed = row.seconds[-args.rounds:]  # the warm-up round's call is not counted
            print(f"{name:54s} {statistics.median(timed):6.2f} s ({min(timed):.2f}-{max(timed):.2f})  "
                  f"first {row.first:.1f} s")
        # kmp's whole fit() beside its steady step, against the floor; what is not steps is per-call cost.
        for kmp_row, floor in ((flat, one_xla), (flat_32, one_xla_32)):
            whole = [statistics.median(rows[n].seconds[-args.rounds:]) for n in (kmp_row, floor)]
            steady = [statistics.median(times[n]) for n in (kmp_row, floor)]
            print(f"{kmp_row}: whole fit() {whole[0] / whole[1]:.2f}x the floor's, steady step "
                  f"{steady[0] / steady[1]:.2f}x; per call besides the steps: kmp "
                  f"{whole[0] - steady[0] * args.steps / 1000:.2f} s, "
                  f"floor {whole[1] - steady[1] * args.steps / 1000:.2f} s")
        for name in (prepared, flat, stage_1):
            opt = rows[name].model.optimizer
            engine = "flat buffers" if engine_of(rows[name].model) else "per variable"
            print(f"{name}: {engine}; skipped steps {int(opt.skipped_steps.numpy())}, "
                  f"updates {int(opt.inner_optimizer.iterations.numpy())}")
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
