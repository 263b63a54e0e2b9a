"""P3 through the path fit() uses: Adam's update per step, driven by `model.fit`.

p3_fused_bandwidth.py times the update alone; the targets ask for it
"measured through the path fit() uses". Here a model holds `count` float32
weight vectors of `size` (200 x 100K: 20M parameters; 2000 x 1K: 2M)
and its forward pass is trivial, so the update dominates the step:

    y = x * sum_i mean(w_i)        # x: one scalar per example, batch 8

Each row is its own worker process (benchmarks/isolated.py: a wall-clock
and a memory limit). The reference rows (copy to fwd/bwd only) stay
alive for the whole run; each Adam row is built alone, then timed in rounds
interleaved with them, then ended (a traced fit() step of 2000 variables
holds 4-7 GiB: two of them at once do not fit beside other work on a 24 GiB
machine). So every "share of copy" is measured side by side; the reference
rows have more samples (all phases).

    copy          the limit: p3's `copy`, ONE XLA computation over four flat
                  float32 buffers doing p += g; m += g; v += g (Adam's read
                  and write set, no per-variable cost), ms per call
    copy/var      the same adds per variable, in one XLA computation
    fit floor     fit() of a model with one 1-element weight: fit's own cost
                  per step (iterator, step launch, logs), with no work
    fwd/bwd only  the model above with a train step that computes every
                  gradient and does not update (each gradient's first
                  element is summed into a variable, so none is pruned);
                  no XLA. Step time minus this row ~ the update's cost
    keras         stock Keras Adam, compile(jit_compile=False) (the default
                  on a CPU-only machine: "auto" turns XLA off there)
    keras+xla     stock Keras Adam, compile(jit_compile=True): the whole step
                  in one XLA computation
    kmp           kmp.wrap(Adam, precision="mixed_float16") + kmp.prepare,
                  as today: kmp.LossScaleOptimizer with its fused update
                  (kmp.engine.fused, one XLA computation per 256 variables); the
                  rest of the step is Keras's, without XLA. In float32 on one
                  device kmp.wrap returns the plain Adam (= the keras row),
                  so mixed precision is what kmp's own update runs under.
                  The weights stay float32 (the model computes in float32,
                  so no step overflows; the note counts skipped steps)
    kmp+xla       the same, compile(jit_compile=True): Keras's whole-step XLA
                  around kmp's optimizer
    kmp flat      the kmp row with kmp.prepare(model, flat_buffers=True): the
                  flat-buffer engine (kmp.engine): one XLA forward/backward on
                  the flat weights, one flat gradient, one XLA update of the
                  flat weights and Adam's flat moments
    kmp flat update
                  that engine's update alone, as its step calls it:
                  `optimizer.apply_flat(grad, buffers)` in a tf.function on a
                  fixed gradient (the step without the forward/backward, loss
                  tracker and logs); the engine is built as fit() builds it,
                  without a forward pass, so its first call is the trace and
                  compile of the update alone. The note adds the engine's
                  build time and the XLA update alone (FlatBuffers.update)

Reported per row: ms per step (fit rows: from the end of the first step to
the end of the last, as common.fit_ms_per_step), median over rounds
(min-max), the share of the copy limit (copy ms / row ms: 100% would be
"as fast as copying the bytes once"), and the first call: for fit rows the
first fit() of 2 steps (trace + compile + 2 steps), for copy rows and `kmp
flat update` the first call (trace + compile).

    python benchmarks/p3_fit_path.py --quick   # 3 rounds of 8 steps: ~10-15 minutes on 2 cores
    python benchmarks/p3_fit_path.py           # 7 rounds of 20 steps: ~20-25 minutes
    python benchmarks/p3_fit_path.py --targets --quick   # the targets' rows (copy, references, keras,
                                                         # kmp per variable, kmp flat): ~5 minutes

Most of the time is the first calls of the 2000-variable rows (XLA
compiles), each alone while the others wait.
"""

