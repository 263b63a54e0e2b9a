"""P3: how close the optimizer update gets to the memory bandwidth.

Adam must read params, grads and both moments and write params and both
moments: 7 float32 streams, 28 bytes per parameter. For two layouts, 200
variables x 100K (20M float32 parameters) and 2000 x 1K (2M), this measures,
side by side in one process, the time per step of

    copy        the bandwidth reference: ONE XLA computation over four flat
                float32 buffers of the same total size doing p += g; m += g;
                v += g in place: Adam's read set and write set with no
                arithmetic to speak of, and no per-variable cost at all (the
                number a flat-buffer design like DeepSpeed's aims at). XLA
                emits one loop per output, so g is really read three times
                (9 streams); like every row it is counted as 7.
    copy/var    the same three adds per variable, in one XLA computation:
                what updating the model's own separate variables costs before
                any math.
    keras       keras.optimizers.Adam.apply inside tf.function (how fit() runs it)
    keras+xla   the same inside tf.function(jit_compile=True)
    fused       kmp.engine.fused.fused_apply inside tf.function (one XLA computation
                per kmp.engine.fused.GROUP_SIZE variables). XLA emits three loops per
                variable (m, v, then p re-reading the new m and v): 10 streams.

and, without --quick, the two layouts kmp.engine.fused did not choose:

    fused/1     fused_apply with all variables in ONE XLA computation
    flat        Adam on flat buffers: concatenate all params, grads and
                moments in one XLA computation, update, split, assign back

It reports GB/s (28 bytes x parameters / time), the ratio to `copy`, and
the first call (trace + compile). Each method has its own variables. The
gradients are read from variables: inside the XLA computation for copy and
keras+xla, one graph op per variable for the others (in training they come
from the backward pass instead). Rounds interleave the methods so machine
noise (other processes) hits them alike; the table gives the median over
rounds and the spread (min-max).

Without --quick a second table gives the per-variable cost alone: the same
variable counts with 1-element variables.

    python benchmarks/p3_fused_bandwidth.py            # ~11 minutes on 2 cores
    python benchmarks/p3_fused_bandwidth.py --quick    # ~4 minutes

Most of the time is compiling: XLA compile time grows with the number of
variables (the 2000-variable steps take 30 s to 2 minutes each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import common  # noqa: E402,F401  (this checkout's kmp first on sys.path)
from kmp.engine import fused# noqa: E402
from kmp.engine.fused import fused_apply  # noqa: E402

LAYOUTS = [(200, 100_000), (2000, 1_000)]
STREAMS = 7  # read p, g, m, v; write p, m, v
METHODS = ["copy", "copy/var", "keras", "keras+xla", "fused"]
ALTERNATIVES = ["fused/1", "flat"]


def _adam_methods(count, size, grads, alternatives=False):
    """One step function per Adam method, each on its own variables."""
    rng = np.random.default_rng(0)
    init = [rng.normal(size=size).astype("float32") * 0.1 for _ in range(count)]

    def make(apply, jit_compile=False):
        variables = [keras.Variable(x) for x in init]
        opt = keras.optimizers.Adam(1e-3)
        opt.build(variables)
        return tf.function(lambda: apply(opt, [g.read_value() for g in grads], variables), jit_compile=jit_compile)

    def one_group(opt, grads, variables):
        default, fused.GROUP_SIZE = fused.GROUP_SIZE, len(variables)
        try:
            fused_apply(opt, grads, variables)  # traced (and cached) with one group
        finally:
            fused.GROUP_SIZE = default

    keras_apply = lambda opt, g, v: opt.apply(g, v)
    methods = {
        "keras": make(keras_apply),
        "keras+xla": make(keras_apply, jit_compile=True),
        "fused": make(fused_apply),
    }
    if alternatives:
        methods["fused/1"] = make(one_group)
        methods["flat"] = _flat_adam(init, grads)
    return methods


def _flat_adam(init, grads, beta_1=0.9, beta_2=0.999, epsilon=1e-7, lr=1e-3):
    """Keras's Adam math on concatenated buffers, split back into the variables."""
    params = [tf.Variable(x) for x in init]
    moments = [[tf.Variable(tf.zeros_like(x)) for x in init] for _ in range(2)]
    iterations = tf.Variable(0, dtype=tf.int64)
    sizes = [x.size for x in init]

    @tf.function(jit_compile=True)
    def step(grad_values):
        flat = lambda xs: tf.concat([tf.reshape(x, [-1]) for x in xs], 0)
        p, g, m, v = flat(params), flat(grad_values), flat(moments[0]), flat(moments[1])
        t = tf.cast(iterations + 1, tf.float32)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, t)) / (1 - tf.pow(beta_1, t))
        m = m + (g - m) * (1 - beta_1)
        v = v + (tf.square(g) - v) * (1 - beta_2)
        p = p - (m * alpha) / (tf.sqrt(v) + epsilon)
        for variables, value in zip([params, *moments], [p, m, v]):
            for variable, part in zip(variables, tf.split(value, sizes)):
                variable.assign(tf.reshape(part, variable.shape))
        iterations.assign_add(1)

    return tf.function(lambda: step([g.read_value() for g in grads]))


