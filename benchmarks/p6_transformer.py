"""P6, a real transformer: a keras-hub GPT-2 trained by kmp vs stock Keras, side by side.

The model: GPT2CausalLM (preprocessor=None) on GPT2Backbone(vocabulary_size=8192,
num_layers=4, num_heads=4, hidden_dim=256, intermediate_dim=1024,
max_sequence_length=128), dropout 0; sequences of 128 random tokens (the
labels are the next tokens), global batch 16, AdamW(1e-4),
SparseCategoricalCrossentropy(from_logits=True). At float32 and at
mixed_float16, three variants:

    Mirrored, stock Keras   MirroredStrategy on two logical CPUs, compile() as is
                            (no XLA on a CPU-only machine; Keras's
                            LossScaleOptimizer around AdamW at fp16)
    Mirrored, kmp           the same strategy, compile(optimizer=kmp.wrap(AdamW)) and
                            kmp.prepare(model), on the path kmp picks by default
                            (printed: kmp.engine.replica_step.describe_path)
    one device + XLA        stock Keras on ONE device, compile(jit_compile=True),
                            the same global batch: the floor

Every row is built and traced first, then all six run in interleaved rounds
(benchmarks/common.py), one fit() of --steps steps each per round. Reported
per row, medians over the rounds: the steady step (ms, fit() from the end of
its first step to the end of its last, common.fit_times), the whole fit()
call in ms per step (its per-call set-up included) and the same less its
exit (TensorFlow's teardown of the input iterator, which sometimes holds
fit() for seconds in every row: common.fit_phases), tokens per second
(global batch x 128 / steady step), and the first call: compile(),
kmp.prepare and the first fit() of 2 steps (trace, XLA compilation, 2
steps), in seconds. Then kmp's ratios to the floor and to stock Keras under
the strategy, with the targets against the floor at the same precision:
steady step <= 1.10x, whole fit() <= 1.20x, first call <= 1.5x.

    python benchmarks/p6_transformer.py [--rounds 3] [--steps 20] [--precisions float32,mixed_float16]
    python benchmarks/p6_transformer.py --quick    # no warm-up round; 1 round of 10 steps unless given

Run it on a quiet machine: it reports medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from common import fit_phases, interleaved, use_two_logical_cpus

VOCABULARY, SEQUENCE, BATCH = 8192, 128, 16
PRECISIONS = ("float32", "mixed_float16")
STOCK, KMP, FLOOR = "Mirrored, stock Keras", "Mirrored, kmp", "one device + XLA (floor)"
# kmp / the floor, at the same precision (the targets).
TARGETS = {"steady": 1.10, "whole": 1.20, "first": 1.5}


def gpt2():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=4, num_heads=4, hidden_dim=256, intermediate_dim=1024,
        max_sequence_length=SEQUENCE, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_data(rows: int, seed: int = 0):
    """Random token sequences: the model reads tokens 0..127 and predicts 1..128."""
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, VOCABULARY, (rows, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, SEQUENCE), "int32")}
    return x, tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="timed rounds, after one warm-up round (default 3)")
    parser.add_argument("--steps", type=int, help="steps per timed fit() (default 20)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--quick", action="store_true",
                        help="no warm-up round, and --rounds 1 --steps 10 unless given")
    args = parser.parse_args()
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        sys.exit("P6 builds its GPT-2 with keras-hub, which is not installed: pip install 'keras-hub>=0.32,<0.33' "
                 "(or kmp's test extra, pip install '.[test]').")
    warmup = 0 if args.quick else 1
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (10 if args.quick else 20)
    precisions = args.precisions.split(",")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"expected --precisions from {','.join(PRECISIONS)}. Received: {unknown}")

    use_two_logical_cpus()
    import keras
    import tensorflow as tf

    import kmp

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    one_device = tf.distribute.get_strategy()
    x, y = token_data(BATCH * args.steps)
    first_x, first_y = {k: v[: 2 * BATCH] for k, v in x.items()}, y[: 2 * BATCH]

    class Row:
        """A compiled, traced model; calling it times one fit() (steady ms per step) and keeps the whole call's."""

        def __init__(self, name, model, first):
            self.name, self.model, self.first, self.whole, self.exits = name, model, first, [], []

        def __call__(self):
            ms, seconds, exit_seconds = fit_phases(self.model, x, y, BATCH)
            self.whole.append(seconds * 1000 / args.steps)
            self.exits.append(exit_seconds)
            print(f"  {self.name}: steady {ms:.1f} ms, whole fit() {self.whole[-1]:.1f} ms per step, "
                  f"exit {exit_seconds:.2f} s", flush=True)
            return ms

        def whole_less_exit(self, rounds):
            """Whole fit() per step without the exit (common.fit_phases: TensorFlow's iterator teardown)."""
            timed = zip(self.whole[-rounds:], self.exits[-rounds:])
            return statistics.median(w - e * 1000 / args.steps for w, e in timed)

    def built(variant, policy):
        keras.config.set_dtype_policy(policy)
        strategy = one_device if variant == FLOOR else mirrored
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = gpt2()
            start = time.perf_counter()
            optimizer = keras.optimizers.AdamW(1e-4)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            if variant == KMP:
                model.compile(optimizer=kmp.wrap(optimizer), loss=loss)
            else:
                if policy == "mixed_float16":
                    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
                model.compile(optimizer=optimizer, loss=loss, jit_compile=variant == FLOOR)
        if variant == KMP:
            kmp.prepare(model)
        model.fit(first_x, first_y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)  # trace, compile, 2 steps
        first = time.perf_counter() - start
        keras.config.set_dtype_policy("float32")
        return Row(f"{policy}, {variant}", model, first)

    load = os.getloadavg()[0]
    print(f"P6: keras-hub GPT2CausalLM, {len(precisions)} precisions, sequence {SEQUENCE}, global batch {BATCH}, "
          f"AdamW; {os.cpu_count()} CPUs, load {load:.1f}; rounds={args.rounds}, steps={args.steps}")
    rows = {}
    for policy in precisions:
        for variant in (STOCK, KMP, FLOOR):
            rows[(policy, variant)] = row = built(variant, policy)
            params = row.model.count_params()
            print(f"{policy}, {variant}: first call (compile, prepare, fit() of 2 steps) {row.first:.1f} s; "
                  f"{params:,} parameters", flush=True)
            if variant == KMP:
                print(f"  kmp path: {kmp.engine.replica_step.describe_path(row.model)}", flush=True)

    start = time.perf_counter()
    print(f"\n{'one warm-up round, then ' if warmup else ''}{args.rounds} timed rounds of the {len(rows)} rows")
    times = interleaved(rows, args.rounds, warmup=warmup)
    print(f"\n{len(rows)} rows x {args.rounds} rounds of {args.steps} steps: {time.perf_counter() - start:.0f} s; "
          f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after")

    for policy in precisions:
        steady = {v: statistics.median(times[(policy, v)]) for v in (STOCK, KMP, FLOOR)}
        whole = {v: statistics.median(rows[(policy, v)].whole[-args.rounds:]) for v in (STOCK, KMP, FLOOR)}
        first = {v: rows[(policy, v)].first for v in (STOCK, KMP, FLOOR)}
        bare = {v: rows[(policy, v)].whole_less_exit(args.rounds) for v in (STOCK, KMP, FLOOR)}
        print(f"\n{policy}: steady ms per step (median, min-max), whole fit() of {args.steps} steps in ms per "
              f"step, first call s, tokens/s; kmp's ratios")
        print(f"{'variant':26s} {'steady ms':>10s} {'spread':>15s} {'whole fit ms':>13s} {'less exit':>10s} "
              f"{'exits > 1 s':>12s} {'first s':>8s} {'tokens/s':>9s}")
        for v in (STOCK, KMP, FLOOR):
            values = times[(policy, v)]
            spread = f"{min(values):.1f}-{max(values):.1f}"
            stalls = sum(e > 1.0 for e in rows[(policy, v)].exits[-args.rounds:])
            print(f"{v:26s} {steady[v]:10.1f} {spread:>15s} {whole[v]:13.1f} {bare[v]:10.1f} "
                  f"{f'{stalls} of {args.rounds}':>12s} {first[v]:8.1f} {BATCH * SEQUENCE * 1000 / steady[v]:9.0f}")
        for label, key, kmp_value, floor_value, stock_value in (
                ("steady step", "steady", steady[KMP], steady[FLOOR], steady[STOCK]),
                (f"whole fit() of {args.steps} steps", "whole", whole[KMP], whole[FLOOR], whole[STOCK]),
                ("  the same, less the exit", "whole", bare[KMP], bare[FLOOR], bare[STOCK]),
                ("first call", "first", first[KMP], first[FLOOR], first[STOCK])):
            ratio = kmp_value / floor_value
            verdict = "met" if ratio <= TARGETS[key] else "not met"
            print(f"  kmp {label:24s} {ratio:5.2f}x the floor (target <= {TARGETS[key]:.2f}x: {verdict}), "
                  f"{kmp_value / stock_value:5.2f}x stock Keras under Mirrored")
        model = rows[(policy, KMP)].model
        skipped, inner = model.optimizer.skipped_steps, model.optimizer.inner_optimizer
        print(f"  kmp: skipped steps {int(skipped.numpy())}, updates {int(inner.iterations.numpy())}; "
              f"path: {kmp.engine.replica_step.describe_path(model)}")


if __name__ == "__main__":
    main()
