"""Multi-worker training with kmp: MultiWorkerMirroredStrategy, mixed float16.

One script per worker; TF_CONFIG names the cluster. Two local workers on
127.0.0.1 (kmp launch gives each its TF_CONFIG and relays their output):

    kmp launch --workers 2 recipes/multiworker.py

On a real cluster, one worker per machine with TF_CONFIG set there (or
`kmp launch --hostfile hosts recipes/multiworker.py` prints each host's command):

    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}' python recipes/multiworker.py

Without TF_CONFIG it runs on this process's default strategy.

Each worker trains a small classifier on the digits data shipped with kmp
(`kmp.data.datasets.load_digits`, no network needed) and prints its final test
loss, accuracy and loss scale; all workers print the same numbers, since they
hold the same weights.

The three kmp calls that matter:

    strategy = kmp.distribute.resolve_strategy()   # TF_CONFIG with > 1 worker -> MWMS
    optimizer = kmp.wrap(keras.optimizers.AdamW(...))  # float16 -> kmp.LossScaleOptimizer
    kmp.distribute.prepare(model)                  # or Keras 3.15's fit() fails on > 1 worker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GLOBAL_BATCH = 64  # split evenly across the replicas of all workers


def train(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import kmp
    import kmp.distribute
    from kmp.callbacks import LossScaleMonitor
    from kmp.data.datasets import load_digits

    # A collective whose peer died fails after this long instead of waiting forever.
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.collective_timeout)
    strategy = kmp.distribute.resolve_strategy(args.strategy, communication_options=options)
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0)
    name = f"worker {task}"

    tpu = kmp.distribute.tpu_settings(strategy)  # None unless on a TPU: then bf16 and 32 steps a call
    precision = kmp.set_precision(tpu.precision if tpu else "mixed_float16")
    steps_per_execution = tpu.steps_per_execution if tpu else 1

    keras.utils.set_random_seed(args.seed)  # the same seeds, hence the same shuffle, on every worker
    (x, y), (x_test, y_test) = load_digits(seed=args.seed)
    options = tf.data.Options()
    # Every worker reads the same shuffled stream (a seeded shuffle) and keeps
    # its share of each global batch: the global batches do not depend on the
    # number of workers.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train_data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=args.seed)
        .batch(GLOBAL_BATCH)
        .with_options(options)
    )
    test_data = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(GLOBAL_BATCH).with_options(options)

    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(256, activation="relu")(inputs)
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
        outputs = kmp.float32_output(keras.layers.Dense(10)(hidden), "softmax")
        model = keras.Model(inputs, outputs)
        optimizer = kmp.wrap(keras.optimizers.AdamW(args.learning_rate))
        model.compile(
            optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    kmp.distribute.prepare(model)
    if tpu:
        kmp.distribute.tpu_settings(strategy, model)  # warns about sizes the TPU pads

    print(f"{name}: {type(strategy).__name__}, {strategy.num_replicas_in_sync} replicas, {precision}, "
          f"global batch {GLOBAL_BATCH}", flush=True)
    start = time.perf_counter()
    history = model.fit(train_data, epochs=args.epochs, verbose=0, shuffle=False, callbacks=[LossScaleMonitor()])
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(test_data, verbose=0)
    scale = "none" if not hasattr(optimizer, "dynamic_scale") else f"{float(optimizer.dynamic_scale.numpy()):g}"
    skipped = int(optimizer.skipped_steps.numpy()) if hasattr(optimizer, "skipped_steps") else 0
    print(
        f"{name}: train loss {history.history['loss'][-1]:.4f} | test loss {loss:.4f} | "
        f"test accuracy {accuracy:.4f} | loss scale {scale} | skipped steps {skipped} | "
        f"steps {int(optimizer.iterations.numpy())} | {seconds:.1f} s",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default="auto", help="auto (default), multi_worker_mirrored, ...")
    parser.add_argument("--collective-timeout", type=float, default=120.0, help="seconds")
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
