"""P1's flat-buffer step part by part, beside one device's: where the step above the one-device floor goes.

P1 (40 x Dense(256), batch 64, Adam) at one precision, three models in one
process, each prepared with `wall_clock_breakdown` (kmp.engine.wall_clock:
data wait, forward+backward, all-reduce, loss scaling and checks, the
update, the rest):

- kmp's flat buffers under MirroredStrategy on two logical CPUs (what
  `kmp.prepare` picks), each replica half of the batch;
- the same model on one device, the whole batch (its forward/backward and
  update compiled apart, so the parts can be stamped);
- stock Keras on one device with whole-step XLA: the floor, one number;
- and, on a flat float32 tensor of the model's parameter count, alone:
  MirroredStrategy's all-reduce between the two logical CPUs, Adam's
  update written plainly with XLA on one device (read the gradient and
  three buffers, write three), and a copy of the tensor with XLA (the
  memory's bandwidth: the floor of any pass over the buffers). kmp's own
  all-reduce and update are below the first two.

Each model takes `--windows` fit() calls of `--steps` steps, in rotation; a
part's figure is the median over the windows of its mean per step.

    python benchmarks/p1_flat_parts.py [--policy float32] [--windows 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

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
    parameters = sum(math.prod(v.shape) for v in models["one device, flat buffers"].trainable_weights)
    floors = _part_floors(mirrored, parameters)
    parts = {name: {p: [] for p in PARTS} for name in models}
    floor_ms = {name: [] for name in floors}
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
        for name, run in floors.items():
            floor_ms[name].append(_ms_per_call(run, args.steps))
    floor = statistics.median(parts[list(models)[-1]]["total"])
    print(f"P1, {args.policy}: ms per step, median of {args.windows} windows of {args.steps} steps "
          "(the floor's: its whole fit() over its steps)")
    print(f"{'':52s}" + "".join(f"{p:>11s}" for p in PARTS) + "   vs floor")
    for name, values in parts.items():
        cells = "".join(f"{statistics.median(v):11.2f}" if v else f"{'':11s}" for v in values.values())
        print(f"{name:52s}{cells}   {statistics.median(values['total']) / floor:.2f}x")
    for name, values in floor_ms.items():
        print(f"{name:52s} {statistics.median(values):.2f} ms ({min(values):.2f}-{max(values):.2f})")


def _part_floors(mirrored, parameters: int) -> dict:
    """name -> a function running one part alone on `parameters` float32 elements, its result read back."""
    import tensorflow as tf

    flat = lambda seed: tf.random.stateless_normal([parameters], seed=[seed, 0])
    shares = mirrored.experimental_distribute_values_from_function(lambda ctx: flat(ctx.replica_id_in_sync_group))

    @tf.function
    def all_reduce(values):
        summed = mirrored.run(lambda v: tf.distribute.get_replica_context().all_reduce("sum", v), args=(values,))
        return mirrored.experimental_local_results(summed)[0][0]

    with tf.device("/cpu:0"):
        weights, first, second, copied = (tf.Variable(flat(k)) for k in range(4))
        gradient = flat(9)

    @tf.function(jit_compile=True)
    def update(g):
        m, v = 0.9 * first + 0.1 * g, 0.999 * second + 0.001 * g * g
        first.assign(m)
        second.assign(v)
        weights.assign_sub(1e-4 * m / (tf.sqrt(v) + 1e-7))
        return weights[0]

    @tf.function(jit_compile=True)
    def copy(g):
        copied.assign(g)
        return copied[0]

    return {f"alone: MirroredStrategy's all-reduce of {parameters:,} float32": lambda: all_reduce(shares),
            "alone: Adam's update on them written plainly, XLA": lambda: update(gradient),
            "floor: a copy of them, one device, XLA": lambda: copy(gradient)}


def _ms_per_call(run, calls: int) -> float:
    float(run())  # warm
    start = time.perf_counter()
    for _ in range(calls):
        out = run()
    float(out)
    return (time.perf_counter() - start) * 1000 / calls


if __name__ == "__main__":
    main()
