"""A DeepSpeed config, as a whole job: DeepSpeedExamples' CIFAR-10 config on tfds cifar10.

    python recipes/deepspeed_config.py [--config path/to/ds_config.json] [--epochs 1]

The default config is DeepSpeedExamples' training/cifar/ds_config.json
(commit 127c7a10983c09be471d51686bc29d0924cdae6b), kept byte for byte in
kmp's corpus of real configs (tests/data/deepspeed_configs, SOURCES.json):
train_batch_size 16, Adam (lr 1e-3, betas 0.8/0.999, weight decay 3e-7),
WarmupLR over 1000 steps, gradient clipping 1.0, fp16 with a dynamic loss
scale from 2**15 (window 500, hysteresis 2). kmp.wrap builds that optimizer,
schedule and loss scaling; kmp.input_pipeline takes the batch arithmetic from
the same file; the keys kmp does not act on are listed once.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "tests", "data", "deepspeed_configs", "dse__training__cifar__ds_config.json")


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0], epochs=1)
    p.add_argument("--config", default=CONFIG, help="a DeepSpeed-style JSON config (default: DeepSpeedExamples' "
                                                   "CIFAR-10 config)")
    args = p.parse_args(argv)
    import keras

    import kmp

    config = kmp.load_config(args.config)
    _, micro, accumulation = kmp.resolve_batch_sizes(config, world_size=1)
    keras.utils.set_random_seed(args.seed)
    with kmp.precision_scope(config):  # the config's fp16 block
        model = shared.image_model((32, 32, 3))
        model.compile(optimizer=kmp.wrap(config=config), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    kmp.prepare(model)
    train = kmp.input_pipeline(shared.images("cifar10", "train"), config, model=model, seed=args.seed)
    test = shared.images("cifar10", "test").batch(micro)
    print(f"{os.path.basename(args.config)}: {config.precision}, micro-batch {micro} x {accumulation}, "
          f"optimizer {type(model.optimizer.inner_optimizer).__name__}", flush=True)
    return shared.fit(model, train, test, args)


if __name__ == "__main__":
    main()
