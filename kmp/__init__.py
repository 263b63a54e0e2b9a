"""kmp: mixed-precision training for Keras 3 on TensorFlow.

    kmp.set_precision("mixed_float16")
    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), ...)
"""

from kmp import callbacks, distribute
from kmp.config import Communication, Config, LossScaleConfig
from kmp.deepspeed import load_config, resolve_batch_sizes, to_deepspeed
from kmp.backup import BackupError
from kmp.errors import ConfigError, KmpError, LossScaleError
from kmp.optimizer import LossScaleOptimizer
from kmp.overflow_layer import find_overflow
from kmp.precision import (
    Hardware,
    Precision,
    check_hardware,
    float32_output,
    precision_scope,
    resolve_precision,
    set_precision,
)
from kmp.distribute import prepare, resolve_strategy
from kmp.wrap import wrap

__version__ = "0.1.0"

__all__ = [
    "BackupError",
    "Communication",
    "Config",
    "ConfigError",
    "Hardware",
    "KmpError",
    "LossScaleConfig",
    "LossScaleError",
    "LossScaleOptimizer",
    "Precision",
    "callbacks",
    "distribute",
    "check_hardware",
    "find_overflow",
    "float32_output",
    "load_config",
    "precision_scope",
    "prepare",
    "resolve_batch_sizes",
    "resolve_precision",
    "resolve_strategy",
    "set_precision",
    "to_deepspeed",
    "wrap",
]
