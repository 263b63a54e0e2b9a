"""kmp: mixed-precision training for Keras 3 on TensorFlow.

    kmp.set_precision("mixed_float16")
    model.compile(optimizer=kmp.wrap(keras.optimizers.AdamW(1e-3)), ...)

The public names are imported when first used (PEP 562), so `import kmp`
costs milliseconds and imports no TensorFlow: `kmp --help`, `kmp --version`
and reading a config (`kmp.load_config`) stay fast and quiet. The first
`kmp.wrap`, `kmp.callbacks`, ... imports TensorFlow and Keras as before.
"""

import importlib
import importlib.util
import sys

# The one place the version is written: setup.cfg reads it (`attr: kmp.__version__`).
__version__ = "0.1.0"

# Public name -> the module that defines it. `callbacks` and `distribute` are
# the subpackages themselves.
_HOMES = {
    "Adam8bit": "kmp.scaling.eight_bit",
    "AdamW8bit": "kmp.scaling.eight_bit",
    "BackupError": "kmp.callbacks.backup",
    "Communication": "kmp.config.settings",
    "Config": "kmp.config.settings",
    "ConfigError": "kmp.errors",
    "Hardware": "kmp.precision",
    "KmpError": "kmp.errors",
    "LossScaleConfig": "kmp.config.settings",
    "LossScaleError": "kmp.errors",
    "LossScaleOptimizer": "kmp.scaling.optimizer",
    "MemoryEstimate": "kmp.memory.estimate",
    "Precision": "kmp.precision",
    "add_config_arguments": "kmp.config.arguments",
    "find_overflow": "kmp.engine.overflow_layer",
    "callbacks": None,
    "distribute": None,
    "check_hardware": "kmp.precision",
    "float32_output": "kmp.precision",
    "input_pipeline": "kmp.data.pipeline",
    "load_config": "kmp.config.deepspeed",
    "measured_bytes": "kmp.memory.allocation",
    "StepRecorder": "kmp.callbacks.plot",
    "plot_run": "kmp.callbacks.plot",
    "memory_estimate": "kmp.memory.estimate",
    "precision_scope": "kmp.precision",
    "prepare": "kmp.engine.prepare",
    "resolve_batch_sizes": "kmp.config.deepspeed",
    "resolve_precision": "kmp.precision",
    "resolve_strategy": "kmp.distribute.strategy",
    "set_precision": "kmp.precision",
    "to_deepspeed": "kmp.config.deepspeed",
    "wrap": "kmp.scaling.wrap",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        home = _HOMES[name]
        module = importlib.import_module(f"kmp.{name}" if home is None else home)
        value = module if home is None else getattr(module, name)
    elif importlib.util.find_spec(f"kmp.{name}") is not None:
        # A private module reached as an attribute (`kmp.seams`), as after
        # the eager import this package used to do.
        value = importlib.import_module(f"kmp.{name}")
    else:
        raise AttributeError(f"module 'kmp' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Keras finds kmp's classes in a .keras file only once their modules have
# registered them (Keras imports no outside module while loading). Those
# modules import Keras, so they are imported as soon as Keras is: now, if it
# already is (`import keras, kmp`), else by an import hook once `import keras`
# has run and no kmp module is half-imported. A kmp module that imports Keras
# first (kmp.precision) must finish before the registering modules, which
# import it back, can run. `kmp --help` and `kmp config check` import neither.
_REGISTERING = ("kmp.scaling.optimizer", "kmp.schedules.momentum", "kmp.schedules.keras", "kmp.scaling.eight_bit")


def _register_with_keras() -> None:
    for module in _REGISTERING:
        importlib.import_module(module)


class _AfterKeras:
    """A meta path finder: lets `keras` and kmp's modules load as usual, then registers, once.

    Registration waits until Keras is loaded and the outermost kmp module
    being imported has finished (`_depth` counts kmp modules mid-import).
    """

    _keras_loaded = False
    _depth = 0

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "keras" and not name.startswith("kmp."):
            return None
        spec = next((found for finder in sys.meta_path if finder is not cls and hasattr(finder, "find_spec")
                     for found in [finder.find_spec(name, path, target)] if found is not None), None)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            cls._depth += name != "keras"
            try:
                load(module)
            finally:
                cls._depth -= name != "keras"
            cls._keras_loaded |= name == "keras"
            if cls._keras_loaded and cls._depth == 0 and cls in sys.meta_path:
                sys.meta_path.remove(cls)
                _register_with_keras()

        spec.loader.exec_module = exec_module
        return spec


if "keras" in sys.modules:
    _register_with_keras()
else:
    sys.meta_path.insert(0, _AfterKeras)
