"""The corpus of real DeepSpeed configs (tests/data/deepspeed_configs) is whole.

These tests check the corpus, not kmp: each file is listed with where it came
from, parses as JSON, and is named after its source. Loading the training
configs with kmp is a separate test.
"""

import functools
import json
import os
import re

import pytest

CORPUS = os.path.join(os.path.dirname(__file__), "data", "deepspeed_configs")
# Files of the corpus's own, not taken from a repository.
OWN = {"SOURCES.json", "README.md", "summarize.py"}
PREFIX = {
    "deepspeedai/DeepSpeed": "deepspeed",
    "deepspeedai/DeepSpeedExamples": "dse",
    "huggingface/accelerate": "accelerate",
    "huggingface/transformers": "transformers",
}
FIELDS = {"file", "repo", "path", "commit", "url", "is_training_config"}


def _records():
    with open(os.path.join(CORPUS, "SOURCES.json")) as f:
        return json.load(f)


RECORDS = _records()


def _id(record):
    return record["file"]


def test_at_least_53_files():
    assert len(RECORDS) >= 53


def test_every_file_present_is_listed_and_every_listed_file_once():
    listed = [r["file"] for r in RECORDS]
    assert len(listed) == len(set(listed))
    present = set(os.listdir(CORPUS)) - OWN - {"__pycache__"}
    assert present == set(listed)


def test_no_two_files_have_the_same_bytes():
    contents = {}
    for record in RECORDS:
        with open(os.path.join(CORPUS, record["file"]), "rb") as f:
            data = f.read()
        assert data not in contents, (record["file"], contents.get(data))
        contents[data] = record["file"]


@pytest.mark.parametrize("record", RECORDS, ids=_id)
def test_record(record):
    assert FIELDS <= set(record), FIELDS - set(record)
    assert re.fullmatch("[0-9a-f]{40}", record["commit"]), record["commit"]
    assert record["repo"] in PREFIX
    assert record["file"] == PREFIX[record["repo"]] + "__" + record["path"].replace("/", "__")
    assert record["url"] == (
        f"https://github.com/{record['repo']}/blob/{record['commit']}/{record['path']}"
    )
    assert isinstance(record["is_training_config"], bool)
    # A file kmp is not meant to train from says why.
    assert record["is_training_config"] or record.get("reason")


@pytest.mark.parametrize("record", RECORDS, ids=_id)
def test_file_parses_as_a_json_object(record):
    with open(os.path.join(CORPUS, record["file"]), "rb") as f:
        config = json.loads(f.read())
    assert isinstance(config, dict)


# --- every training config loads and trains ------------------------------------

TRAINING = [r for r in RECORDS if r["is_training_config"]]
# Files DeepSpeed itself refuses today: kmp's error must name the key.
REFUSED = {
    # torch.optim.SGD takes no betas/eps: DeepSpeed's getattr(torch.optim, "SGD")(**params) fails.
    "dse__resnet__ds_config.json": "optimizer.params.betas",
    # fp16's loss-scale keys in the bf16 block: DeepSpeedBF16Config forbids extra keys
    # (deepspeed/runtime/precision_config.py, config_utils.py extra="forbid" at commit edaa7221).
    "deepspeed__tests__torch_compile__ds_config.json": "bf16.loss_scale",
    # Keys DeepSpeedZeroConfig does not declare, which it forbids too (deepspeed/runtime/zero/config.py at commit
    # 1b88ac36; older DeepSpeed ignored them): misspellings, and a key of PyTorch's DistributedDataParallel.
    # Without that key (as the error says), each file then loads and trains.
    "dse__megatron__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_3_config_release.json":
        "zero_optimization.cpu_offload_params",
    "dse__megatron__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json":
        "zero_optimization.stage3_param_persitence_threshold",
    "dse__Megatron-LM__scripts__ds_zero3_config.json": "zero_optimization.stage3_param_persitance_threshold",
    "dse__Megatron-LM__model_size_test__ds_zero-offload_10B_config.json": "zero_optimization.comm_overlap",
    "transformers__examples__research_projects__wav2vec2__ds_config_wav2vec2_zero2.json":
        "zero_optimization.find_unused_parameters",
}
FILLS = {"total_steps": 10, "warmup_steps": 2}


def _quiet(make):
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return make()


