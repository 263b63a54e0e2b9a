"""What keeping the Keras variables current costs on the flat engine, on P1.

fit() and train_on_batch() store the flat buffers into the Keras variables
when they end, and when they start load the buffers whose variables were
written since (kmp.engine; usually none, checked by one read per variable).
A fit() pays that once per call; a train_on_batch loop once per step. Side
by side in one process, in interleaved rounds (the issues' 40 x Dense(256)
MLP, batch 64, MirroredStrategy on two logical CPUs):

- kmp flat, fit(): steady ms per step (no copies inside fit());
- kmp flat, train_on_batch: ms per call, a check and a store each;
- the check and the store alone, as the calls make them;
- a load and a store, the copies a call would make without the check;
- kmp per-variable and stock Keras, train_on_batch: ms per call.

    python benchmarks/train_on_batch_sync.py [--policy float32] [--rounds 5] [--calls 30]
"""

from __future__ import annotations

import argparse
import time

import common

common.use_two_logical_cpus()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmp  # noqa: E402
from kmp.engine import engine# noqa: E402

BATCH = 64


def _model(strategy, kind):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = common.mlp()
        inner = keras.optimizers.Adam(1e-4)
        model.compile(optimizer=inner if kind == "stock" else kmp.wrap(inner), loss="mse")
    if kind != "stock":
        kmp.prepare(model, flat_buffers=kind == "flat")
    return model


def _on_batches(model, x, y, calls):
    def measure():
        start = time.perf_counter()
        for k in range(calls):
            model.train_on_batch(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
        return (time.perf_counter() - start) * 1000 / calls

    return measure


def _copies(model, calls, check: bool):
    buffers = engine.engine_of(model).buffers

    def measure():
        start = time.perf_counter()
        for _ in range(calls):
            names = buffers.written_since_store() if check else tuple(buffers.buffers)
            if names:
                buffers.load(names)
            buffers.store()
        return (time.perf_counter() - start) * 1000 / calls

    return measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="mixed_float16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    keras.config.set_dtype_policy(args.policy)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = common.regression_data(BATCH, args.calls)
    models = {kind: _model(strategy, kind) for kind in ("flat", "per-variable", "stock")}
    variants = {
        "kmp flat, fit() steady step": lambda: common.fit_ms_per_step(models["flat"], x, y, BATCH),
        "kmp flat, train_on_batch": _on_batches(models["flat"], x, y, args.calls),
        "kmp flat, check + store alone": None,
        "kmp flat, load + store alone": None,
        "kmp per-variable, train_on_batch": _on_batches(models["per-variable"], x, y, args.calls),
        "stock Keras, train_on_batch": _on_batches(models["stock"], x, y, args.calls),
    }
    models["flat"].train_on_batch(x[:BATCH], y[:BATCH])  # builds the engine
    variants["kmp flat, check + store alone"] = _copies(models["flat"], args.calls, check=True)
    variants["kmp flat, load + store alone"] = _copies(models["flat"], args.calls, check=False)
    print(f"P1 (40 x Dense(256), batch {BATCH}), {args.policy}, MirroredStrategy on two logical CPUs; "
          f"{args.rounds} rounds of {args.calls} calls")
    common.report("ms per step", common.interleaved(variants, args.rounds), "kmp flat, fit() steady step")


if __name__ == "__main__":
    main()