def _copy_methods(count, size, grads):
    flat = [tf.Variable(tf.zeros(count * size)) for _ in range(4)]
    per_var = [[tf.Variable(tf.zeros(size)) for _ in range(count)] for _ in range(3)]

    @tf.function(jit_compile=True)
    def copy():
        p, g, m, v = flat
        g = g.read_value()
        p.assign_add(g)
        m.assign_add(g)
        v.assign_add(g)

    @tf.function(jit_compile=True)
    def copy_per_var(grads):
        for p, m, v, g in zip(*per_var, grads):
            p.assign_add(g)
            m.assign_add(g)
            v.assign_add(g)

    return {"copy": copy, "copy/var": tf.function(lambda: copy_per_var([g.read_value() for g in grads]))}


def _time(functions, rounds, steps):
    """Seconds of the first call (trace and compile), then the median and
    spread of seconds per step over rounds that interleave the methods."""
    first = {}
    for name, f in functions.items():
        start = time.perf_counter()
        f()
        first[name] = time.perf_counter() - start
        f()
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, f in functions.items():
            start = time.perf_counter()
            for _ in range(steps):
                f()
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: (statistics.median(s), min(s), max(s), first[name]) for name, s in samples.items()}


def bandwidth_table(rounds, steps, alternatives, layouts=LAYOUTS):
    methods = METHODS + (ALTERNATIVES if alternatives else [])
    rows = []
    for count, size in layouts:
        grads = [tf.Variable(np.random.default_rng(i).normal(size=size).astype("float32")) for i in range(count)]
        functions = {**_copy_methods(count, size, grads), **_adam_methods(count, size, grads, alternatives)}
        timings = _time({m: functions[m] for m in methods}, rounds, steps)
        nbytes = STREAMS * 4 * count * size
        reference = timings["copy"][0]
        for method in methods:
            median, low, high, first = timings[method]
            rows.append((f"{count} x {size // 1000}K", method, median, low, high, nbytes / median / 1e9,
                         reference / median, first))
        del functions, grads
    print(f"\nAdam update, float32, {STREAMS} streams x 4 bytes per parameter; median over rounds (min-max);")
    print("first call = trace + compile\n")
    print(f"{'layout':>12} {'method':>10} {'ms/step':>9} {'min-max ms':>17} {'GB/s':>7} {'vs copy':>8} {'first call':>11}")
    for layout, method, median, low, high, gbs, ratio, first in rows:
        print(f"{layout:>12} {method:>10} {median * 1e3:9.2f} {low * 1e3:8.2f}-{high * 1e3:<8.2f} {gbs:7.1f} "
              f"{ratio:8.0%} {first:10.1f}s")
    return rows


def overhead_table(rounds):
    """The same variable counts with 1-element variables: no bytes, only per-variable cost."""
    print("\nWhat limits the step: per-variable cost (same counts, 1-element variables)\n")
    print(f"{'variables':>10} {'method':>10} {'ms/step':>9} {'us/variable':>12} {'min-max ms':>17}")
    for count, _ in LAYOUTS:
        grads = [tf.Variable(tf.ones(1)) for _ in range(count)]
        methods = _adam_methods(count, 1, grads)
        timings = _time({m: methods[m] for m in ("keras", "fused")}, rounds, 10)
        for method, (median, low, high, _) in timings.items():
            print(f"{count:>10} {method:>10} {median * 1e3:9.2f} {median / count * 1e6:12.2f} "
                  f"{low * 1e3:8.2f}-{high * 1e3:<8.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds; no alternative layouts, no per-variable cost table")
    parser.add_argument("--bandwidth-only", action="store_true",
                        help=f"only the {LAYOUTS[0][0]} x {LAYOUTS[0][1] // 1000}K layout, the bandwidth-bound one "
                             f"(the {LAYOUTS[1][0]}-variable one compiles for minutes)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 9
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs; "
          f"rounds={rounds}, GROUP_SIZE={fused.GROUP_SIZE}")
    bandwidth_table(rounds, 3 if args.quick else 10, alternatives=not args.quick,
                    layouts=LAYOUTS[:1] if args.bandwidth_only else LAYOUTS)
    if not args.quick:
        overhead_table(rounds)


if __name__ == "__main__":
    main()
