"""Training callbacks. `LossScaleMonitor`: the loss-scale state in the logs,
and the floor check (kmp.scaling.floor) while it is installed.

    model.fit(data, callbacks=[kmp.callbacks.LossScaleMonitor(), keras.callbacks.TensorBoard("logs")])

Why the monitor adds its values where the logs are made
-------------------------------------------------------
In Keras 3.15 (`keras/src/callbacks/callback_list.py`) every event builds one
fresh dict of Python floats and hands that same dict to the callbacks in list
order; the `History` and the progress bar are appended after the user's
callbacks, and no callback can reach its siblings (the list lives inside
`fit()`). A callback that writes into that dict is seen only by the callbacks
after it: a `TensorBoard`, `CSVLogger` or `History` placed before it misses
the values. So, for the duration of `fit()`, the monitor wraps
`model.train_function` (built before `on_train_begin`) and adds the state to
the logs that function returns. Every callback, wherever it sits, then sees
`loss_scale`, `overflows`, `skipped_steps` and (kmp's optimizer only)
`hysteresis_left`: the progress bar, `History.history` (the state after each
epoch's last step), TensorBoard's `epoch_*` and, with `update_freq="batch"` or
an int, `batch_*` scalars, `EarlyStopping(monitor="loss_scale")`.
`on_train_end` puts the original function back. With more keys in the step's
logs than `model.metrics` has, Keras takes the epoch logs from the last step's
logs instead of asking the metrics again; on TensorFlow these are the same
values (a train step returns `get_metrics_result()`).

Keras's `TensorBoard` callback needs the `tensorboard` package for its
scalars, which TensorFlow 2.21 no longer installs: `pip install
"kmp[tensorboard]"` (tests/test_callbacks.py reads its event files back).

Cost: after each execution of the training function the monitor takes device
snapshots of the scalars (no host copy); Keras copies them to the host with
the loss, in the conversion it already does after every batch (synchronously:
on TensorFlow Keras dispatches no callback asynchronously). The floor check
(kmp.scaling.floor, kmp's optimizer with a dynamic scale and
`raise_at_min_scale=True`) copies state to the host itself, in one stacked
copy, only after executions that could hold a stuck step. Far from the floor
that is almost never; at the floor it is after every execution, and Keras
then gets Python numbers and copies nothing more. A model's train function
that kmp's optimizer wraps checks the floor the same way; while the monitor
is installed, the monitor's check is the one that runs.
"""

from __future__ import annotations

import sys
import warnings

import keras
import tensorflow as tf

from kmp import values
from kmp.engine import overflow_layer
from kmp.errors import Problem, check
from kmp.scaling import overflow
from kmp.scaling.floor import FloorCheck

__all__ = ["GradientAccumulationScheduler", "LossScaleMonitor"]

# Log key -> optimizer attribute. Keras's LossScaleOptimizer has only the first.
_SCALE_STATE = {
    "loss_scale": "dynamic_scale",
    "hysteresis_left": "hysteresis_left",
    "overflows": "overflows",
    "skipped_steps": "skipped_steps",
}
# Also logged: where the last overflow was (kmp's optimizer only); steps replayed at a lowered scale
# (overflow="replay" only).
_LOGGED = _SCALE_STATE | {"overflow_variable": "overflow_variable", "replayed_steps": "replayed_steps"}


