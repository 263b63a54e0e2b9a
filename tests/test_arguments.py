"""kmp.add_config_arguments: kmp's flags on a user's parser, and kmp.wrap reading the parsed namespace."""

import argparse
import json

import keras
import pytest

import kmp
from kmp.config.arguments import add_config_arguments


def _parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)  # the user's own flags stay
    return add_config_arguments(parser)


def test_flags_and_defaults():
    args = _parser().parse_args([])
    assert args.epochs == 3 and args.kmp_config is None and args.precision is None and args.strict_config is False
    args = _parser().parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--micro-batch-size", "8",
                                 "--total_steps", "100", "--strict-config"])
    assert (args.kmp_config, args.micro_batch_size, args.total_steps, args.strict_config) == ("ds.json", 8, 100, True)


def test_wrap_reads_the_namespace(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
                                "fp16": {"enabled": "auto", "hysteresis": 3},
                                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}))
    args = _parser().parse_args(["--kmp_config", str(path), "--precision", "mixed_float16",
                                 "--micro_batch_size", "8", "--warmup_steps", "5"])
    keras.config.set_dtype_policy("mixed_float16")
    try:
        optimizer = kmp.wrap(keras.optimizers.SGD(0.1), args)
    finally:
        keras.config.set_dtype_policy("float32")
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert optimizer.loss_scale_config.hysteresis == 3 and optimizer.accumulation.initial_steps == 4
    assert "warmup_num_steps" in capsys.readouterr().out  # the filled values, printed once


def test_strict_from_the_namespace(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"cuda_visible_devices": "0"}))
    args = _parser().parse_args(["--kmp_config", str(path), "--strict_config"])
    with pytest.raises(kmp.ConfigError, match="cuda_visible_devices"):
        kmp.wrap(keras.optimizers.SGD(0.1), args)
    with pytest.warns(UserWarning, match="cuda_visible_devices"):
        kmp.wrap(keras.optimizers.SGD(0.1), _parser().parse_args(["--kmp_config", str(path)]))
