"""The `kmp` command. `kmp demo` trains a small model in mixed precision.

The demo uses the digits data shipped with kmp (no network), so a fresh
install can check in a minute that mixed precision, loss scaling and the
monitor work on this machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import kmp
    from kmp.callbacks import LossScaleMonitor
    from kmp.datasets import load_digits

    config = kmp.load_config(args.config) if args.config else None
    precision = args.precision or (None if config and config.precision != "fp32" else "mixed_float16")
    (x, y), (x_test, y_test) = load_digits(seed=args.seed)
    keras.utils.set_random_seed(args.seed)
    with kmp.precision_scope(precision or config) as chosen:
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(256, activation="relu")(inputs)
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
        outputs = kmp.float32_output(keras.layers.Dense(10)(hidden), activation="softmax")
        model = keras.Model(inputs, outputs)
        optimizer = kmp.wrap(keras.optimizers.AdamW(args.learning_rate), config, precision=chosen)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        print(f"kmp demo: {chosen} on {len(x)} digits images, optimizer {type(optimizer).__name__}")
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2 if args.verbose else 0,
                  callbacks=[LossScaleMonitor()])
        seconds = time.perf_counter() - start
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss      {loss:.4f}")
    print(f"test accuracy  {accuracy:.4f}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        print(f"loss scale     {float(optimizer.dynamic_scale.numpy()):g}")
        skipped = getattr(optimizer, "skipped_steps", None)
        if skipped is not None:
            print(f"skipped steps  {int(skipped.numpy())} of {int(skipped.numpy()) + int(optimizer.iterations.numpy())}")
    else:
        print(f"loss scale     none ({chosen.compute_dtype} needs no loss scaling)")
    print(f"train time     {seconds:.1f} s for {args.epochs} epochs")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kmp", description="Mixed-precision training for Keras 3 on TensorFlow.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model on the bundled digits data")
    demo.add_argument("--precision", help="e.g. mixed_float16 (default), mixed_bfloat16, float32, 16-mixed, auto")
    demo.add_argument("--config", help="a DeepSpeed-style JSON file (fp16/bf16 block, clipping, ...)")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--learning-rate", type=float, default=2e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", action="store_true", help="print one line per epoch")
    args = parser.parse_args(argv)
    from kmp.errors import KmpError

    try:
        return _demo(args)
    except KmpError as error:  # our errors already say what to fix: no traceback
        print(f"kmp: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
