"""The `kmp` command: the parser, and one small function per subcommand.

    kmp --version     kmp's version and the TensorFlow/Keras it runs on (no TensorFlow import)
    kmp env           versions against kmp's pins, devices, fp16/bf16/XLA, features (kmp/cli/env.py)
    kmp demo          train a small model in mixed precision on the bundled digits data
    kmp config check  what a DeepSpeed-style config resolves to, as a table; exit 0/1 (kmp/cli/config_check.py)
    kmp memory        bytes per replica of weights, gradients, optimizer state, accumulators (kmp/memory/estimate.py)
    kmp launch        start a multi-worker job's workers, each with its TF_CONFIG (kmp/cli/launch.py)
    kmp bench         the P1-P4 and P6 comparisons of benchmarks/ on this machine, kmp vs stock Keras (kmp/cli/bench.py)

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
import contextlib
import importlib.util
import json
import os
import sys
import time
import warnings

# The demo exists to show dynamic loss scaling: DeepSpeed's start (initial_scale_power 16) with a window
# short enough that one run shows the scale climb to where float16 overflows, halve, and grow back.
DEMO_SCALE_POWER, DEMO_WINDOW = 16, 25


def _float16_note() -> str | None:
    """One line where `kmp env` calls float16 slow here: what it costs, and why the demo uses it anyway."""
    import kmp
    from kmp.cli import env

    hardware = kmp.Hardware.detect()
    speed = env._speed("mixed_float16", hardware, env.cpu_flags())
    if speed["status"] != "slow":
        return None
    cost = speed["note"].split(". ")[0]  # check_hardware's reason, without its advice to leave float16
    return (f"kmp demo: mixed_float16 on {hardware.kind.upper()}: {cost}. The demo uses it to show dynamic loss "
            "scaling, which only float16 needs (--precision float32 trains without it).")


@contextlib.contextmanager
def _ignoring(message: str | None):
    """Inside: warnings starting with `message` are not shown (none, for None); the filters are restored after."""
    with warnings.catch_warnings():
        if message:
            warnings.filterwarnings("ignore", message, UserWarning)
        yield


def _demo(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before minutes of training, not after
        print('kmp demo: --plot needs matplotlib, an extra: pip install "kmp[plot]"', file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import kmp
    from kmp.callbacks import LossScaleMonitor
    from kmp.data.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits(seed=args.seed)
    batch_size = args.batch_size
    # A config's "auto" values are filled from the demo's own settings, as HF's Trainer does from its arguments.
    steps = args.epochs * -(-len(x) // batch_size)
    fills = {"micro_batch_size": batch_size, "total_steps": steps, "warmup_steps": steps // 10,
             "learning_rate": args.learning_rate, "weight_decay": 0.0, "gradient_clipping": 0}
    config = None
    if args.config:
        precision_fill = {"precision": "fp16"} if args.precision is None else {}
        config = kmp.load_config(args.config, **precision_fill, **fills)
        if config.train_batch_size or config.micro_batch_size:
            # The file's micro-batch, as DeepSpeed feeds it (one replica here).
            _, micro, accumulation = kmp.resolve_batch_sizes(config, world_size=1)
            batch_size = micro
            print(f"kmp demo: the config's micro-batch {micro}, {accumulation} per optimizer step")
    precision = args.precision or (None if config and config.precision != "fp32" else "mixed_float16")
    note = _float16_note() if args.precision is None and precision == "mixed_float16" else None
    if note:
        print(note)
    keras.utils.set_random_seed(args.seed)
    ignored = "precision 'mixed_float16' on " if note else None  # check_hardware's advice against the default
    with _ignoring(ignored), kmp.precision_scope(precision or config) as chosen:
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(256, activation="relu")(inputs)
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
        outputs = kmp.float32_output(keras.layers.Dense(10)(hidden), activation="softmax")
        model = keras.Model(inputs, outputs)
        # The config's optimizer block, when it has one; else AdamW(--learning-rate).
        own = None if config is not None and config.optimizer is not None else keras.optimizers.AdamW(
            args.learning_rate)
        # A config's fp16 block sets its own loss scaling; otherwise the demo's.
        demo_scale = chosen.needs_loss_scaling and not (config is not None and config.precision == "fp16")
        optimizer = kmp.wrap(own, args.config, precision=chosen, states=args.states, **(
            {"micro_batch_size": batch_size, "total_steps": fills["total_steps"],
             "warmup_steps": fills["warmup_steps"]} if args.config else {}),
            **({"initial_scale": 2.0**DEMO_SCALE_POWER, "dynamic_growth_steps": DEMO_WINDOW} if demo_scale else {}),
            **({"overflow": args.overflow} if args.overflow and chosen.needs_loss_scaling else {}))
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        kmp.prepare(model)  # XLA forward/backward, and the flat-buffer engine where it applies
        print(f"kmp demo: {chosen} on {len(x)} digits images, optimizer {type(optimizer).__name__}")
        if demo_scale:
            power, run = DEMO_SCALE_POWER, args.epochs * -(-len(x) // batch_size)
            print(f"kmp demo: loss scale from 2**{power} (DeepSpeed's initial_scale_power {power}), doubled after "
                  f"{DEMO_WINDOW} clean steps (loss_scale_window {DEMO_WINDOW}, not DeepSpeed's 1000, so that {run} "
                  "steps show it grow), halved at each overflow (the step is "
                  f"{'replayed at the halved scale' if getattr(optimizer, 'replays', False) else 'skipped'} and logged)")
        start = time.perf_counter()
        recorder = kmp.StepRecorder()
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)  # else no scale to monitor (it warns)
        model.fit(x, y, batch_size=batch_size, epochs=args.epochs, verbose=2 if args.verbose else 0,
                  callbacks=[LossScaleMonitor(), recorder] if scaled else [recorder])
        seconds = time.perf_counter() - start
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss      {loss:.4f}")
    print(f"test accuracy  {accuracy:.4f}")
    if scaled:
        print(f"loss scale     {float(optimizer.dynamic_scale.numpy()):.10g}")
        skipped = getattr(optimizer, "skipped_steps", None)
        if skipped is not None:
            print(f"skipped steps  {int(skipped.numpy())} of {int(skipped.numpy()) + int(optimizer.iterations.numpy())}")
        replayed = getattr(optimizer, "replayed_steps", None)
        if replayed is not None:
            print(f"replayed steps {int(replayed.numpy())} (recomputed at a lowered scale, then applied)")
    else:
        print(f"loss scale     none ({chosen.compute_dtype} needs no loss scaling)")
    engine = "flat buffers (kmp.engine)" if kmp.engine.engine.engine_of(model) is not None else "per variable"
    print(f"update         {engine}")
    print(f"train time     {seconds:.1f} s for {args.epochs} epochs")
    if args.plot:
        kmp.plot_run(recorder.steps, args.plot, title=f"kmp demo, {chosen.name}")
        print(f"plot           {args.plot} (loss, loss scale, skipped and replayed steps per step)")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from kmp.cli import launch

    command = [sys.executable, args.script, *args.script_args]
    if args.hostfile:
        with open(args.hostfile, encoding="utf-8") as f:
            hosts = launch.parse_hostfile(f.read(), args.hostfile)
        if args.workers is not None:
            print("kmp launch: --workers is ignored with --hostfile (its slots are the workers)", file=sys.stderr)
        # Remote hosts run their own Python: the script by the name given, with `python`.
        commands = launch.host_commands(hosts, ["python", args.script, *args.script_args], args.master_port)
        print(f"# {len(commands)} workers on {len(hosts)} hosts; run each line on its host (kmp does not ssh):")
        for host, line in commands:
            print(f"{host}: {line}")
        return 0
    return launch.run_local(command, 1 if args.workers is None else args.workers, timeout=args.timeout)


def _bench(args: argparse.Namespace) -> int:
    from kmp.cli import bench

    return bench.run(quick=args.quick, only=args.only)


def _env(args: argparse.Namespace) -> int:
    from kmp.cli import env

    report = env.collect(xla_timeout=args.xla_timeout)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(env.render(report))
    return env.exit_code(report)


def _config_check(args: argparse.Namespace) -> int:
    from kmp.cli.config_check import check

    fills = {name: getattr(args, name) for name in ("precision", "micro_batch_size", "gradient_accumulation_steps",
                                                    "total_steps", "warmup_steps", "learning_rate")
             if getattr(args, name) is not None}
    text, code = check(args.file, replicas=args.replicas, strict=args.strict, **fills)
    print(text)
    return code


def _memory(args: argparse.Namespace) -> int:
    import dataclasses

    from kmp.memory import estimate as memory

    rows = memory.estimates(args.params, optimizer=args.optimizer, precision=args.precision, replicas=args.replicas,
                            stage=args.stage, states=args.states, gradient_accumulation_steps=args.accumulation,
                            flat_buffers=args.flat_buffers)
    print(json.dumps([dataclasses.asdict(e) | {"total": e.total} for e in rows], indent=2) if args.json
          else memory.table(rows))
    return 0


def _comma_list(kind):
    """An argparse type: "1,2,8" -> [1, 2, 8] (kind: int, str, or a dict of the accepted words)."""
    def parse(text: str) -> list:
        words = [w.strip() for w in text.split(",") if w.strip()]
        try:
            return [kind[w] if isinstance(kind, dict) else kind(w) for w in words] or [][0]
        except (KeyError, ValueError, IndexError):
            accepted = ", ".join(kind) if isinstance(kind, dict) else "integers"
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {accepted}; got {text!r}") from None
    return parse


def _add_memory(commands) -> None:
    memory = commands.add_parser(
        "memory", help="bytes per replica of weights, gradients, optimizer state and accumulators",
        description="Estimate what each replica holds for a model of --params parameters, one row per combination "
                    "of the comma-separated settings, as DeepSpeed's estimate_zero2_model_states_mem_needs_all_cold "
                    "prints (docs/memory.md). Activations are not counted. Imports no TensorFlow.")
    memory.add_argument("--params", required=True, help="trainable parameters: 125M, 1.3B, 7e9, 350K or 125000000")
    memory.add_argument("--optimizer", type=_comma_list(str), default=["adam"],
                        help="adam (default), adamw, sgd, sgd_momentum, lion, adagrad, lamb, rmsprop, adamax, ...")
    memory.add_argument("--precision", type=_comma_list(str), default=["mixed_float16"],
                        help="mixed_float16 (default), mixed_bfloat16, float32, float16, bfloat16, fp16, bf16, ...")
    memory.add_argument("--replicas", type=_comma_list(int), default=[1], help="e.g. 1,2,8 (default 1)")
    memory.add_argument("--stage", type=_comma_list(int), default=[0], help="ZeRO stage: 0 (default), 1 or 0,1")
    memory.add_argument("--states", type=_comma_list(str), default=["32bit"],
                        help="optimizer states: 32bit (default), 8bit or 32bit,8bit")
    memory.add_argument("--accumulation", type=_comma_list(int), default=[1], metavar="STEPS",
                        help="gradient accumulation steps (default 1)")
    memory.add_argument("--flat-buffers", type=_comma_list({"off": False, "on": True}), default=[False],
                        help="kmp.prepare's flat-buffer engine: off (default), on or off,on")
    memory.add_argument("--json", action="store_true", help="print the rows as JSON")
    memory.set_defaults(run=_memory)


def _add_config(commands) -> None:
    group = commands.add_parser("config", help="work with DeepSpeed-style config files")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="print what a config resolves to (no training); exit 0 if it loads, else 1",
        description="Load a DeepSpeed-style config as kmp.wrap would and print the resolved settings: precision, "
                    "loss scaling, optimizer, schedule with sample learning rates, batch arithmetic, ignored keys. "
                    "Imports no TensorFlow.")
    check.add_argument("file", help="a DeepSpeed-style JSON config")
    check.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (DeepSpeed's world size)")
    check.add_argument("--strict", action="store_true", help="unknown top-level keys are errors")
    check.add_argument("--precision", choices=("fp16", "bf16", "fp32"), help="fills 'auto' in fp16/bf16.enabled")
    for flag, dest in (("--micro-batch-size", "micro_batch_size"),
                       ("--gradient-accumulation-steps", "gradient_accumulation_steps"),
                       ("--total-steps", "total_steps"), ("--warmup-steps", "warmup_steps")):
        check.add_argument(flag, dest=dest, type=int, metavar="N", help="fills the 'auto' value")
    check.add_argument("--learning-rate", type=float, metavar="LR", help="fills 'auto' in optimizer.params.lr")
    check.set_defaults(run=_config_check)


def _add_demo(commands) -> None:
    demo = commands.add_parser("demo", help="train a small model on the bundled digits data")
    demo.add_argument("--precision", help="e.g. mixed_float16 (default), mixed_bfloat16, float32, 16-mixed, auto")
    demo.add_argument("--config", help="a DeepSpeed-style JSON file: its precision, optimizer, schedule, clipping "
                                       "and micro-batch are used")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--learning-rate", type=float, default=2e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--overflow", choices=("skip", "replay"),
                      help="what an overflowing step does: skipped, or replayed at the lowered scale (default: "
                           "kmp.wrap's, or the config's kmp.overflow)")
    demo.add_argument("--states", choices=("32bit", "8bit"), default="32bit",
                      help="the optimizer's moments: 32bit (default), or 8bit (block-wise quantized, kmp.AdamW8bit)")
    demo.add_argument("--verbose", action="store_true", help="print one line per epoch")
    demo.add_argument("--plot", metavar="PNG", help='draw loss, loss scale and skipped steps per step into this '
                      'PNG (needs the plot extra: pip install "kmp[plot]")')
    demo.set_defaults(run=_demo)


def _add_launch(commands) -> None:
    launch = commands.add_parser(
        "launch", help="start a MultiWorkerMirroredStrategy job's workers, each with its TF_CONFIG",
        description="Start N local worker processes of SCRIPT on 127.0.0.1, each with its TF_CONFIG (free ports), "
                    "relay their output as '[worker i] ...', and stop them all when one fails. With --hostfile "
                    "(DeepSpeed's format: 'hostname slots=N' lines), print each worker's command with its "
                    "TF_CONFIG, to run on its host; kmp does not ssh.")
    launch.add_argument("--workers", type=int, metavar="N", help="local worker processes (default 1)")
    launch.add_argument("--hostfile", help="DeepSpeed-style hostfile: print each host's commands instead")
    launch.add_argument("--master-port", type=int, default=29500,
                        help="with --hostfile: the first port on each host (DeepSpeed's default 29500)")
    launch.add_argument("--timeout", type=float, metavar="SECONDS", help="stop every worker after this long (> 0)")
    launch.add_argument("script", help="the Python script each worker runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    launch.set_defaults(run=_launch)


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench", help="the P1-P4 and P6 comparisons (kmp vs stock Keras) on this machine",
        description="Run the project's benchmark scripts (P1/P2 step time, P3 update bandwidth, P4 accumulation "
                    "under MultiWorkerMirroredStrategy, P6 a keras-hub GPT-2), each in its own process, and print "
                    "their tables.")
    bench.add_argument("--quick", action="store_true", help="fewer rounds and steps: a few minutes in all")
    bench.add_argument("--only", metavar="P", help="one comparison: P1 (with P2), P3, P4, P6 or MEM")
    bench.set_defaults(run=_bench)


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
    _add_config(commands)
    _add_memory(commands)
    _add_launch(commands)
    _add_bench(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from kmp.cli.env import version_line

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
