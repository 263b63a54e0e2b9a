"""How closely 8-bit Adam states follow Adam's float32 ones: sqrt(v) rounded stochastically, or to nearest.

The demo's model (digits, 64 -> Dense(256) -> Dense(256) -> Dense(10), float32) trains with Keras's AdamW
(2e-3, batch 32); the same gradients also update two sets of 8-bit states kept beside it
(kmp.scaling.eight_bit.adam_update: sqrt(v) rounded stochastically, as kmp stores it, and to nearest; m to nearest
in both). Every few epochs, for every weight whose float32 step m / (sqrt(v) + eps) is material (over 0.05 in
units of the learning rate), the 8-bit states' step is compared with it: the relative error (median, 90th and 99th
percentile), the share of steps under half the float32 one, and the share of sqrt(v) over 1.5x Adam's. The states
never feed back into training, so the figures are the states' error alone, not two runs drifting apart.

    python benchmarks/eight_bit_fidelity.py [--epochs 30]
"""

from __future__ import annotations

import argparse

import numpy as np
from common import ROOT  # noqa: F401  (this checkout's kmp first)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from kmp.data.datasets import load_digits  # noqa: E402
from kmp.scaling import quantize  # noqa: E402
from kmp.scaling.eight_bit import adam_update  # noqa: E402

BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    (x, y), _ = load_digits(seed=0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(256, activation="relu")(keras.layers.Dense(256, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    optimizer = keras.optimizers.AdamW(2e-3)
    optimizer.build(model.trainable_variables)
    loss = keras.losses.SparseCategoricalCrossentropy()

    def zeros(n):
        blocks = -(-n // quantize.BLOCK_SIZE)
        return [tf.zeros([n], tf.uint8), tf.zeros([blocks]), tf.zeros([n], tf.uint8), tf.zeros([blocks])]

    rounding = {"stochastic": True, "nearest": False}
    states = {name: [zeros(v.shape.num_elements()) for v in model.trainable_variables] for name in rounding}
    steps_per_epoch = -(-len(x) // args.batch)
    print(f"{'step':>5} {'rounding':10} {'material':>8} {'median':>7} {'p90':>6} {'p99':>6} {'< half':>7} "
          f"{'sqrt(v) > 1.5x':>14}")
    for epoch in range(args.epochs):
        for i in range(0, len(x), args.batch):
            with tf.GradientTape() as tape:
                value = loss(y[i:i + args.batch], model(x[i:i + args.batch], training=True))
            grads = tape.gradient(value, model.trainable_variables)
            step = int(optimizer.iterations.numpy()) + 1
            for name, stochastic in rounding.items():
                for k, g in enumerate(grads):
                    _, new = adam_update(tf.reshape(g, [-1]), states[name][k], 1.0, 1 - BETA_1, 1 - BETA_2,
                                         EPSILON, quantize.BLOCK_SIZE, float(step), stochastic)
                    states[name][k] = list(new)
            optimizer.apply(grads, model.trainable_variables)
        if (epoch + 1) % max(1, args.epochs // 6) == 0 or epoch + 1 == args.epochs:
            for name in rounding:
                _report((epoch + 1) * steps_per_epoch, name, model, optimizer, states[name])


def _report(step, name, model, optimizer, states) -> None:
    errors, under, over, material_count, r_count = [], 0, 0, 0, 0
    for variable, (m_codes, m_scales, r_codes, r_scales) in zip(model.trainable_variables, states):
        index = optimizer._get_variable_index(variable)
        m = np.ravel(optimizer._momentums[index].numpy())
        r = np.sqrt(np.ravel(optimizer._velocities[index].numpy()))
        m8 = quantize.decode(m_codes, m_scales, True).numpy()
        r8 = quantize.decode(r_codes, r_scales, False).numpy()
        exact, eight = m / (r + EPSILON), m8 / (r8 + EPSILON)
        material = np.abs(exact) > 0.05
        errors.append(np.abs(eight - exact)[material] / np.abs(exact)[material])
        under += int(np.sum(np.abs(eight[material]) < 0.5 * np.abs(exact[material])))
        material_count += int(material.sum())
        live = r > 0
        over += int(np.sum(r8[live] > 1.5 * r[live]))
        r_count += int(live.sum())
    e = np.concatenate(errors)
    print(f"{step:5d} {name:10} {material_count:8d} {np.median(e):7.3f} {np.percentile(e, 90):6.3f} "
          f"{np.percentile(e, 99):6.3f} {under / material_count:7.4f} {over / r_count:14.4f}")


if __name__ == "__main__":
    main()
