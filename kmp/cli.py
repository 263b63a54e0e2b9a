"""The `kmp` command: the parser, and one small function per subcommand.

    kmp --version     kmp's version and the TensorFlow/Keras it runs on (no TensorFlow import)
    kmp env           versions against kmp's pins, devices, fp16/bf16/XLA, features (kmp/env.py)
    kmp demo          train a small model in mixed precision on the bundled digits data

Only the subcommand that runs imports what it needs, so `kmp --help` and
`kmp --version` never import TensorFlow. A subcommand is an `_add_<name>`
function that adds its parser and sets `run=` to the function that does the
work; `main` dispatches.

The demo uses the digits data shipped with kmp (no network), so a fresh
install can check in a minute that mixed precision, loss scaling and the
monitor work on this machine.
"""

from __future__ import annotations

import argparse
import json
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


def _env(args: argparse.Namespace) -> int:
    from kmp import env

    report = env.collect(xla_timeout=args.xla_timeout)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(env.render(report))
    return env.exit_code(report)


def _add_demo(commands) -> None:
    demo = commands.add_parser("demo", help="train a small model on the bundled digits data")
    demo.add_argument("--precision", help="e.g. mixed_float16 (default), mixed_bfloat16, float32, 16-mixed, auto")
    demo.add_argument("--config", help="a DeepSpeed-style JSON file (fp16/bf16 block, clipping, ...)")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--learning-rate", type=float, default=2e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", action="store_true", help="print one line per epoch")
    demo.set_defaults(run=_demo)


def _add_env(commands) -> None:
    env = commands.add_parser(
        "env", help="versions, devices, fp16/bf16 and XLA support, and which kmp features run here",
        description="Report what kmp finds on this machine. Exit status 1 when a pinned dependency "
                    "is missing or outside kmp's pins, else 0.")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.add_argument("--xla-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="give up on the XLA check after this long (default 60)")
    env.set_defaults(run=_env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kmp", description="Mixed-precision training for Keras 3 on TensorFlow.")
    # Not argparse's version action, which prints and exits inside
    # parse_args: main() prints it, so tests/test_docs.py can parse (without
    # running) `kmp --version` in the docs as it parses every other command.
    parser.add_argument("--version", action="store_true", help="print kmp's version and TensorFlow's and Keras's")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(commands)
    _add_env(commands)
    # Command groups (e.g. `kmp config check FILE`) add a subparser with
    # their own add_subparsers here, each leaf with its own set_defaults(run=...).
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from kmp.env import version_line

        print(version_line())
        return 0
    if args.command is None:
        parser.error("a command is required (or --version)")
    from kmp.errors import KmpError

    try:
        return args.run(args)
    except KmpError as error:  # our errors already say what to fix: no traceback
        print(f"kmp: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
