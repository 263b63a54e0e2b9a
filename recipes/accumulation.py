"""Gradient accumulation to a large effective batch: tfds imdb_reviews, a small text model, mixed float16.

    python recipes/accumulation.py [--batch-size 16 --accumulation 16] [--epochs 1]

Sixteen micro-batches of 16 make one optimizer step of 256 reviews, in the
memory of 16: kmp's optimizer adds each micro-batch's float32 gradient to a
local sum and all-reduces, checks, clips and applies once per window; an
overflow anywhere in the window skips the whole window. kmp.input_pipeline
batches by the micro-batch and checks the model's optimizer accumulates the
same number (docs/accumulation.md).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402

VOCABULARY, LENGTH = 10_000, 200


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0], epochs=1, batch_size=16)
    p.add_argument("--accumulation", type=int, default=16, help="micro-batches per optimizer step")
    args = p.parse_args(argv)
    import keras
    import tensorflow as tf
    import tensorflow_datasets as tfds

    import kmp

    keras.utils.set_random_seed(args.seed)
    kmp.set_precision("mixed_float16")
    train_text = tfds.load("imdb_reviews", split="train", as_supervised=True)
    vectorize = keras.layers.TextVectorization(VOCABULARY, output_sequence_length=LENGTH)
    vectorize.adapt(train_text.map(lambda text, _: text).take(5000).batch(256))

    def encode(text, label):
        return vectorize(text), label

    inputs = keras.Input((LENGTH,), dtype="int64")
    x = keras.layers.Embedding(VOCABULARY, 64)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(1)(x), "sigmoid"))
    optimizer = kmp.wrap(keras.optimizers.AdamW(args.learning_rate), gradient_accumulation_steps=args.accumulation)
    model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"])
    kmp.prepare(model)
    train = kmp.input_pipeline(train_text.map(encode, num_parallel_calls=tf.data.AUTOTUNE), model=model,
                               micro_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
                               seed=args.seed)
    test = tfds.load("imdb_reviews", split="test", as_supervised=True).map(encode).batch(256)
    print(f"micro-batch {args.batch_size} x {args.accumulation} = effective batch "
          f"{args.batch_size * args.accumulation}", flush=True)
    return {**shared.fit(model, train, test, args), "effective_batch": args.batch_size * args.accumulation}


if __name__ == "__main__":
    main()
