"""The floor check from the loss-scale state, after an execution of the train function.

A step stuck at the floor raises inside the step where it can (kmp.scaling.overflow's assert). Where it
cannot, the step is skipped, the weights stay finite, and the state tells afterwards:

- XLA compiles the assert away;
- a model's first train function call may trace the step before kmp's optimizer could wrap that call
  (kmp.scaling.overflow.raise_floor_errors_in): the call in progress then runs without the assert, so it ends
  normally, and the wrapper checks it before the next call (or fit() at its end).

From the state before and after an execution of `k <= steps_per_execution` steps (kmp.scaling.state):

    overflows = after.overflows - before.overflows
    clean     = after.iterations - before.iterations  # skipped steps do not count
    if overflows and before.scale <= min_scale and before.hysteresis_left <= 1:
        if after.good_steps == clean:          # the execution began with an overflow
            raise LossScaleError
        if no clean step in it could grow the scale or refill hysteresis:
            raise LossScaleError               # every overflow in it was at the floor

With `steps_per_execution=1` this is exact. With more, it raises only when
certain: a stuck step that follows a clean step able to grow the scale or
refill the hysteresis in the same execution goes unreported (the state alone
cannot tell it from an overflow after a growth). If the overflows persist, the
next execution that begins with one is reported.

Cost: nothing while the floor is out of reach. The state is copied to the
host (one stacked copy) only after executions that could hold a stuck step:
those that start fewer than `steps_per_execution` overflows away from the
floor, counted from the last state read (`steps_clear_of_floor`); before such
an execution, a device snapshot of the state (no host copy) is its start.
"""

from __future__ import annotations

import tensorflow as tf

from kmp.errors import LossScaleError
from kmp.scaling import state as loss_scale
from kmp.scaling.state import WindowState, steps_clear_of_floor, stuck_in_window

# Log key -> optimizer attribute: everything the check reads (kmp's optimizer).
CHECKED = {"loss_scale": "dynamic_scale", "hysteresis_left": "hysteresis_left", "overflows": "overflows",
           "skipped_steps": "skipped_steps", "good_steps": "good_steps", "iterations": "iterations"}


def to_host(tensors: list) -> list[float]:
    """Scalars to Python floats in one device-to-host copy."""
    if not tensors:
        return []
    return tf.stack([tf.cast(t, tf.float64) for t in tensors]).numpy().tolist()


class FloorCheck:
    """Checks one optimizer's state after each execution of a train function.

    `known` is the host state at the start of the next execution, or of an
    earlier one when `unchecked_steps` steps have run since without a read;
    then `before` holds a device snapshot of the next execution's start, taken
    only when that execution could be stuck. `unseen`: an execution ran from
    `known` before this check could follow it (`settle` checks it).
    """

    def __init__(self, optimizer, steps_per_execution: int, unseen: bool = False):
        self.optimizer = optimizer
        config = getattr(optimizer, "loss_scale_config", None)  # kmp's optimizer only
        self.config = config if config is not None and config.dynamic and config.raise_at_min_scale else None
        self.steps_per_execution = steps_per_execution
        self.unchecked_steps, self.before = 0, None
        self.known = None if self.config is None else self.read_state()  # the state the next execution starts from
        self.unseen = unseen and self.config is not None

    def snapshot(self, names: dict[str, str]) -> dict:
        """Device copies of the variables that exist (all of them once built)."""
        found = {key: getattr(self.optimizer, attr, None) for key, attr in names.items()}
        return {key: tf.convert_to_tensor(v) for key, v in found.items() if v is not None}

    def read_state(self) -> WindowState:
        """The state now, on the host (eagerly: under tf.init_scope while tracing)."""
        if self.optimizer.built:
            return _window_state(_to_host(self.snapshot(CHECKED))[0])
        # Built inside the first step (TensorFlow without a distribution strategy): it starts from the config.
        start = loss_scale.initial_state(self.config)
        iterations = int(to_host([tf.convert_to_tensor(self.optimizer.iterations)])[0])
        return WindowState(start.scale, start.hysteresis_left, 0, 0, iterations)

    def after_execution(self, logged: dict | None = None) -> dict:
        """Checks the execution that just ran; raises kmp.LossScaleError if it was stuck.

        `logged`: device snapshots the caller takes anyway (kmp.callbacks' logs), returned as Python numbers
        when the state was read (Keras then copies nothing), else as they are.
        """
        logged = {} if logged is None else logged
        if self.config is None or not self.optimizer.built:
            return logged
        if self.known is None:  # refreshed: the state may have been written (restored, assigned) since
            self.known = self.read_state()
            return logged
        if self._may_be_stuck():
            logged = self._check(logged)
        else:
            self.unchecked_steps += self.steps_per_execution
        if self.unchecked_steps and self._may_be_stuck():
            self.before = self.snapshot(CHECKED)
        return logged

    def settle(self) -> None:
        """Checks the execution that ran before this check could follow it, if one did."""
        if self.unseen:
            self.unseen = False
            self.after_execution()

    def refresh(self) -> None:
        """Reads the state anew before the next execution (a new fit(): something may have restored it), where
        the state last read was within reach of the floor: a stale state there could raise for nothing. Far
        from it a stale state only delays a read (an execution's start is then a device snapshot)."""
        self.settle()
        if self.known is not None and self._may_be_stuck():
            self.known, self.unchecked_steps, self.before = None, 0, None

    def start(self) -> None:
        """Before an execution: reads the state if it was refreshed."""
        if self.known is None and self.config is not None:
            self.known = self.read_state()

    def _may_be_stuck(self) -> bool:
        """Whether the next execution could hold a stuck step."""
        margin = steps_clear_of_floor(self.config, self.known.scale, self.known.hysteresis_left)
        return self.unchecked_steps + self.steps_per_execution > margin

    def _check(self, logged: dict) -> dict:
        """Reads the state after this execution, raises if it was stuck, and
        returns the logged values as Python numbers."""
        after = logged | self.snapshot({k: v for k, v in CHECKED.items() if k not in logged})
        if self.unchecked_steps:
            after_values, before_values = _to_host(after, self.before)
            before = _window_state(before_values)
        else:
            (after_values,), before = _to_host(after), self.known
        self.known = _window_state(after_values)
        self.unchecked_steps, self.before = 0, None
        if stuck_in_window(self.config, before, self.known):
            raise LossScaleError(loss_scale.floor_message(before.scale, self.config))
        return {key: after_values.get(key, logged.get(key)) for key in logged}


def _to_host(*snapshots: dict) -> list[dict[str, float]]:
    """Full snapshots (all of CHECKED) as Python numbers, in one copy."""
    host = to_host([snapshot[key] for snapshot in snapshots for key in CHECKED])
    n = len(CHECKED)
    return [dict(zip(CHECKED, host[i:i + n])) for i in range(0, len(host), n)]


def _window_state(v: dict[str, float]) -> WindowState:
    return WindowState(
        v["loss_scale"], int(v["hysteresis_left"]), int(v["good_steps"]), int(v["overflows"]), int(v["iterations"])
    )
