"""kmp.input_pipeline: an unbatched `tf.data.Dataset` -> what `fit()` should get, for the strategy and the config.

    train = tfds.load("mnist", split="train", as_supervised=True)
    model.fit(kmp.input_pipeline(train, "ds_config.json", model=model), epochs=3)

DeepSpeed's batch arithmetic (kmp.resolve_batch_sizes, the strategy's
replicas as its world size):

    train_batch_size = micro_batch_size * gradient_accumulation_steps * replicas

One call of Keras's train step takes one micro-batch on every replica, and
Keras splits each batch it is given across the replicas of all workers; so
the dataset is batched by `micro_batch_size * replicas` (the per-step global
batch), and `gradient_accumulation_steps` of those make one optimizer step
(kmp's optimizer counts them). What else is done, and why:

    shuffle(buffer, seed)     a fixed seed: every worker draws the same order, so the
                              global batches do not depend on how many workers there are
    batch(drop_remainder)     True by default: XLA compiles one shape, and every replica
                              gets an equal share (a short last batch cannot split evenly)
    auto_shard_policy = DATA  every worker reads the stream and keeps its share of each
                              global batch (TensorFlow's multi-worker guide: FILE sharding
                              needs at least as many files as workers, evenly sized)
    prefetch(AUTOTUNE)        the next batch is made while this step runs

Disagreements are one `kmp.ConfigError` each, before training: batch sizes
that do not multiply out, a model whose optimizer accumulates a different
number of micro-batches, a dataset that is already batched, fewer examples
than one global batch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import tensorflow as tf

from kmp.config.deepspeed import load_config, resolve_batch_sizes
from kmp.config.settings import Config
from kmp.errors import Problem, check

AUTOTUNE = tf.data.AUTOTUNE


def input_pipeline(dataset: tf.data.Dataset, config: Config | Mapping[str, Any] | str | os.PathLike | None = None, *,
                   micro_batch_size: int | None = None, gradient_accumulation_steps: int | None = None,
                   train_batch_size: int | None = None, strategy: tf.distribute.Strategy | None = None,
                   model=None, shuffle: int | None = 10_000, seed: int = 0, drop_remainder: bool = True,
                   shard_policy=tf.data.experimental.AutoShardPolicy.DATA) -> tf.data.Dataset:
    """The dataset for `model.fit()`: shuffled, batched by the per-step global batch, sharded, prefetched.

    Args:
        dataset: one example per element, e.g. `tfds.load(..., as_supervised=True)`.
        config: a kmp.Config or a DeepSpeed-style config (dict, JSON path);
            its batch sizes. Keyword batch sizes override it.
        strategy: default the model's, else the current one (`strategy.scope()`).
        model: if given, its strategy, and its optimizer's accumulation steps are checked.
        shuffle: the shuffle buffer (None: no shuffle); seeded with `seed`.
    """
    if strategy is None:  # the model's, if given: it is where fit() will split the batches
        strategy = model.distribute_strategy if model is not None else tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    settings = _settings(config, micro_batch_size, gradient_accumulation_steps, train_batch_size)
    _, micro, accumulation = resolve_batch_sizes(settings, world_size=replicas)
    global_batch = micro * replicas
    problems = []
    if not isinstance(dataset, tf.data.Dataset):
        problems.append(Problem("dataset", "a tf.data.Dataset of single examples", type(dataset).__name__,
                                "Wrap arrays with tf.data.Dataset.from_tensor_slices((x, y))."))
    elif (batched := _batched_by(dataset)) is not None:
        problems.append(Problem("dataset", "an unbatched dataset (one example per element)",
                                f"a dataset batched by {batched}",
                                f"Pass it from before .batch() (or .unbatch() it): kmp batches by {micro} x "
                                f"{replicas} replicas = {global_batch} per step."))
    own = _accumulation_of(model)
    if own is not None and own != accumulation:
        problems.append(Problem(
            "gradient_accumulation_steps", f"the model's optimizer's value, {own}", accumulation,
            "Use the same config (or value) for kmp.wrap and kmp.input_pipeline."))
    check(problems, "kmp.input_pipeline arguments")
    size = int(dataset.cardinality())
    if drop_remainder and size >= 0 and size < global_batch:
        check([Problem("dataset", f"at least one global batch of {global_batch} examples "
                       f"({micro} per replica x {replicas} replicas)", f"{size} examples",
                       "With drop_remainder=True no step would run: a smaller micro_batch_size, or more data.")],
              "kmp.input_pipeline arguments")
    if shuffle:
        dataset = dataset.shuffle(shuffle, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(global_batch, drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = shard_policy
    return dataset.with_options(options).prefetch(AUTOTUNE)


def _settings(config, micro, accumulation, train) -> Config:
    if config is None:
        settings = Config()
    elif isinstance(config, Config):
        settings = config
    else:
        settings = load_config(config)
    given = {k: v for k, v in (("micro_batch_size", micro), ("gradient_accumulation_steps", accumulation),
                               ("train_batch_size", train)) if v is not None}
    if given:
        settings = dataclasses.replace(settings, **given)
    return settings


def _batched_by(dataset: tf.data.Dataset) -> str | None:
    """The batching op upstream of `dataset` that no unbatch undoes, or None.

    Walks the pipeline through `Dataset._inputs()` (private; kmp/seams.py
    lists it): shapes alone cannot tell, since an example may itself have a
    leading None (a token sequence).
    """
    pending = [dataset]
    while pending:
        node = pending.pop()
        name = type(node).__name__
        if name == "_UnbatchDataset":
            continue
        if name.endswith("BatchDataset") or name == "_DenseToRaggedDataset":
            return name.strip("_")
        pending.extend(node._inputs())
    return None


def _accumulation_of(model) -> int | None:
    accumulation = getattr(getattr(model, "optimizer", None), "accumulation", None)
    if model is None:
        return None
    if accumulation is None:
        return 1
    return int(getattr(accumulation, "initial_steps", 1))
