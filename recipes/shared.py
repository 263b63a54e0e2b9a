"""What the recipes share: argument parsing, tfds loading, the small models, the summary line."""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parser(description: str, epochs: int = 2, batch_size: int = 64) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--steps", type=int, default=None, help="steps per epoch (default: the whole split)")
    p.add_argument("--batch-size", type=int, default=batch_size, help="micro-batch per replica")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def images(name: str, split: str):
    """A tfds image split as (float32 image in [0, 1], label) pairs, unbatched."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    data = tfds.load(name, split=split, as_supervised=True)
    return data.map(lambda x, y: (tf.cast(x, "float32") / 255.0, y), num_parallel_calls=tf.data.AUTOTUNE)


def image_model(shape, classes: int = 10):
    """A small convnet ending in kmp.float32_output (softmax in float32)."""
    import keras

    import kmp

    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    return keras.Model(inputs, kmp.float32_output(keras.layers.Dense(classes)(x), "softmax"))


def fit(model, train, test, args) -> dict:
    """fit() with the loss-scale monitor, evaluate, print one summary line; the numbers."""
    from kmp.callbacks import LossScaleMonitor

    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, steps_per_epoch=args.steps, verbose=2,
                        callbacks=[LossScaleMonitor()])
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(test, steps=args.steps, verbose=0)
    optimizer = model.optimizer
    scale = float(optimizer.dynamic_scale.numpy()) if hasattr(optimizer, "dynamic_scale") else None
    result = {"train_loss": history.history["loss"][-1], "test_loss": loss, "test_accuracy": accuracy,
              "loss_scale": scale, "steps": int(optimizer.iterations.numpy()), "seconds": seconds}
    print(f"test loss {loss:.4f} | test accuracy {accuracy:.4f} | loss scale "
          f"{'none' if scale is None else f'{scale:g}'} | optimizer steps {result['steps']} | {seconds:.1f} s",
          flush=True)
    return result
