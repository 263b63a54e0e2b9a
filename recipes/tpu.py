"""TPUStrategy: tfds mnist in bfloat16 with many steps per call; the default strategy where no TPU is found.

    python recipes/tpu.py [--epochs 2]

kmp.resolve_strategy("auto") asks for a TPU only where one is hinted
(TPU_NAME, Colab's or GKE's variables, an attached TPU device), so this runs
anywhere: without a TPU it says so and trains on the default strategy. On a
TPU, kmp.distribute.tpu_settings gives bfloat16 and 32 steps per call, and
warns about batch and layer sizes the TPU pads. Not run on a TPU by kmp's
tests (there is none): docs/distributed.md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0], batch_size=128)
    args = p.parse_args(argv)
    import keras

    import kmp
    import kmp.distribute

    strategy = kmp.resolve_strategy("auto")
    tpu = kmp.distribute.tpu_settings(strategy)  # None unless on a TPU
    if tpu is None:
        print(f"no TPU found: running on {type(strategy).__name__} (the default strategy), bfloat16", flush=True)
    keras.utils.set_random_seed(args.seed)
    kmp.set_precision(tpu.precision if tpu else "mixed_bfloat16")
    with strategy.scope():
        model = shared.image_model((28, 28, 1))
        model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(args.learning_rate)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=tpu.steps_per_execution if tpu else 1)
    kmp.prepare(model)
    if tpu:
        kmp.distribute.tpu_settings(strategy, model)  # warns about sizes the TPU pads
    train = kmp.input_pipeline(shared.images("mnist", "train"), micro_batch_size=args.batch_size, model=model,
                               seed=args.seed)  # drop_remainder: the TPU compiles one shape
    test = shared.images("mnist", "test").batch(args.batch_size * strategy.num_replicas_in_sync, drop_remainder=True)
    return {**shared.fit(model, train, test, args), "tpu": tpu is not None}


if __name__ == "__main__":
    main()
