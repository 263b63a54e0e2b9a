"""Where P1's step time goes: kmp's prepared step under MirroredStrategy, part by part.

Each row adds one part to the one above, timed in one process in
interleaved rounds (ms per step, median), on the issues' MLP (40 x
Dense(256), batch 64, Adam; mixed_float16 unless --precision float32) and two
logical CPU devices, on kmp's per-variable path:

1. forward/backward: each replica's XLA computation (kmp.engine.replica_step)
2. + all-reduce: kmp.distribute.communication's flat float32 bucket
3. + fused update: kmp.engine.fused, without the loss-scale decision
4. + loss scaling: kmp.LossScaleOptimizer.apply (check, cond, state)
5. whole train step: kmp.engine.replica_step.train_step (metrics, loss tracker)

and, for scale, one device with Keras's whole-step XLA (the same MLP and
batch, Keras's own LossScaleOptimizer). fit() adds its own cost per step
on top of row 5 (input pipeline, logs), the same with or without kmp.

    python benchmarks/p1_parts.py [--rounds 5] [--steps 20] [--precision float32]
"""

from __future__ import annotations

import argparse
import time

from common import interleaved, mlp, report, use_two_logical_cpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="mixed_float16", choices=("mixed_float16", "float32"))
    args = parser.parse_args()

    use_two_logical_cpus()
    import keras
    import numpy as np
    import tensorflow as tf

    import kmp
    from kmp.engine import replica_step
    from kmp.distribute.communication import all_reduce_sum
    from kmp.engine.fused import fused_apply

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 256)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    keras.config.set_dtype_policy(args.precision)
    with mirrored.scope():
        keras.utils.set_random_seed(0)
        model = mlp()
        opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4), log_overflows=False)
        model.compile(optimizer=opt, loss="mse")
    kmp.prepare(model)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # builds everything
    data = next(iter(mirrored.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))))

    def forward_backward(batch):
        trainable = model.trainable_variables
        others = model.non_trainable_variables + model.metrics_variables
        values = [tf.convert_to_tensor(v.value) for v in trainable]
        other_values = [tf.convert_to_tensor(v.value) for v in others]
        scale = tf.convert_to_tensor(opt.scale_loss(tf.constant(1.0)))
        grads, _, loss, _ = replica_step._compiled(model)(values, other_values, scale, batch[0], batch[1], None)
        return grads, loss

    def parts(upto):
        def per_replica(batch):
            grads, loss = forward_backward(batch)
            if upto >= 2:
                grads = all_reduce_sum(grads)
            if upto == 3:
                fused_apply(opt.inner_optimizer, grads, model.trainable_variables)
            return loss

        return per_replica

    def apply_with_scaling(batch):
        grads, loss = forward_backward(batch)
        opt.apply(grads, model.trainable_variables)
        return loss

    def timed(per_replica, strategy=mirrored, batch=data):
        step = tf.function(lambda b: strategy.run(per_replica, args=(b,)))

        def measure():
            start = time.perf_counter()
            for _ in range(args.steps):
                out = step(batch)
            strategy.experimental_local_results(tf.nest.flatten(out)[0])[0].numpy()  # wait for it
            return (time.perf_counter() - start) * 1000 / args.steps

        return measure

    keras.config.set_dtype_policy(args.precision)
    one = mlp()
    one_optimizer = keras.optimizers.Adam(1e-4)
    if args.precision == "mixed_float16":
        one_optimizer = keras.optimizers.LossScaleOptimizer(one_optimizer)
    one.compile(optimizer=one_optimizer, loss="mse", jit_compile=True)
    one.fit(x, y, batch_size=64, epochs=1, verbose=0)
    one_step = tf.function(one.train_step, jit_compile=True)

    def one_device():
        start = time.perf_counter()
        for _ in range(args.steps):
            logs = one_step((tf.constant(x), tf.constant(y)))
        float(logs["loss"])
        return (time.perf_counter() - start) * 1000 / args.steps

    variants = {
        "1. forward/backward (XLA per replica)": timed(parts(1)),
        "2. + all-reduce (flat float32)": timed(parts(2)),
        "3. + fused update": timed(parts(3)),
        "4. + loss scaling (LossScaleOptimizer.apply)": timed(apply_with_scaling),
        "5. whole train step (kmp.replica_step)": timed(lambda b: replica_step.train_step(model, b)),
        "one device, Keras whole-step XLA": one_device,
    }
    report(f"Where P1's step time goes (Mirrored, 2 logical CPUs, {args.precision})",
           interleaved(variants, args.rounds), baseline="5. whole train step (kmp.replica_step)")


if __name__ == "__main__":
    main()
