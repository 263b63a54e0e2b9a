"""MirroredStrategy: tfds cifar10 on every local GPU (or CPU devices), mixed precision.

    python recipes/mirrored.py [--cpus 2] [--precision mixed_float16] [--epochs 2]

`--batch-size` is the micro-batch per replica: kmp.input_pipeline batches by
micro-batch x replicas, which Keras splits across them. Without GPUs,
`--cpus N` splits the CPU into N logical devices so the strategy has N
replicas (how kmp's tests run it).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0], batch_size=32)
    p.add_argument("--precision", default="mixed_float16")
    p.add_argument("--cpus", type=int, default=2, help="logical CPU devices when there is no GPU (default 2)")
    args = p.parse_args(argv)
    import keras
    import tensorflow as tf

    import kmp

    if not tf.config.list_physical_devices("GPU") and args.cpus > 1:
        try:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.cpus)
        except RuntimeError:
            print("the runtime is already initialized: its devices stay as they are", flush=True)
    strategy = kmp.resolve_strategy("mirrored")
    keras.utils.set_random_seed(args.seed)
    kmp.set_precision(args.precision)
    with strategy.scope():
        model = shared.image_model((32, 32, 3))
        model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(args.learning_rate)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    kmp.prepare(model)
    train = kmp.input_pipeline(shared.images("cifar10", "train"), micro_batch_size=args.batch_size, model=model,
                               seed=args.seed)
    replicas = strategy.num_replicas_in_sync
    test = shared.images("cifar10", "test").batch(args.batch_size * replicas)
    print(f"{type(strategy).__name__}, {replicas} replicas, {args.precision}, "
          f"global batch {args.batch_size * replicas}", flush=True)
    return {**shared.fit(model, train, test, args), "replicas": replicas}


if __name__ == "__main__":
    main()
