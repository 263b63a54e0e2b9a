"""P1's flat-buffer step part by part, beside one device's: where the step above the one-device floor goes.

P1 (40 x Dense(256), batch 64, Adam) at one precision, three models in one
process, each prepared with `wall_clock_breakdown` (kmp.engine.wall_clock:
data wait, forward+backward, all-reduce, loss scaling and checks, the
update, the rest):

- kmp's flat buffers under MirroredStrategy on two logical CPUs (what
  `kmp.prepare` picks), each replica half of the batch;
- the same model on one device, the whole batch (its forward/backward and
  update compiled apart, so the parts can be stamped);
- stock Keras on one device with whole-step XLA: the floor, one number.

Each model takes `--windows` fit() calls of `--steps` steps, in rotation; a
part's figure is the median over the windows of its mean per step.

    python benchmarks/p1_flat_parts.py [--policy float32] [--windows 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics

from common import mlp, regression_data, use_two_logical_cpus

PARTS = ("data_wait", "fwd_bwd", "allreduce", "loss_scale", "step", "other", "total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    x, y = regression_data(64, args.steps, 256)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def build(strategy, kind):
        keras.config.set_dtype_policy(args.policy)
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy else keras.name_scope("one"):
            model = mlp(40, 256)
            optimizer = keras.optimizers.Adam(1e-4)
            if kind != "floor":  # kmp's optimizer, which the flat buffers train (kmp.wrap: where it is needed)
                optimizer = kmp.LossScaleOptimizer(optimizer, static_scale=1)
            model.compile(optimizer=optimizer, loss="mse", jit_compile=kind == "floor")
        if kind != "floor":
            kmp.prepare(model, wall_clock_breakdown=args.steps)
        model.fit(x[:128], y[:128], batch_size=64, verbose=0)  # trace, compile
        return model

    models = {"two logical CPUs, flat buffers": build(mirrored, "kmp"),
              "one device, flat buffers": build(None, "kmp"),
              "one device, stock Keras whole-step XLA (the floor)": build(None, "floor")}
    keras.config.set_dtype_policy("float32")
    parts = {name: {p: [] for p in PARTS} for name in models}
    for _ in range(args.windows):
        for name, model in models.items():
            if "floor" in name:
                start = tf.timestamp()
                model.fit(x, y, batch_size=64, verbose=0)
                parts[name]["total"].append(float(tf.timestamp() - start) * 1000 / args.steps)
                continue
            logs = model.fit(x, y, batch_size=64, verbose=0).history
            for p in PARTS:
                parts[name][p].append(logs[f"wall_clock/{p}_ms"][-1])
    floor = statistics.median(parts[list(models)[-1]]["total"])
    print(f"P1, {args.policy}: ms per step, median of {args.windows} windows of {args.steps} steps "
          "(the floor's: its whole fit() over its steps)")
    print(f"{'':52s}" + "".join(f"{p:>11s}" for p in PARTS) + "   vs floor")
    for name, values in parts.items():
        cells = "".join(f"{statistics.median(v):11.2f}" if v else f"{'':11s}" for v in values.values())
        print(f"{name:52s}{cells}   {statistics.median(values['total']) / floor:.2f}x")


if __name__ == "__main__":
    main()
