"""Why the flat engine's Adam update runs slower than a plain XLA Adam of the same buffers.

The flat engine's update (kmp.engine.buffers, `FlatBuffers.update`) of the issues'
MLP (2.6M parameters, one device) against plain Adam written directly as
one XLA function over the same three buffers, side by side:

- plain Adam, its learning rate a Python constant (compiled in);
- the same with the learning rate a runtime scalar argument;
- the same with an unused scalar argument;
- kmp's update (learning rate and step count at run time, as a schedule needs);
- a flat copy of the weights (the bandwidth limit).

Found before the fix (figures: benchmarks/RESULTS.md, "The flat update's learning rate"): the optimized
HLO of the first two is the same three loop fusions, yet the runtime scalar
in the weights' fusion costs about 1.5 ms on 2.6M elements (2.0 -> 3.5 ms);
the unused argument costs nothing. The cause: XLA:CPU (TensorFlow 2.21)
emits that fusion as a scalar loop, not <8 x float> vectors, when the
length is not a multiple of 8 (the engine's 2,631,937 is odd) and a runtime
scalar is in it (its optimized LLVM IR: scalar fdiv and sqrt against
vector ones). The same Adam on a length that is a multiple of 8 runs at the
constant's speed, and kmp.engine.buffers now pads its buffers to whole units of 16
elements (kmp.memory.estimate.ALIGN): its row here then matches.

    python benchmarks/p7_update_scalars.py [--rounds 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

from common import interleaved, mlp, regression_data, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import kmp
    from kmp.engine import engine

    keras.config.set_dtype_policy("mixed_float16")
    model = mlp()
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-4), log_overflows=False), loss="mse")
    kmp.prepare(model, flat_buffers=True)
    x, y = regression_data(64, 2)
    model.fit(x, y, batch_size=64, verbose=0)
    buffers = engine.engine_of(model).buffers
    w, m, v = buffers.local("weights"), *(buffers.local(n) for n in buffers.slot_names)
    grad = tf.random.normal([buffers.length]) * 1e-3
    lr = tf.constant(1e-4)

    def adam(g, learning_rate):
        m.assign(0.9 * m + 0.1 * g)
        v.assign(0.999 * v + 0.001 * g * g)
        w.assign_sub(learning_rate * m / (tf.sqrt(v) + 1e-7))

    # The same Adam on buffers whose length is a multiple of 8 (the engine's, less 1 to 7 elements).
    n8 = buffers.size // 8 * 8
    w8, m8, v8 = (tf.Variable(tf.zeros([n8]) + 0.5) for _ in range(3))

    def adam8(g, learning_rate):
        m8.assign(0.9 * m8 + 0.1 * g[:n8])
        v8.assign(0.999 * v8 + 0.001 * g[:n8] * g[:n8])
        w8.assign_sub(learning_rate * m8 / (tf.sqrt(v8) + 1e-7))

    aligned = tf.function(adam8, jit_compile=True)
    constant = tf.function(lambda g: adam(g, 1e-4), jit_compile=True)
    runtime = tf.function(adam, jit_compile=True)
    unused = tf.function(lambda g, learning_rate: adam(g, 1e-4), jit_compile=True)
    flat = buffers._compiled_update()
    copy = tf.function(lambda g: w.assign(g[:buffers.size]), jit_compile=True)
    calls = {
        "plain Adam, constant learning rate": lambda: constant(grad),
        "plain Adam, runtime learning rate": lambda: runtime(grad, lr),
        "plain Adam, an unused runtime scalar": lambda: unused(grad, lr),
        "plain Adam, runtime learning rate, length % 8 == 0": lambda: aligned(grad, lr),
        "kmp's flat update": lambda: flat(grad, lr),
        "flat copy of the weights": lambda: copy(grad),
    }

    def timed(call):
        def measure():
            call()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            w.read_value().numpy()  # wait for the last one
            return (time.perf_counter() - start) / args.calls * 1e3
        return measure

    times = interleaved({name: timed(call) for name, call in calls.items()}, args.rounds)
    report(f"Adam's update of {buffers.size:,} float32 parameters, one device (ms per call)", times,
           "plain Adam, constant learning rate")


if __name__ == "__main__":
    main()