from __future__ import annotations

import argparse
import sys
import time

import isolated

LAYOUTS = [(200, 100_000), (2000, 1_000)]
ROWS = ["copy", "copy/var", "fit floor", "fwd/bwd only", "keras", "keras+xla", "kmp", "kmp+xla", "kmp flat",
        "kmp flat update"]
TARGET_ROWS = ["copy", "fit floor", "fwd/bwd only", "keras", "kmp", "kmp flat", "kmp flat update"]
REFERENCES = ROWS[:4]  # kept alive for the whole run; each Adam row is timed interleaved with them
BATCH = 8


def _build_copy(name, count, size, steps):
    import tensorflow as tf
    from p3_fused_bandwidth import _copy_methods

    grads = [tf.Variable(tf.fill([size], 1e-3)) for _ in range(count)]
    function = _copy_methods(count, size, grads)[name]
    start = time.perf_counter()
    function()
    first = time.perf_counter() - start

    def measure():
        start = time.perf_counter()
        for _ in range(steps):
            function()
        return (time.perf_counter() - start) * 1000 / steps

    return first, measure, lambda: ""


def _model_classes():
    import keras
    import tensorflow as tf

    class Weights(keras.Model):
        """`count` float32 weight vectors and a trivial forward pass: y = x * sum_i mean(w_i).

        Keras's own train_step (not overridden): kmp swaps only that one
        for its prepared and flat-buffer steps.
        """

        def __init__(self, count, size):
            super().__init__(dtype="float32")
            self.ws = [self.add_weight(shape=(size,), initializer="random_normal", name=f"w{i}")
                       for i in range(count)]

        def call(self, x):
            return x * tf.add_n([tf.reduce_mean(w) for w in self.ws])

    class GradientsOnly(Weights):
        """The same model; its step computes every gradient and updates nothing."""

        def __init__(self, count, size):
            super().__init__(count, size)
            self.sink = self.add_weight(shape=(), initializer="zeros", trainable=False, name="sink")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.sink.assign(tf.add_n([g[0] for g in grads]))  # consumed: every gradient is computed
            return {"loss": loss}

    return Weights, GradientsOnly


def _build_fit(name, count, size, steps):
    import os

    import keras
    import numpy as np

    import kmp

    from kmp.engine.engine import engine_of  # a module kmp loads only once a model is prepared
    from common import fit_ms_per_step

    keras.utils.set_random_seed(0)
    if name == "fit floor":
        count, size = 1, 1
    weights, gradients_only = _model_classes()
    model = (gradients_only if name == "fwd/bwd only" else weights)(count, size)
    optimizer = keras.optimizers.Adam(1e-3)
    if name.startswith("kmp"):
        optimizer = kmp.wrap(optimizer, precision="mixed_float16")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=name.endswith("+xla"))
    if name.startswith("kmp"):
        kmp.prepare(model, flat_buffers=name.startswith("kmp flat"))
    if name == "kmp flat update":
        first, measure, extra = _flat_update(model, steps)
        engine = engine_of(model)
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCH * steps, 1)).astype("float32")
        y = np.zeros((BATCH * steps, 1), "float32")
        start = time.perf_counter()
        model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, epochs=1, verbose=0)
        first = time.perf_counter() - start
        engine = engine_of(model)
        measure, extra = (lambda: fit_ms_per_step(model, x, y, BATCH)), ""
    if name.startswith("kmp flat") and engine is None:
        raise RuntimeError(f"{name}: kmp.prepare(flat_buffers=True) built no flat-buffer engine")

    def note():
        opt = model.optimizer
        if isinstance(opt, kmp.LossScaleOptimizer):
            path = "flat buffers" if engine is not None else f"per variable, fused={opt.fused}"
            return (f"{type(opt).__module__}.{type(opt).__name__} ({os.path.dirname(kmp.__file__)}), {path}; "
                    f"skipped steps {int(opt.skipped_steps.numpy())}, "
                    f"updates {int(opt.inner_optimizer.iterations.numpy())}{extra and '; ' + extra()}")
        return f"{type(opt).__module__}.{type(opt).__name__}, {int(opt.iterations.numpy())} updates"

    return first, measure, note


