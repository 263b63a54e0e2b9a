"""P5: a model of >= 1000 small variables, mixed_float16, one device.

The "many small variables" model: `blocks` Dense(width) + LayerNormalization
blocks (4 variables each, so 250 blocks are 1004 variables with the final
LayerNormalization and the head; width 64 unless --width, also the input's), a float32 Dense(1) head, Adam, mse,
batch 64, on one device (no strategy), with the mixed_float16 policy; the blocks are either

    stacked      x = x + Dense(width, relu)(LayerNormalization(x)), `blocks` times
                 (pre-norm residual: a plain stack of Dense(relu) ->
                 LayerNormalization overflowed float16 gradients at every
                 loss scale down to 1 from 100 blocks on)
    parallel     sum over `blocks` branches of LayerNormalization(Dense(width, relu)(x))

The note under each row gives the loss-scale optimizer's applied updates
(and kmp's skipped steps): a skipped step does no update, so rows with
many skips would be timed short. Rows:

    keras        stock Keras, compile(jit_compile=False) (Keras wraps Adam in its
                 LossScaleOptimizer; "auto" is the same on a CPU-only machine)
    keras+xla    stock Keras, compile(jit_compile=True): the whole step in one
                 XLA computation
    kmp          kmp.wrap(Adam) + kmp.prepare(model), as today: kmp's
                 LossScaleOptimizer with its fused update (one XLA computation
                 per 256 variables); on one device the rest of the step is
                 Keras's, without XLA
    kmp+xla      the same with kmp.prepare(model, jit_compile=True): Keras's
                 whole-step XLA around kmp's optimizer
    kmp flat     kmp.prepare(model, flat_buffers=True): the flat-buffer engine
                 (kmp.engine): the forward/backward in one XLA computation on
                 the flat float32 weights (without XLA where its trace predicts
                 minutes of compile: kmp.engine.xla_choice), one flat gradient,
                 one overflow check, one XLA update of the flat weights and
                 Adam's moments

Each row is its own worker process (benchmarks/isolated.py), built alone
under a wall-clock limit (--xla-limit for the +xla rows, default 300 s;
--build-limit for the others) and a memory limit (--rss-limit, default 16
GiB; and 2 GiB left on the machine); a row past either is killed and
reported as "did not finish". The `keras` row (the baseline) stays alive;
each other row is timed in rounds interleaved with it, then ended. Reported: ms per step
(fit() in steady state, common.fit_ms_per_step), median over rounds
(min-max), the ratio to stock Keras without XLA (the target for kmp:
<= 0.5x), and the first fit() call of 2 steps (trace + compile + 2 steps;
the target for the first epoch: <= 60 s).

    python benchmarks/p5_small_variables.py --blocks 25,100,250                  # stacked
    python benchmarks/p5_small_variables.py --layout parallel --blocks 25,100,250
    python benchmarks/p5_small_variables.py --layout parallel --width 8 --blocks 250   # 250 branches of Dense(8)
    [--rounds 3] [--steps 10] [--rows keras,kmp] [--xla-limit 300] [--rss-limit 16]
    python benchmarks/p5_small_variables.py --targets   # 250 stacked blocks: keras, kmp, kmp flat, keras+xla

The +xla rows of 250 blocks are expected to be killed at their limit
(stock Keras with XLA ran 40 minutes and filled 24 GiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import isolated

ROWS = ["keras", "keras+xla", "kmp", "kmp+xla", "kmp flat"]
TARGET_ROWS = ["keras", "kmp", "kmp flat", "keras+xla"]  # the XLA row last: it may hit its limit
WIDTH, BATCH = 64, 64  # WIDTH: the default --width


def build_model(layout: str, blocks: int, width: int = WIDTH):
    import keras

    inputs = keras.Input((width,))
    x = inputs
    if layout == "stacked":
        # Pre-norm residual blocks. A plain stack, Dense(relu) -> LayerNorm,
        # overflowed float16 gradients at every loss scale down to 1 with 100
        # blocks (every step skipped: nothing to time).
        for _ in range(blocks):
            branch = keras.layers.Dense(width, activation="relu")(keras.layers.LayerNormalization()(x))
            x = keras.layers.Add()([x, branch])
    else:
        branches = [keras.layers.LayerNormalization()(keras.layers.Dense(width, activation="relu")(inputs))
                    for _ in range(blocks)]
        x = keras.layers.Add()(branches)
    x = keras.layers.LayerNormalization()(x)  # the head sees unit-scale inputs: a loss of ~1, not ~10^4
    x = keras.layers.Dense(1)(x)
    x = keras.layers.Activation("linear", dtype="float32")(x)
    return keras.Model(inputs, x)


def _build(name, layout, blocks, steps, width):
    import keras

    import kmp

    from kmp.engine.engine import engine_of  # a module kmp loads only once a model is prepared
    from common import fit_ms_per_step, regression_data

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = build_model(layout, blocks, width)
    optimizer = keras.optimizers.Adam(1e-4)
    if name.startswith("kmp"):
        model.compile(optimizer=kmp.wrap(optimizer), loss="mse")
        kmp.prepare(model, jit_compile=True if name.endswith("+xla") else "auto", flat_buffers=name == "kmp flat")
    else:
        model.compile(optimizer=optimizer, loss="mse", jit_compile=name.endswith("+xla"))
    x, y = regression_data(BATCH, steps, width)
    start = time.perf_counter()
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, epochs=1, verbose=0)
    first = time.perf_counter() - start
    engine = engine_of(model)
    if name == "kmp flat" and engine is None:
        raise RuntimeError("kmp flat: kmp.prepare(flat_buffers=True) built no flat-buffer engine")

    def note():
        opt = model.optimizer
        skipped = getattr(opt, "skipped_steps", None)
        path = "flat buffers" if engine is not None else "per variable"
        skipped = ("" if skipped is None else
                   f" ({os.path.dirname(kmp.__file__)}), {path}, skipped steps {int(skipped.numpy())}")
        return (f"{len(model.trainable_variables)} trainable variables; {type(opt).__module__}.{type(opt).__name__}"
                f"{skipped}, inner updates {int(opt.inner_optimizer.iterations.numpy())}")

    return first, lambda: fit_ms_per_step(model, x, y, BATCH), note


def worker(argv):
    parser = argparse.ArgumentParser()
    for flag in ("--worker", "--layout"):
        parser.add_argument(flag)
    parser.add_argument("--blocks", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--width", type=int)
    args = parser.parse_args(argv)
    isolated.serve(lambda: _build(args.worker, args.layout, args.blocks, args.steps, args.width))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["stacked", "parallel"], default="stacked")
    parser.add_argument("--blocks", default="25,100,250")
    parser.add_argument("--width", type=int, default=WIDTH, help="units of each Dense, and the input's width")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--targets", action="store_true",
                        help=f"the targets' comparison: --blocks 250 --rows {','.join(TARGET_ROWS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed fit()")
    parser.add_argument("--xla-limit", type=float, default=300.0, help="seconds for a +xla row's first call")
    parser.add_argument("--build-limit", type=float, default=1200.0, help="seconds for another row's first call")
    parser.add_argument("--rss-limit", type=float, default=16.0, help="GiB per row")
    args = parser.parse_args(argv)
    if args.targets:
        args.blocks, args.rows = "250", ",".join(TARGET_ROWS)
    unknown = [row for row in args.rows.split(",") if row not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    print(f"P5: {args.layout} Dense({args.width}) + LayerNormalization blocks, mixed_float16, batch {BATCH}, one device; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; rounds={args.rounds}, steps={args.steps}")
    for blocks in map(int, args.blocks.split(",")):
        variants = {
            row: isolated.Variant(
                [sys.executable, __file__, "--worker", row, "--layout", args.layout, "--blocks", str(blocks),
                 "--steps", str(args.steps), "--width", str(args.width)],
                args.xla_limit if row.endswith("+xla") else args.build_limit)
            for row in args.rows.split(",")
        }
        start = time.perf_counter()
        print(f"\n{blocks} {args.layout} blocks ({4 * blocks + 4} variables): building each row alone")
        outcomes = isolated.run(variants, args.rounds, resident=["keras"], rss_limit_gib=args.rss_limit)
        isolated.table(f"{blocks} {args.layout} blocks: ms per step, ratio to stock Keras without XLA; "
                       f"{time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.1f}",
                       outcomes, "keras" if "keras" in outcomes else None)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[1:])
    else:
        main()
