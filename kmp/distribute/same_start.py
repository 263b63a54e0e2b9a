"""Variables that start the same on every worker, made without TensorFlow's broadcast of their initial value.

    with same_start(strategy):
        codes = tf.Variable(tf.zeros([n], tf.uint8))   # zeros on every worker: nothing to broadcast

MultiWorkerMirroredStrategy broadcasts each new variable's initial value
from the chief (CollectiveAllReduceExtended._get_variable_creator_initial_value,
a CollectiveBcastSend), so that random initializers agree between workers.
That broadcast takes bool, half, float, double, int32 and int64 only: the
uint8 codes of kmp's 8-bit states could not be made under several workers
at all. Their initial value is zeros, the same on every worker by
construction, so they need no broadcast: inside `same_start` the strategy
makes each variable's components as MirroredStrategy does, from the local
value.

Every worker must make the same variables inside it (each skips the same
broadcasts, so their collective instance keys stay in step), and only with
initial values that do not depend on the worker.
"""

from __future__ import annotations

import contextlib
import functools

from kmp import seams

_SWAPPED = "_get_variable_creator_initial_value"


@contextlib.contextmanager
def same_start(strategy):
    """Variables made inside take their local initial value on every worker (see the module docstring)."""
    extended = strategy.extended
    if not seams.get("collective_all_reduce_multi_worker")(strategy) or _SWAPPED in vars(extended):
        yield  # one worker (or another strategy): no broadcast to skip; or inside another same_start
        return
    # MirroredStrategy's own rule (the first component from the local value, the others
    # copied from it), on this instance only, for as long as the block runs.
    setattr(extended, _SWAPPED, functools.partial(getattr(seams.get("MirroredExtended"), _SWAPPED), extended))
    try:
        yield
    finally:
        delattr(extended, _SWAPPED)