def _flat_update(model, steps):
    """The flat engine's update as its step calls it, alone: `optimizer.apply_flat` on a fixed gradient.

    The engine is built as fit() builds it (kmp.engine.prepare._engine_for:
    the optimizer's slots, the buffers, the first copy in), without a
    forward pass; the first call is then the trace and XLA compile of the
    update alone. Left out: the XLA forward/backward that yields the flat
    gradient, the loss tracker, the logs. apply_flat is unscale, the
    all-reduce (none on one device), the finite check, the XLA update of
    weights and slots, and the loss-scale bookkeeping. The note adds the
    engine's build and the XLA update alone (FlatBuffers.update).
    """
    import statistics

    import tensorflow as tf

    from kmp.engine.prepare import _engine_for

    start = time.perf_counter()
    buffers = _engine_for(model).buffers
    built = time.perf_counter() - start
    optimizer = model.optimizer
    grad = tf.fill([buffers.size], 1e-3) * optimizer.dynamic_scale.value
    apply = tf.function(lambda g: optimizer.apply_flat(g, buffers), autograph=False)
    start = time.perf_counter()
    apply(grad)
    tf.convert_to_tensor(optimizer.skipped_steps.value).numpy()
    first = time.perf_counter() - start

    def measure():
        start = time.perf_counter()
        for _ in range(steps):
            apply(grad)
        tf.convert_to_tensor(optimizer.skipped_steps.value).numpy()  # waits for the last step
        return (time.perf_counter() - start) * 1000 / steps

    def note():
        learning_rate = optimizer.inner_optimizer._get_current_learning_rate()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(steps):
                buffers.update(grad, None, learning_rate)
            buffers.local("weights").read_value().numpy()[:1]
            times.append((time.perf_counter() - start) * 1000 / steps)
        return (f"engine built (optimizer slots, buffers, copy in) in {built:.1f} s; first call = trace + compile "
                f"of apply_flat; XLA update alone (FlatBuffers.update) {statistics.median(times):.2f} ms")

    return first, measure, note


def worker(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--count", type=int)
    parser.add_argument("--size", type=int)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args(argv)
    build = _build_copy if args.worker.startswith("copy") else _build_fit
    isolated.serve(lambda: build(args.worker, args.count, args.size, args.steps))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 steps (default: 7 rounds of 20)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    parser.add_argument("--targets", action="store_true", help="the targets' rows: " + ",".join(TARGET_ROWS))
    parser.add_argument("--layouts", default="200x100000,2000x1000")
    parser.add_argument("--build-limit", type=float, default=900.0, help="seconds per row for its first call")
    parser.add_argument("--rss-limit", type=float, default=16.0, help="GiB per row")
    args = parser.parse_args(argv)
    rounds, steps = (3, 8) if args.quick else (7, 20)
    rows = TARGET_ROWS if args.targets else args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    import os
    import platform

    print(f"P3 through fit(): {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; rounds={rounds}, steps={steps}, batch={BATCH}")
    for layout in args.layouts.split(","):
        count, size = map(int, layout.split("x"))
        variants = {
            row: isolated.Variant([sys.executable, __file__, "--worker", row, "--count", str(count),
                                   "--size", str(size), "--steps", str(steps)], args.build_limit)
            for row in rows
        }
        start = time.perf_counter()
        print(f"\n{count} x {size} float32 parameters: building each row alone")
        outcomes = isolated.run(variants, rounds, resident=REFERENCES, rss_limit_gib=args.rss_limit)
        isolated.table(f"{count} x {size}: ms per step, share of the copy limit (copy ms / row ms); "
                       f"{time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.1f}",
                       outcomes, "copy" if "copy" in rows else None, as_share=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[1:])
    else:
        main()
