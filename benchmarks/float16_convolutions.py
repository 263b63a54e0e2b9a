"""A conv net's step on the CPU in each precision, with TensorFlow's oneDNN kernels on and off.

    python benchmarks/float16_convolutions.py [--rounds 3]

keras.applications ResNet50V2 (32x32x3 images, 10 classes, batch 8, AdamW),
stock Keras's `fit()` step in float32, mixed_bfloat16 and mixed_float16 (with
Keras's LossScaleOptimizer), each in its own worker process
(benchmarks/isolated.py), because TF_ENABLE_ONEDNN_OPTS is read once, when
TensorFlow starts. Rows: oneDNN on (TensorFlow's default on x86), oneDNN off,
and float16 with the whole step XLA-compiled (XLA's own kernels). Ratios are to
float32 with oneDNN on.

Why: on a CPU with AVX512_FP16, oneDNN takes float16 convolutions and computes
their weight gradient with its unvectorized reference kernel (`kmp env` times
one such convolution; docs/precision.md, "On CPU").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import isolated

BATCH, STEPS = 8, 4


def _build(precision: str, onednn: bool, xla: bool):
    if not onednn:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # before TensorFlow starts: it reads this once
    import keras
    import numpy as np

    keras.config.set_dtype_policy(precision)
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)
    optimizer = keras.optimizers.AdamW(1e-4)
    if precision == "mixed_float16":
        # From 2^8: at Keras's 2^15 this model's float16 gradients overflow and every step is skipped.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**8)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=xla)
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, (BATCH * STEPS,)).astype("int32")

    def fit(steps):
        model.fit(x[:BATCH * steps], y[:BATCH * steps], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    start = time.perf_counter()
    fit(1)
    first = time.perf_counter() - start

    def measure():  # ms per step, from a fit() of STEPS steps
        start = time.perf_counter()
        fit(STEPS)
        return (time.perf_counter() - start) * 1e3 / STEPS

    return first, measure, lambda: ""


ROWS = {
    "float32, oneDNN on": ("float32", True, False),
    "mixed_bfloat16, oneDNN on": ("mixed_bfloat16", True, False),
    "mixed_float16, oneDNN on": ("mixed_float16", True, False),
    "float32, oneDNN off": ("float32", False, False),
    "mixed_bfloat16, oneDNN off": ("mixed_bfloat16", False, False),
    "mixed_float16, oneDNN off": ("mixed_float16", False, False),
    "mixed_float16, whole step XLA": ("mixed_float16", True, True),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    variants = {row: isolated.Variant([sys.executable, os.path.abspath(__file__), "--worker", row], build_limit=900)
                for row in ROWS}
    outcomes = isolated.run(variants, args.rounds, resident=["float32, oneDNN on"])
    isolated.table(f"ResNet50V2, 32x32, batch {BATCH}, stock Keras fit(): ms per step, ratio to float32 with oneDNN",
                   outcomes, "float32, oneDNN on")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        isolated.serve(lambda: _build(*ROWS[sys.argv[sys.argv.index("--worker") + 1]]))
    else:
        main()
