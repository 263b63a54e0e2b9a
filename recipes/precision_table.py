"""fp32, bf16 and fp16 side by side on the digits data shipped with kmp: the same model, seed and batches.

    python recipes/precision_table.py [--epochs 10]

Prints one row per precision: test accuracy and loss, the final loss scale
and skipped steps (fp16 only: kmp's dynamic loss scaling), and the time.
Mixed precision keeps float32 master weights, so the accuracy should match
float32's within noise; on this project's CPU float16 is slower than float32
(no AVX512-FP16) and bfloat16 faster (AVX512_BF16): compare the times on
your own hardware.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def main(argv: list[str] | None = None) -> list[dict]:
    p = shared.parser(__doc__.split("\n\n")[0], epochs=10, batch_size=32)
    args = p.parse_args(argv)
    import keras

    import kmp
    from kmp.data.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits(seed=args.seed)
    rows = []
    for precision in PRECISIONS:
        keras.utils.set_random_seed(args.seed)
        with kmp.precision_scope(precision):
            inputs = keras.Input((64,))
            h = keras.layers.Dense(256, activation="relu")(inputs)
            h = keras.layers.Dense(256, activation="relu")(h)
            model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(10)(h), "softmax"))
            optimizer = kmp.wrap(keras.optimizers.AdamW(args.learning_rate))
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        kmp.prepare(model)
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
                  shuffle=True)
        seconds = time.perf_counter() - start
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
        scale = getattr(optimizer, "dynamic_scale", None)
        skipped = getattr(optimizer, "skipped_steps", None)
        rows.append({"precision": precision, "accuracy": accuracy, "loss": loss,
                     "loss_scale": None if scale is None else float(scale.numpy()),
                     "skipped": None if skipped is None else int(skipped.numpy()), "seconds": seconds})
    print(f"{'precision':16s} {'test accuracy':>13s} {'test loss':>10s} {'loss scale':>11s} {'skipped':>8s} "
          f"{'train s':>8s}")
    for r in rows:
        scale = "-" if r["loss_scale"] is None else f"{r['loss_scale']:g}"
        skipped = "-" if r["skipped"] is None else str(r["skipped"])
        print(f"{r['precision']:16s} {r['accuracy']:13.4f} {r['loss']:10.4f} {scale:>11s} {skipped:>8s} "
              f"{r['seconds']:8.1f}")
    spread = max(r["accuracy"] for r in rows) - min(r["accuracy"] for r in rows)
    print(f"accuracy spread: {100 * spread:.2f} points", flush=True)
    return rows


if __name__ == "__main__":
    main()
