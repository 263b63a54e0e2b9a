"""Fine-tune a keras-hub causal language model in mixed precision from a Hugging Face DeepSpeed config.

    python recipes/causal_lm.py [--cpus 2] [--config ds_config.json] [--preset DIR_OR_NAME] [--epochs 1]
    kmp launch --workers 2 recipes/causal_lm.py

The default config is Hugging Face's DeepSpeed ZeRO-2 template,
transformers' tests/deepspeed/ds_config_zero2.json (commit
00e12e7c54598e50e7bef1540db3408f81916de1), kept byte for byte in kmp's
corpus of real configs (tests/data/deepspeed_configs, SOURCES.json): AdamW,
WarmupLR, fp16 with a dynamic loss scale from 2**16 (window 1000,
hysteresis 2), ZeRO stage 2 with CPU offload, and "auto" for everything its
Trainer fills. kmp fills those from this script's arguments (--precision,
--batch-size, --learning-rate, --weight-decay, --gradient-clipping, the
warmup and total steps, the replicas) and prints them once (a value the
file writes wins over the flag); ZeRO stage 2 loads as kmp's stage 1
(docs/zero.md) and the offload is said once and not done. `--config PATH`
takes another file. One resolved config feeds kmp.wrap (optimizer,
schedule, loss scaling, clipping) and kmp.input_pipeline (batch arithmetic).

The model is a tiny GPT-2 built from a config (keras_hub.models.GPT2Backbone,
random weights): nothing is downloaded. `--preset` fine-tunes a keras-hub
preset instead when its files are on this machine: a preset directory, or a
preset name (or kaggle:// handle) already in the kagglehub cache. A preset
that is not says so in one line and the tiny GPT-2 trains instead.

The text is tokenized without a downloaded vocabulary: the tiny model reads
UTF-8 bytes (vocabulary 256); a local preset uses its own tokenizer from its
directory. Each review becomes `--length` tokens, inputs {"token_ids",
"padding_mask"}, the next token as label, weighted by the padding mask.

Strategy: under `kmp launch` (TF_CONFIG names several workers)
MultiWorkerMirroredStrategy, one replica per worker; otherwise
MirroredStrategy over the local GPUs, or over `--cpus N` logical CPU
devices (`--cpus 1`: one device, the default strategy).
`--batch-size` is the micro-batch per replica.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "tests", "data", "deepspeed_configs", "transformers__tests__deepspeed__ds_config_zero2.json")
TINY = dict(vocabulary_size=256, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128, dropout=0.0)


def local_preset(preset: str) -> str | None:
    """The local directory holding `preset`, or None: never downloads.

    A directory is itself. A keras-hub preset name or kaggle:// handle is
    local when the kagglehub cache holds that version complete, or its
    config.json and model.weights.h5 (kagglehub's own cache lookup, no
    request).
    """
    if os.path.isdir(preset):
        return preset
    import keras_hub
    from kagglehub.cache import Cache
    from kagglehub.handle import parse_model_handle

    handle = keras_hub.models.CausalLM.presets.get(preset, {}).get("kaggle_handle", preset)
    if not handle.startswith("kaggle://"):
        return None
    try:
        handle = parse_model_handle(handle.removeprefix("kaggle://"))
    except ValueError:
        return None
    if not handle.is_versioned():  # the latest version needs a request to name it
        return None
    cache = Cache()
    if cache.load_from_cache(handle):  # the whole version, as kagglehub.model_download(handle) leaves it
        return cache.get_path(handle)
    if all(cache.load_from_cache(handle, name) for name in ("config.json", "model.weights.h5")):
        return cache.get_path(handle)  # file by file, as keras-hub's from_preset leaves it
    return None


def byte_tokens(length: int):
    """texts -> ({"token_ids", "padding_mask"}, next byte, weight): UTF-8 bytes, no vocabulary to download."""
    import keras_hub
    import tensorflow as tf

    tokenizer = keras_hub.tokenizers.ByteTokenizer(sequence_length=length + 1)  # pads with 0

    def encode(texts):
        ids = tokenizer(texts)
        mask = tf.sequence_mask(tf.minimum(tf.strings.length(texts), length + 1), length + 1)
        return ({"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, ids[:, 1:], tf.cast(mask[:, 1:], "float32"))

    return encode


def _strategy(cpus: int):
    import tensorflow as tf

    import kmp

    if os.environ.get("TF_CONFIG"):  # kmp launch, or a cluster: MultiWorkerMirroredStrategy over its workers
        return kmp.resolve_strategy("auto")
    if tf.config.list_physical_devices("GPU"):
        return kmp.resolve_strategy("mirrored")
    if cpus == 1:
        return kmp.resolve_strategy("default")
    try:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpus)
    except RuntimeError:
        print("the runtime is already initialized: its devices stay as they are", flush=True)
    return kmp.resolve_strategy("mirrored")


def main(argv: list[str] | None = None) -> dict:
    p = shared.parser(__doc__.split("\n\n")[0], epochs=1, batch_size=8)
    p.add_argument("--config", default=CONFIG, help="a DeepSpeed / Hugging Face JSON config (default: Hugging "
                                                   "Face's ds_config_zero2.json)")
    p.add_argument("--preset", default=None, help="a keras-hub preset directory or name, used if present locally")
    p.add_argument("--precision", choices=["fp16", "bf16"], default="fp16", help="fills the config's \"auto\"")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--gradient-clipping", type=float, default=1.0, help="0: none (Hugging Face's default: 1.0)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of the steps")
    p.add_argument("--no-xla", action="store_true", help="compile the steps without XLA (starts sooner; slower steps)")
    p.add_argument("--cpus", type=int, default=2, help="logical CPU devices when there is no GPU (default 2)")
    args = p.parse_args(argv)
    import keras
    import keras_hub
    import tensorflow as tf
    import tensorflow_datasets as tfds

    import kmp

    strategy = _strategy(args.cpus)
    replicas = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(args.seed)
    train_text = tfds.load("imdb_reviews", split="train", as_supervised=True)

    def whole_split(batch: int) -> int:
        return int(train_text.cardinality()) // batch  # tfds knows each split's size

    # The schedule's step counts, for the flags' batch: "auto" in Hugging Face's config.
    total = (args.steps or whole_split(args.batch_size * replicas)) * args.epochs
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total // 10)
    config = kmp.load_config(args.config, precision=args.precision, micro_batch_size=args.batch_size,
                             replicas=replicas, total_steps=total, warmup_steps=warmup,
                             learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                             betas=(0.9, 0.999), eps=1e-8, gradient_clipping=args.gradient_clipping)
    train_batch, micro, accumulation = kmp.resolve_batch_sizes(config, world_size=replicas)
    steps = args.steps or whole_split(train_batch)  # optimizer steps per epoch

    directory = local_preset(args.preset) if args.preset else None
    if args.preset and directory is None:
        print(f"preset {args.preset!r} is not available offline (no such directory, not in the kagglehub "
              "cache): using the tiny GPT-2 config", flush=True)
    with kmp.precision_scope(config), strategy.scope():
        if directory:
            model = keras_hub.models.CausalLM.from_preset(directory, preprocessor=None,
                                                          dtype=keras.config.dtype_policy().name)
            preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(directory, sequence_length=args.length)
            encode, described = preprocessor, f"preset {directory}"
        else:
            backbone = keras_hub.models.GPT2Backbone(max_sequence_length=args.length, **TINY)
            model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
            encode = byte_tokens(args.length)
            described = (f"tiny GPT-2 ({TINY['num_layers']} layers, hidden {TINY['hidden_dim']}, "
                         f"vocabulary {TINY['vocabulary_size']} bytes)")
        model.compile(optimizer=kmp.wrap(config=config), loss="auto", weighted_metrics="auto")
    kmp.prepare(model, jit_compile=False if args.no_xla else "auto")

    def texts(split):
        data = train_text if split == "train" else tfds.load("imdb_reviews", split=split, as_supervised=True)
        # Tokenized a batch at a time (a preset's tokenizer is much faster so), handed on one example each.
        data = data.map(lambda text, _: text).batch(256)
        return data.map(encode, num_parallel_calls=tf.data.AUTOTUNE).unbatch()

    train = kmp.input_pipeline(texts("train"), config, model=model, seed=args.seed)
    test = kmp.input_pipeline(texts("test"), config, model=model, shuffle=None)
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    name = type(strategy).__name__
    default = name == "_DefaultDistributionStrategy"
    where = "one device (the default strategy)" if default else f"{name}, {replicas} replicas"
    print(f"{where} | {described}, {model.count_params():,} parameters, "
          f"{model.dtype_policy.name}", flush=True)
    print(f"{os.path.basename(args.config)}: {config.precision}, batch {train_batch} = micro-batch {micro} x "
          f"{accumulation} x {replicas} replicas, {type(inner).__name__} lr {config.optimizer.params['lr']:g}, "
          f"warmup {warmup} of {total} steps, sequence {args.length}", flush=True)
    args.steps = steps * accumulation  # fit() counts micro-batches
    return {**shared.fit(model, train, test, args), "replicas": replicas, "preset": directory,
            "train_batch_size": train_batch, "precision": config.precision}


if __name__ == "__main__":
    main()
