"""kmp: mixed-precision training for Keras 3 on TensorFlow."""

from kmp.config import Config, LossScaleConfig
from kmp.errors import ConfigError, KmpError, LossScaleError

__all__ = [
    "Config",
    "ConfigError",
    "KmpError",
    "LossScaleConfig",
    "LossScaleError",
]
