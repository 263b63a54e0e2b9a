"""kmp.distribute: tf.distribute strategies, done right for mixed precision.

    strategy.py       resolve_strategy: which strategy the machine and cluster call for
    communication.py  all_reduce_sum: the gradient all-reduce, flat buckets, wire dtype
    fit.py            prepare(model): fit() under strategies (multi-worker, steps_per_execution)
    replica_step.py   the per-replica XLA train step that prepare() installs
    tpu.py            tpu_settings: bfloat16, steps per execution, padded sizes (seams only)

Everything users type is re-exported here; the modules' other names are private.
"""

from kmp.distribute.communication import all_reduce_sum
from kmp.distribute.fit import is_prepared, local_batch, prepare
from kmp.distribute.strategy import STRATEGIES, resolve_strategy, strategy_from_config
from kmp.distribute.tpu import (
    TPU_STEPS_PER_EXECUTION,
    TPU_TILE,
    TpuSettings,
    is_tpu_strategy,
    padded_sizes,
    tpu_settings,
)

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
