"""kmp.distribute: tf.distribute strategies, done right for mixed precision.

    strategy.py       resolve_strategy: which strategy the machine and cluster call for
    leaving.py        leave_last: a multi-worker job's tasks leave together at exit, its leader last
    communication.py  all_reduce_sum: the gradient all-reduce, flat buckets, wire dtype
    scatter.py        the flat gradient's reduce-scatter and gather (ZeRO stage 1)
    same_start.py     variables made alike on every worker
    tpu.py            tpu_settings: bfloat16, steps per execution, padded sizes (seams only)

A leaf below kmp.scaling and kmp.engine: may import kmp.config, kmp.precision
and the leaves, never kmp.scaling, kmp.engine, kmp.memory, kmp.callbacks or
kmp.cli. `prepare`, `is_prepared` and `local_batch` live in kmp.engine.prepare
and are reached here when first used (PEP 562), so importing a module of this
package does not import the engine. Everything users type is named here; the
modules' other names are private.
"""

import importlib

from kmp.distribute.communication import all_reduce_sum
from kmp.distribute.strategy import STRATEGIES, resolve_strategy, strategy_from_config
from kmp.distribute.tpu import (TPU_STEPS_PER_EXECUTION, TPU_TILE, TpuSettings, is_tpu_strategy, padded_sizes,
                                tpu_settings)

# Names defined above this package (kmp.engine imports kmp.distribute).
_LATER = {"is_prepared": "kmp.engine.prepare", "local_batch": "kmp.engine.prepare", "prepare": "kmp.engine.prepare"}

__all__ = [
    "STRATEGIES",
    "TPU_STEPS_PER_EXECUTION",
    "TPU_TILE",
    "TpuSettings",
    "all_reduce_sum",
    "is_prepared",
    "is_tpu_strategy",
    "local_batch",
    "padded_sizes",
    "prepare",
    "resolve_strategy",
    "strategy_from_config",
    "tpu_settings",
]


def __getattr__(name: str):
    if name not in _LATER:
        raise AttributeError(f"module 'kmp.distribute' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LATER[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
