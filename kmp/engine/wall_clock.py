"""DeepSpeed's `wall_clock_breakdown` for fit(): where a train step's time goes.

    kmp.prepare(model, wall_clock_breakdown=10)    # or the config's "wall_clock_breakdown": true
    model.fit(...)  # every 10 steps, on the chief:
    # kmp: steps 1-10 time (ms) | data_wait: 0.21 | fwd_bwd: 3.10 | allreduce: 0.42 | loss_scale: 0.06
    #      | step: 0.95 | other: 0.51 | total: 5.25

Each number is the mean per step over the last N steps, the line laid out as
DeepSpeed's `SynchronizedWallClockTimer.log` prints its timers ("time (ms) |
name: value", deepspeed/utils/timer.py). The same means are in every step's
logs (`wall_clock/<part>_ms`, the latest window's), so they reach History, the
progress bar and Keras's TensorBoard callback (`batch_*` with `update_freq`).

How: `tf.timestamp()` ops (the host's wall clock, the clock of `time.time()`)
are placed in the traced step, each after the values of the part before it:

    start      this replica's step begins (its batch has arrived)
    gradients  forward and backward done (kmp's optimizer receives the gradients)
    reduced    the all-reduce done
    checked    the finite check and the clip factor done       (loss_scale, 1st half)
    updated    the update done (the first weight read back)     (step)
    adjusted   the loss-scale state moved                      (loss_scale, 2nd half)

The step returns the stamps (averaged over replicas by Keras's log reduction);
the train function, timed on the host around each call, takes them out of the
logs. `data_wait` is from the call to `start`: the input fetch and the call's
own dispatch. `other` is the rest of the call (`total` less the parts):
metrics, the logs' copy to the host, Python.

What cannot be cut is said once and counted where it lands:
- A stamp inside an XLA computation is impossible: with the breakdown on, a
  one-device step is not compiled whole (its forward/backward and update stay
  XLA, as under a strategy); TPUStrategy's step is one XLA program, so only
  the call's total is measured there.
- With gradient accumulation the all-reduce, check and update run inside the
  window's branch: they count in `other`.
- With `steps_per_execution` k > 1 one call runs k steps: the parts are the
  last step's, `total` is the call / k, `data_wait` is not separated.
Forward and backward are one XLA computation: DeepSpeed's separate `fwd` and
`bwd` are one `fwd_bwd` here.

Off (the default), nothing of this is traced or run.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from kmp.scaling import overflow

logger = logging.getLogger(__name__)

KEY = "_kmp_wall_clock"  # the step's stamps in its outputs; never reaches a callback
STAMPS = ("start", "gradients", "reduced", "checked", "updated", "adjusted")
PARTS = ("data_wait", "fwd_bwd", "allreduce", "loss_scale", "step", "other", "total")
# Which part the time up to each stamp belongs to (from the stamp before it).
_PART_OF = {"gradients": "fwd_bwd", "reduced": "allreduce", "checked": "loss_scale", "updated": "step",
            "adjusted": "loss_scale"}
# DeepSpeed's long-standing steps_per_print default (deepspeed/runtime/constants.py; its newer
# versions default to None).
DEFAULT_EVERY = 10

_local = threading.local()


def interval(setting) -> int | None:
    """Steps between lines for a `wall_clock_breakdown` setting (False/True/N), None when off."""
    if setting is False or setting is None:
        return None
    return DEFAULT_EVERY if setting is True else int(setting)


# --- In the traced step ---


def stamp(name: str, after=()) -> None:
    """Records the wall clock once the values in `after` exist (no-op unless a step is being timed).

    Variables in `after` are read: the read follows every earlier write of
    the variable in the step (TensorFlow's automatic control dependencies).
    """
    recording = getattr(_local, "recording", None)
    if recording is None or tf.compat.v1.get_default_graph() is not recording["graph"] or overflow.in_xla():
        return  # not timed, inside a branch or another function (cannot leave it), or XLA
    if name in recording["stamps"]:
        return  # the first wins: the train step and the optimizer may both mark the same moment
    deps = [t for v in keras.tree.flatten(after) if v is not None for t in _read(v)]
    with tf.control_dependencies(deps):
        recording["stamps"][name] = tf.timestamp()


def _read(v) -> list:
    if isinstance(v, keras.Variable):
        return [tf.convert_to_tensor(v.value)]
    if isinstance(v, tf.Variable):
        return [v.read_value()]
    return tf.nest.flatten(v, expand_composites=True)  # ragged or sparse: their component tensors


def timed_step(step_function):
    """`step_function` (replica context) with its stamps added to its outputs under KEY."""

    def step(data):
        _local.recording = {"graph": tf.compat.v1.get_default_graph(), "stamps": {}}
        try:
            stamp("start", data)
            stamps = _local.recording["stamps"]
            # No control dependency of the step on `start`: any stamp waiting on the replicas'
            # XLA outputs slows the step (benchmarks/wall_clock_overhead.py). `start` waits for the batch only.
            outputs = step_function(data)
        finally:
            _local.recording = None
        if "start" not in stamps or not isinstance(outputs, dict):
            return outputs  # one XLA computation (TPU), or a custom step's own outputs: only the call is timed
        return {**outputs, KEY: _parts(stamps)}

    step.__wrapped__ = step_function
    return step


def _parts(stamps: dict) -> tf.Tensor:
    """[start (s since the epoch), fwd_bwd, allreduce, loss_scale, step (ms)]; NaN: not separated."""
    ms = {part: [] for part in _PART_OF.values()}
    previous = stamps["start"]
    for name in STAMPS[1:]:
        if name in stamps:
            ms[_PART_OF[name]].append((stamps[name] - previous) * 1e3)
            previous = stamps[name]
    nan = tf.constant(math.nan, tf.float64)
    values = [tf.add_n(ms[p]) if ms[p] else nan for p in PARTS[1:-2]]
    return tf.stack([stamps["start"]] + values)


# --- Around the train function (host) ---


class Breakdown:
    """Times each call of the train function; every `every` steps prints and logs the means."""

    def __init__(self, every: int, steps_per_execution: int, chief: bool):
        self.every, self.steps_per_execution, self.chief = every, steps_per_execution, chief
        self.window, self.steps, self.first = [], 0, 1
        self.means: dict = {}

    def __call__(self, function):
        def call(iterator):
            begin = time.time()
            logs = function(iterator)
            logs = dict(logs)
            stamped = logs.pop(KEY, None)
            if stamped is not None:
                stamped = np.asarray(stamped, np.float64)  # waits for the step: its values are needed
            self.add(begin, time.time(), stamped)
            logs.update(self.means)
            return logs

        call.__wrapped__ = function
        return call

    def add(self, begin: float, end: float, stamped) -> None:
        k = self.steps_per_execution
        total = (end - begin) * 1e3 / k
        parts = np.full(len(PARTS), np.nan)
        parts[-1] = total
        if stamped is not None:
            parts[1:-2] = stamped[1:]
            if k == 1:
                parts[0] = (stamped[0] - begin) * 1e3
        parts[-2] = total - np.nansum(parts[:-2])  # other: what the stamps do not cover
        self.window.append(parts)
        self.steps += k
        if self.steps - self.first + 1 >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self.window:
            return
        means = np.mean(self.window, axis=0)
        self.means = {f"wall_clock/{p}_ms": float(m) for p, m in zip(PARTS, means) if not np.isnan(m)}
        if self.chief:
            print(line(self.first, self.steps, means), flush=True)
        self.window, self.first = [], self.steps + 1


def line(first: int, last: int, means) -> str:
    """The DeepSpeed-style line: `kmp: steps a-b time (ms) | part: mean | ...`."""
    cells = " | ".join(f"{p}: " + ("n/a" if np.isnan(m) else f"{m:.2f}") for p, m in zip(PARTS, means))
    return f"kmp: steps {first}-{last} time (ms) | {cells}"
