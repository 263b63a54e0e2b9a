"""Skipped updates over a run's first steps: stock Keras, DeepSpeed's rule, and kmp's overflow="replay".

A skipped update is a batch whose gradients never reach the weights: an
overflowing step under "skip". With "replay" the step is recomputed on the
same batch at the lowered scale and applied (kmp.scaling.replay), so the
count is what stays skipped after at most MAX_REPLAYS retries.

Models, all mixed_float16 on one device, prepared by kmp (not stock Keras):

- demo: `kmp demo`'s MLP on the digits, AdamW(2e-3), batch 32, every
  variant from the demo's scale 2**16 and window 25;
- resnet50v2: keras.applications.ResNet50V2(weights=None) on random 32x32x3
  images, 10 classes, SGD(0.01), batch 8;
- gpt2: a keras-hub GPT2CausalLM from a tiny config (tests/real_models.py's: one
  block, hidden 32, vocabulary 128, 16 tokens), AdamW(1e-3), batch 8.

Variants: stock Keras (compile() wraps the optimizer in Keras's
LossScaleOptimizer: initial 2**15, window 2000, skip); DeepSpeed's rule
(kmp with `{"fp16": {"enabled": true}}`: initial 2**16, window 1000,
hysteresis 2, skip, as DeepSpeed); kmp's Python defaults with
overflow="replay" (initial 2**15, window 2000); and DeepSpeed's config with
`"kmp": {"overflow": "replay"}`.

    python benchmarks/replay_skipped_updates.py [--models demo,resnet50v2,gpt2] [--steps 100]
"""

from __future__ import annotations

import argparse
import time

from common import ROOT  # noqa: F401  (this checkout's kmp first on sys.path)

DEEPSPEED = {"fp16": {"enabled": True}}


def _demo_model():
    import keras

    import kmp

    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    return keras.Model(inputs, kmp.float32_output(keras.layers.Dense(10)(hidden), activation="softmax"))


def _demo_data(rows):
    from kmp.data.datasets import load_digits

    (x, y), _ = load_digits(seed=0)
    reps = -(-rows // len(x))
    import numpy as np

    return np.concatenate([x] * reps)[:rows], np.concatenate([y] * reps)[:rows]


def _resnet():
    import keras

    return keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)


def _images(rows):
    import numpy as np

    rng = np.random.default_rng(1)
    return rng.random((rows, 32, 32, 3)).astype("float32"), rng.integers(0, 10, (rows,)).astype("int32")


def _gpt2():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=128, num_layers=1, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _tokens(rows):
    import numpy as np

    t = np.random.default_rng(0).integers(1, 128, (rows, 17)).astype("int32")
    return {"token_ids": t[:, :-1], "padding_mask": np.ones((rows, 16), "int32")}, t[:, 1:]


def _models():
    import keras

    lm_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    adamw = lambda lr: keras.optimizers.AdamW(lr)  # noqa: E731
    sgd = lambda lr: keras.optimizers.SGD(lr)  # noqa: E731
    # name -> (build, data, loss, optimizer, batch, the scale settings every variant starts from, or None)
    return {
        "demo": (_demo_model, _demo_data, "sparse_categorical_crossentropy", lambda: adamw(2e-3), 32,
                 {"initial_scale_power": 16, "loss_scale_window": 25}),
        "resnet50v2": (_resnet, _images, "sparse_categorical_crossentropy", lambda: sgd(0.01), 8, None),
        "gpt2": (_gpt2, _tokens, lm_loss, lambda: adamw(1e-3), 8, None),
    }


def run(name: str, variant: str, steps: int) -> dict:
    import keras

    import kmp

    build, data, loss, optimizer, batch, scale = _models()[name]
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = build()
    config = {"fp16": {"enabled": True, **(scale or {})}}
    python_scale = {} if scale is None else {"initial_scale": 2.0 ** scale["initial_scale_power"],
                                             "dynamic_growth_steps": scale["loss_scale_window"]}
    if variant == "stock Keras":
        inner = optimizer()
        wrapped = keras.optimizers.LossScaleOptimizer(inner, **python_scale)
    elif variant == "DeepSpeed's rule (kmp, skip)":
        wrapped = kmp.wrap(optimizer(), config, log_overflows=False)
    elif variant == "kmp replay":
        wrapped = kmp.wrap(optimizer(), overflow="replay", log_overflows=False, **python_scale)
    else:  # DeepSpeed's config, replaying
        wrapped = kmp.wrap(optimizer(), {**config, "kmp": {"overflow": "replay"}}, log_overflows=False)
    model.compile(optimizer=wrapped, loss=loss)
    if variant != "stock Keras":
        kmp.prepare(model)
    x, y = data(batch * steps)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    applied = int(wrapped.iterations.numpy())
    replayed = getattr(wrapped, "replayed_steps", None)
    return {"skipped": steps - applied, "replayed": 0 if replayed is None else int(replayed.numpy()),
            "scale": float(wrapped.dynamic_scale.numpy()), "seconds": seconds}


VARIANTS = ("stock Keras", "DeepSpeed's rule (kmp, skip)", "kmp replay", "DeepSpeed's config, kmp.overflow replay")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="demo,resnet50v2,gpt2")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    import logging

    logging.getLogger("kmp").setLevel(logging.ERROR)  # no overflow lines
    print(f"skipped updates in the first {args.steps} steps (replayed steps; final loss scale; fit() seconds)")
    print("| model | " + " | ".join(VARIANTS) + " |")
    print("| --- |" + " --- |" * len(VARIANTS))
    for name in args.models.split(","):
        cells = []
        for variant in VARIANTS:
            r = run(name, variant, args.steps)
            replayed = f"{r['replayed']} replayed; " if "replay" in variant else ""
            cells.append(f"{r['skipped']} ({replayed}{r['scale']:g}; {r['seconds']:.0f} s)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
