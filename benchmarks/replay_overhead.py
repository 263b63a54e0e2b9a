"""What overflow="replay" costs on steps that do not overflow.

A replaying step differs from a skipping one by a branch on the (already
all-reduced) overflow flag whose other side is the replay loop
(kmp.scaling.replay), and on one device without the flat buffers by kmp's
step (kmp.engine.replica_step) in place of Keras's, since Keras's cannot
compute a batch's gradients again. Measured side by side: P1's MLP (40 x
Dense(256), batch 64, Adam), prepared, "skip" against "replay", on the
per-variable path and the flat buffers, in float32 (no XLA: the same
kmp.LossScaleOptimizer, its scale dynamic) and mixed_float16 (Keras's
whole-step XLA on one device; XLA per replica under MirroredStrategy on two
logical CPUs); and with 2-step gradient accumulation, where each micro-batch
is also checked (one all-reduce of a flag).

The two models of a pair take single training steps in alternation
(`model.train_function`, the loss read back), so the drift of a shared
machine hits both alike; the median step is reported.

    python benchmarks/replay_overhead.py [--steps 300] [--depth 40 --width 256]
"""

from __future__ import annotations

import argparse
import statistics

from common import alternating_steps, mlp, regression_data, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--only", default="", help="run the groups whose title contains this")
    args = parser.parse_args()

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp
    from kmp.engine import replica_step

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    default = tf.distribute.get_strategy()
    x, y = regression_data(args.batch, 20, args.width)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()

    def variant(strategy, overflow, flat, jit_compile, policy, accumulation):
        keras.config.set_dtype_policy(policy)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = mlp(args.depth, args.width)
            extra = {} if accumulation is None else {"gradient_accumulation_steps": accumulation}
            model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4), overflow=overflow, **extra),
                          loss="mse", jit_compile=jit_compile)
        kmp.prepare(model, flat_buffers=flat)
        model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=args.batch, epochs=1, verbose=0)
        keras.config.set_dtype_policy("float32")
        data = strategy.experimental_distribute_dataset(dataset) if strategy is mirrored else dataset
        return model, iter(data), replica_step.describe_path(model)

    groups = []
    for flat in (False, True):
        path = "flat" if flat else "per-variable"
        groups += [
            (f"one device, float32, no XLA, {path}", default, flat, False, "float32", None),
            (f"one device, mixed_float16, whole-step XLA, {path}", default, flat, True, "mixed_float16", None),
            (f"Mirrored 2 CPUs, mixed_float16, XLA per replica, {path}", mirrored, flat, "auto", "mixed_float16", None),
        ]
    groups += [("one device, mixed_float16, whole-step XLA, flat, accumulation 2", default, True, True,
                "mixed_float16", 2),
               ("Mirrored 2 CPUs, mixed_float16, flat, accumulation 2", mirrored, True, "auto", "mixed_float16", 2)]
    print(f"MLP {args.depth} x Dense({args.width}), batch {args.batch}; median of {args.steps} alternating steps")
    print(f"| {'variant':62s} | skip ms | replay ms | replay/skip |")
    print("| --- | --- | --- | --- |")
    for title, strategy, flat, jit, policy, accumulation in groups:
        if args.only not in title:
            continue
        pair = {o: variant(strategy, o, flat, jit, policy, accumulation) for o in ("skip", "replay")}
        times = alternating_steps(pair, args.steps)
        for model, _, _ in pair.values():
            assert int(model.optimizer.skipped_steps.numpy()) == 0, "an overflow: not a clean-step timing"
        assert int(pair["replay"][0].optimizer.replayed_steps.numpy()) == 0
        skip, replay = statistics.median(times["skip"]), statistics.median(times["replay"])
        print(f"| {title:62s} | {skip:7.2f} | {replay:9.2f} | {replay / skip:11.3f} |", flush=True)
        print(f"|   paths: skip: {pair['skip'][2]}; replay: {pair['replay'][2]}")


if __name__ == "__main__":
    main()