def _setup(record):
    """What the test gives kmp for a file: (path, fills, given, config or None if refused, passed, world).

    `passed` names the optimizer handed to kmp.wrap ("adamw", "sgd" or None: the file's own). `path` is the
    file's path, or for a file refused for one key of zero_optimization, the file without it (a dict).
    """
    import kmp
    from kmp.config.auto import auto_paths

    path = os.path.join(CORPUS, record["file"])
    with open(path) as f:
        raw = json.load(f)
    autos = auto_paths(raw)
    fills = dict(FILLS)
    if "train_micro_batch_size_per_gpu" in autos:
        fills["micro_batch_size"] = 4  # as HF's per_device_train_batch_size would
    given = dict(fills)  # what kmp.wrap is given; it reads the precision from the active policy
    if "fp16.enabled" in autos:
        fills["precision"] = "fp16"
    elif {"bf16.enabled", "bfloat16.enabled"} & set(autos):
        fills["precision"] = "bf16"
    if record["file"] in REFUSED:
        block, _, key = REFUSED[record["file"]].rpartition(".")
        if block != "zero_optimization":
            return path, fills, given, None, None, 1
        path = {**raw, block: {k: v for k, v in raw[block].items() if k != key}}  # the file as its error says
    # What a passed optimizer fills, given to load_config too (as HF's learning_rate, weight_decay, max_grad_norm).
    as_passed = {"learning_rate": 1e-3, "weight_decay": 0.01, "gradient_clipping": 1.0, "betas": (0.9, 0.999),
                 "eps": 1e-7}
    config = _quiet(lambda: kmp.load_config(path, **fills, **as_passed))
    # The optimizer: the file's own; where its params are "auto", one passed to kmp.wrap fills them.
    passed = None
    if config.optimizer is None or any(p.startswith(("optimizer.", "gradient_clipping")) for p in autos):
        passed = "adamw" if config.optimizer else "sgd"
    world = 1
    train, micro, steps = config.train_batch_size, config.micro_batch_size, config.gradient_accumulation_steps
    if train is not None and micro is not None and steps is not None:
        world = train // (micro * steps)  # the data-parallel world the file was written for
    return path, fills, given, config, passed, world


def _path_taken(record) -> tuple:
    """What decides which kmp code a file's training runs: not its numbers (rates, steps, scale windows)."""
    _, _, _, config, passed, world = _setup(record)
    return (config.precision, config.loss_scale.dynamic, config.gradient_clipping is not None,
            (config.gradient_accumulation_steps or 1) > 1, config.communication_data_type,
            config.optimizer and config.optimizer.type, (config.scheduler or {}).get("type"), config.zero_stage > 0,
            config.wall_clock_breakdown, passed, world > 1, config.lower_precision_safe_modules is not None)


@functools.cache
def _trained() -> frozenset:
    """The first file of each distinct training path: the files whose fit() runs. Every file loads and wraps."""
    first = {}
    for record in TRAINING:
        if _setup(record)[3] is not None:
            first.setdefault(_path_taken(record), record["file"])
    return frozenset(first.values())


@pytest.mark.slow
@pytest.mark.parametrize("record", TRAINING, ids=_id)
def test_every_training_config_loads_and_trains(record):
    import keras
    import numpy as np

    import kmp
    from kmp.config.optimizer_block import keras_arguments

    path, fills, given, config, passed, world = _setup(record)
    if record["file"] in REFUSED:
        with pytest.raises(kmp.ConfigError) as info:
            _quiet(lambda: kmp.load_config(os.path.join(CORPUS, record["file"]), **fills))
        assert REFUSED[record["file"]] in [p.path for p in info.value.problems]
        if config is None:
            return
    passed = {"adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01, global_clipnorm=1.0),
              "sgd": lambda: keras.optimizers.SGD(0.01, global_clipnorm=1.0), None: lambda: None}[passed]()
    trains = record["file"] in _trained()  # else an earlier file already trained on this path: load and wrap only
    overrides = {"train_batch_size": config.train_batch_size // world} if world > 1 else {}
    with kmp.precision_scope(config if config.precision != "fp32" else "float32"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        optimizer = _quiet(lambda: kmp.wrap(passed, path, **given, **overrides))
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=8)
        micro, steps = 4, 1  # no batch sizes in the file: fit()'s batch is the step's batch
        if config.train_batch_size or config.micro_batch_size:
            _, micro, steps = kmp.resolve_batch_sizes(
                kmp.Config(train_batch_size=config.train_batch_size and config.train_batch_size // world,
                           micro_batch_size=config.micro_batch_size,
                           gradient_accumulation_steps=config.gradient_accumulation_steps), 1)
        x = np.random.default_rng(0).normal(size=(2 * steps * micro, 4)).astype("float32")
        if trains:
            model.fit(x, x[:, :1], batch_size=micro, epochs=1, verbose=0)
    scaled = isinstance(optimizer, kmp.LossScaleOptimizer)
    inner = optimizer.inner_optimizer if scaled else optimizer
    if trains:
        assert all(np.isfinite(w).all() for w in model.get_weights())
        applied = int(inner.iterations.numpy())
        skipped = int(optimizer.skipped_steps.numpy()) if scaled else 0
        assert applied + skipped == 2  # two optimizer steps of `steps` micro-batches each
    if passed is None:
        assert keras_arguments(config.optimizer)[0] in type(inner).__name__
    if steps > 1:
        assert optimizer.accumulation.initial_steps == steps
    if config.gradient_clipping:  # done by kmp's optimizer, or by the optimizer that already clips so
        assert config.gradient_clipping in ((optimizer.gradient_clipping if scaled else None), inner.global_clipnorm)