class _Probe:
    """Reads one LossScaleOptimizer's state after each execution of the step, and checks the floor
    (kmp.scaling.floor) where the optimizer has one to check."""

    def __init__(self, floor_check: FloorCheck, layer_state=None):
        self.floor = floor_check
        self.layer_state = layer_state  # kmp.engine.overflow_layer.State of a prepared model, or None

    def add_state(self, logs):
        """`logs` with the state after the execution that produced them.

        Logs that are not a dict (a custom `train_step`) are returned as they
        are; the floor check still runs.
        """
        values = self.floor.snapshot(_LOGGED)
        if "loss_scale" not in values:  # not built: no step ran
            return logs
        if self.layer_state is not None:
            values["overflow_layer"] = tf.convert_to_tensor(self.layer_state.layer)
        values = self.floor.after_execution(values)
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        for key, value in values.items():
            logs.setdefault(key, value)  # a user metric of the same name wins
        return logs


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs the loss-scale state and stops training stuck at the floor under XLA.

    Adds `loss_scale`, `overflows`, `skipped_steps` and `hysteresis_left` (the
    last three with kmp's `LossScaleOptimizer`; Keras's has only the scale) to
    the logs of every training step, so they reach the progress bar,
    `History.history` and TensorBoard wherever the monitor and those callbacks
    sit in `callbacks=[...]`. With kmp's optimizer it also adds
    `overflow_variable`: the index in `model.trainable_variables` of the first
    variable whose gradient was not finite at the last overflow (-1 before
    any); under XLA, where the optimizer cannot print, the monitor prints that
    variable's path on each overflow. With a model prepared by `kmp.prepare`
    (which names the layer, kmp.engine.overflow_layer) it also adds `overflow_layer`:
    the number of the first layer whose forward output was not finite at the
    last overflow, its index in `model.layers` for a top-level layer (-1:
    none named); under XLA the monitor's line names it. With kmp's
    optimizer, a dynamic scale and `raise_at_min_scale=True`, raises
    `kmp.LossScaleError` when a step overflowed at the floor, as the train
    function kmp's optimizer wraps does without it (kmp.scaling.floor).
    With any other optimizer it warns once and does nothing.

    See the module docstring for how and when values are read.
    """

    def __init__(self):
        super().__init__()
        self._warned = False
        self._installed = None  # (model, original train_function, wrapper)
        self._report, self._overflows_seen = False, 0.0

    def on_train_begin(self, logs=None):
        self._uninstall()  # left behind by a fit() that raised outside the step
        optimizer = self.model.optimizer
        self._report = bool(self.model.jit_compile) and getattr(optimizer, "log_overflows", False)
        # A second fit() continues the optimizer's count: only new overflows are reported.
        skipped = getattr(optimizer, "skipped_steps", None)
        self._overflows_seen = 0.0 if skipped is None else float(skipped.numpy())
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self._warn_no_loss_scale(optimizer)
            return
        original = self.model.train_function
        if original is None:  # a custom loop that calls the callbacks itself
            return
        steps_per_execution = int(self.model.steps_per_execution or 1)
        # kmp's optimizer wraps the model's train function with a floor check of its own: the monitor calls
        # what that wraps and keeps its check (which may hold a call it has not checked yet), so it runs once.
        kept = getattr(original, "floor_check", None)
        inner = original.__wrapped__ if kept is not None else original
        probe = []  # made at the first step: a callback after this one may still restore the state

        def train_function_with_loss_scale(iterator):
            if not probe:
                floor = kept() if kept is not None else None
                floor = floor if floor is not None else FloorCheck(optimizer, steps_per_execution)
                probe.append(_Probe(floor, overflow_layer.state_of(self.model)))
            probe[0].floor.settle()
            probe[0].floor.start()
            try:
                return probe[0].add_state(inner(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                raise  # the end of the data, not a failure
            except BaseException as e:
                self._uninstall()
                error = overflow.loss_scale_error(e)  # the in-graph floor assert, outside XLA
                if error is not None:
                    raise error from None
                raise

        train_function_with_loss_scale.kmp_raises_floor = True  # kmp.scaling.overflow.raise_floor_errors_in leaves it
        self._installed = (self.model, original, train_function_with_loss_scale)
        self.model.train_function = train_function_with_loss_scale

    def on_train_end(self, logs=None):
        self._uninstall()

    def on_train_batch_end(self, batch, logs=None):
        # Outside XLA the optimizer prints its own overflow line; a compiled
        # step cannot print, so the monitor says where the overflow was.
        if not self._report or not isinstance(logs, dict):
            return
        overflows, index = logs.get("overflows"), logs.get("overflow_variable")
        if overflows is None or index is None or overflows <= self._overflows_seen:
            return
        self._overflows_seen = overflows
        variables = self.model.trainable_variables
        where = variables[int(index)].path if 0 <= index < len(variables) else "unknown"
        state = overflow_layer.state_of(self.model)
        forward = state.text() if state is not None and "overflow_layer" in logs else ""
        print(f"kmp: gradient overflow in an XLA-compiled step, step skipped. First non-finite gradient: {where}"
              f"{forward}", file=sys.stderr)

    def _uninstall(self):
        if self._installed is None:
            return
        model, original, wrapper = self._installed
        if model.train_function is wrapper:  # not replaced since (compile() resets it)
            model.train_function = original
        self._installed = None

    def _warn_no_loss_scale(self, optimizer):
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            "kmp.callbacks.LossScaleMonitor expected the model's optimizer to be a "
            "LossScaleOptimizer (kmp's or Keras's). Received: "
            f"optimizer={type(optimizer).__name__}. There is no loss scale to monitor, "
            "so the monitor does nothing. For float16 training wrap the optimizer "
            "(kmp.wrap(optimizer) or kmp.LossScaleOptimizer(optimizer)); float32 and "
            "bfloat16 need no loss scaling and no monitor.",
            stacklevel=2,
        )


class GradientAccumulationScheduler(keras.callbacks.Callback):
    """Changes the number of micro-batches per optimizer step by epoch.

        kmp.callbacks.GradientAccumulationScheduler({0: 8, 4: 4}, batch_size=32)

    Epochs 0-3 accumulate 8 micro-batches, epoch 4 on 4 (Lightning's
    `GradientAccumulationScheduler` spelling; epochs before the first key use
    1). The optimizer must be a `kmp.LossScaleOptimizer` built with
    `gradient_accumulation_steps` (any value: the schedule overrides it), as
    `kmp.wrap(..., gradient_accumulation_steps=1)` gives. A window still open
    when the number changes closes once it holds the new number.

    Adds `accumulation_steps` and, when `batch_size` (the `fit()` batch size)
    is given, `effective_batch_size` (= batch_size x steps) to each epoch's
    logs: History and the progress bar see them, as do callbacks listed after
    this one.
    """

    def __init__(self, schedule: dict[int, int], batch_size: int | None = None):
        super().__init__()
        problems = []
        if not isinstance(schedule, dict) or not schedule:
            problems.append(Problem("schedule", "a non-empty dict {epoch: micro-batches per step}", schedule))
        else:
            for epoch, steps in schedule.items():
                if not values.is_int(epoch) or not 0 <= epoch <= values.INT64_MAX:
                    top = f" and <= {values.INT64_MAX} (int64's largest)" if values.is_int(epoch) and epoch > 0 else ""
                    problems.append(Problem(f"schedule[{epoch!r}]", f"an epoch number >= 0{top} as key", epoch))
                values.int_in(f"schedule[{epoch!r}]", steps, 1, problems)
        if batch_size is not None:
            values.int_in("batch_size", batch_size, 1, problems, fix="None or the fit() batch size.")
        check(problems, "GradientAccumulationScheduler arguments")
        self.schedule = {int(epoch): int(steps) for epoch, steps in sorted(schedule.items())}
        self.batch_size = values.plain(batch_size)

    def steps_for(self, epoch: int) -> int:
        earlier = [steps for start, steps in self.schedule.items() if start <= epoch]
        return earlier[-1] if earlier else 1

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        if getattr(optimizer, "accumulation", None) is None:
            check([Problem(
                "model.optimizer", "a kmp.LossScaleOptimizer built with gradient_accumulation_steps",
                type(optimizer).__name__,
                "Compile with kmp.wrap(optimizer, gradient_accumulation_steps=1) (or any value).",
            )], "GradientAccumulationScheduler")
        optimizer.accumulation.steps.assign(self.steps_for(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        steps = self.steps_for(epoch)
        logs["accumulation_steps"] = steps
        if self.batch_size is not None:
            logs["effective_batch_size"] = self.batch_size * steps
