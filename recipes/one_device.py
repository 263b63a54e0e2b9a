"""One device: tfds mnist -> kmp.input_pipeline -> fit(), in mixed precision.

    python recipes/one_device.py [--precision mixed_bfloat16] [--epochs 2]

bfloat16 is the default: it has a fast path on CPUs with AVX512_BF16 (this
project's) and needs no loss scaling; mixed_float16 works too (kmp's
dynamic loss scaling), slower on a CPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="mixed_bfloat16")
    args = p.parse_args(argv)
    import keras

    import kmp

    keras.utils.set_random_seed(args.seed)
    kmp.set_precision(args.precision)
    model = shared.image_model((28, 28, 1))
    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(args.learning_rate)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    kmp.prepare(model)
    train = kmp.input_pipeline(shared.images("mnist", "train"), micro_batch_size=args.batch_size, model=model,
                               seed=args.seed)
    test = shared.images("mnist", "test").batch(args.batch_size)
    print(f"one device, {args.precision}, batch {args.batch_size}", flush=True)
    return shared.fit(model, train, test, args)


if __name__ == "__main__":
    main()
