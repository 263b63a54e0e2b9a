"""What an overflow tells the user: one log line, and the floor error.

    on an overflow step (inside the training step, as TensorFlow ops):
        log:   "gradient overflow, step skipped." + what the scale did
               (hysteresis absorbed it / reduced from -> to / stays at the floor)
               + the first variables whose gradient was not finite
               + (a model prepared by kmp.prepare) where the forward pass
                 stopped being finite: kmp.engine.overflow_layer prints that ending
        stuck at the floor with raise_at_min_scale: kmp.LossScaleError (eager),
               or an assert carrying the same message (graph), which the
               model's train function raises as kmp.LossScaleError

Nothing is printed on clean steps. Inside XLA neither prints nor asserts
compile; there the model's train function raises after the call, from the
state (kmp.scaling.floor), and `kmp.callbacks.LossScaleMonitor` prints the
overflow line.
"""

from __future__ import annotations

import contextlib
import re
import sys

import tensorflow as tf

from kmp import seams
from kmp.config.settings import LossScaleConfig
from kmp.errors import LossScaleError
from kmp.scaling.floor import FloorCheck
from kmp.scaling import state as loss_scale


def in_xla() -> bool:
    return seams.get("in_xla_context")(tf.compat.v1.get_default_graph())


def raise_if_stuck(config: LossScaleConfig, stuck, scale, in_graph: bool = True) -> None:
    """Raise kmp.LossScaleError when the step overflowed at the floor (see loss_scale.adjust).

    Traced, an assert (outside XLA) unless `in_graph` is False: the model's train function then checks
    the state after the call (kmp.scaling.floor)."""
    if not config.raise_at_min_scale or not config.dynamic:
        return
    if tf.executing_eagerly():
        if bool(stuck):
            raise LossScaleError(loss_scale.floor_message(float(scale), config))
    elif in_graph and not in_xla():
        tf.debugging.Assert(tf.logical_not(stuck), [loss_scale.floor_message(config.min_scale, config)])


# kmp.scaling.state.floor_message, as TensorFlow's assert carries it.
_FLOOR = re.compile(r"kmp: gradients overflowed with the loss scale already at its minimum.*?the inputs\)\.", re.S)


def loss_scale_error(error: BaseException) -> LossScaleError | None:
    """The LossScaleError an in-graph floor assert stands for, or None.

    Outside XLA a training step stuck at the floor stops with TensorFlow's
    InvalidArgumentError (about 2,000 characters, kmp's text near the end).
    `kmp.prepare` and `kmp.callbacks.LossScaleMonitor` re-raise it as the
    error users catch, with the remedies first.
    """
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    found = _FLOOR.search(str(error))
    return LossScaleError(found.group(0)) if found else None


def raising_loss_scale_errors(function, model=None):
    """`function` (`model`'s train function), with a step stuck at the floor raised as kmp.LossScaleError: from
    TensorFlow's error of the in-graph assert, and, where the step has none (XLA; a call traced before this
    wrapper existed), from the state after each call (kmp.scaling.floor). Without `model` (kmp.prepare's
    functions, inside the one raise_floor_errors_in puts around them): the assert's error only."""
    checks = []  # made at the first call, or given by raise_floor_errors_in for the call in progress

    def floor_check() -> FloorCheck | None:
        if not checks and model is not None:
            checks.append(FloorCheck(model.optimizer, int(model.steps_per_execution or 1)))
        return checks[0] if checks else None

    def call(iterator):
        check = floor_check()
        if check is not None:
            check.settle()
            check.start()
        try:
            result = function(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            if check is not None:
                check.after_execution()  # the end of the data: the steps before it ran
            raise
        except tf.errors.InvalidArgumentError as e:
            error = loss_scale_error(e)
            if error is None:
                raise
            raise error from None
        if check is not None:
            check.after_execution()
        return result

    call.__wrapped__ = function
    call.kmp_raises_floor = True
    call.floor_check = floor_check
    call.checks = checks
    return call


def raise_floor_errors_in(model) -> bool:
    """Makes `model`'s train function (fit, train_on_batch) raise kmp.LossScaleError at the floor.

    On this instance only: its current train function is wrapped, and its
    `make_train_function` is replaced by one that wraps what Keras's (or
    kmp.prepare's) makes, so a function made after compile() is wrapped too.

    Returns whether the train function call being traced now, if any, raises kmp's error. False when
    that call began before this wrapper (a first call that builds the optimizer): it must not assert
    (TensorFlow's error would reach the user), so its step is skipped, and the wrapper checks its state
    before the next call, fit() at its end (`settle_floor`).
    """
    if "make_train_function" not in model.__dict__:
        make = model.make_train_function

        def make_train_function(force=False):
            # Keras's sets model.train_function (and returns it only when it was there); on a model kmp.prepare
            # did not take, kmp's own puts the overflow-layer finder in the step (kmp.engine.forward_overflow).
            if not _forward_overflow().make_with_finder(model, force):
                make(force)
            function = model.train_function
            if not getattr(function, "kmp_raises_floor", False):
                function = model.train_function = raising_loss_scale_errors(function, model)
            for check in getattr(function, "checks", ()):
                check.refresh()  # a new fit() or train_on_batch(): the state may have been restored since
            return function

        model.__dict__["make_train_function"] = make_train_function
    function = model.train_function
    if function is None:
        return True
    if getattr(function, "kmp_raises_floor", False):
        # Made while tracing the call in progress (TensorFlow may trace a step twice): not that call's wrapper.
        return not any(check.unseen for check in getattr(function, "checks", ()))
    wrapper = model.train_function = raising_loss_scale_errors(function, model)
    if tf.executing_eagerly():
        return True
    with tf.init_scope():  # the state the call in progress starts from
        wrapper.checks.append(FloorCheck(model.optimizer, int(model.steps_per_execution or 1), unseen=True))
    return False


# A forward overflow (kmp.engine.forward_overflow): what the step's assert carries, and the overflow
# line's ending when the scale is kept.
FORWARD_MARKER = "kmp: forward overflow (kmp.LossScaleError names the layer)"
FORWARD_KEPT = " | no loss scale fixes a forward overflow: the scale stays {}"


def _forward_overflow():
    """kmp.engine.forward_overflow, a floor above this module (it runs the model's layers), imported when used."""
    from kmp.engine import forward_overflow

    return forward_overflow


def settle_floor(model) -> None:
    """Raises kmp.LossScaleError if a train function call that began before kmp's wrapper was stuck."""
    for check in getattr(model.train_function, "checks", ()):
        check.settle()


def _text(piece):
    if isinstance(piece, str) or piece.dtype == tf.string:
        return piece
    return tf.strings.format("{}", piece)


# How many variables an overflow line names, first in the model's order.
NAMED = 3

# Optimizers whose line another part of the same step ends (kmp.engine.overflow_layer),
# with how many replicas are tracing that step now. Read while tracing only.
_CONTINUED: dict[int, int] = {}


@contextlib.contextmanager
def continued_line(optimizer):
    """While tracing a step in here, `optimizer`'s overflow line is printed without its line end."""
    key = id(optimizer)
    _CONTINUED[key] = _CONTINUED.get(key, 0) + 1
    try:
        yield
    finally:
        _CONTINUED[key] -= 1
        if not _CONTINUED[key]:
            del _CONTINUED[key]


def line_end(optimizer) -> str:
    return "" if id(optimizer) in _CONTINUED else "\n"


# kmp.engine.overflow_layer's findings (NOTHING, OUTPUT_INF, OUTPUT_NAN, INPUTS, BATCH), as
# the line's ending says them: before the layer's name, after it.
_FORWARD = (
    ("forward pass finite", ""),
    ("forward overflow in layer ", ": output inf, inputs finite"),
    ("forward overflow in layer ", ": output nan, inputs finite"),
    ("forward overflow entering layer ", ": inputs not finite, earlier outputs finite (a cast to float16 or code "
     "between layers)"),
    ("the batch itself is not finite", ""),
)


def layer_text(what: int, name: str) -> str:
    """The ending of an overflow line: `name` is "'dense_3' (Dense)", or "" when none was named."""
    before, after = _FORWARD[what]
    return f" | {before}{name if after else ''}{after}"


def layer_text_tensor(what, layer, names):
    """`layer_text` inside a step: `what` and `layer` are int32 tensors, `names` Python strings."""
    table = tf.constant(list(names) or [""])
    name = tf.gather(table, tf.clip_by_value(layer, 0, len(names) - 1 if names else 0))
    has_name = tf.gather(tf.constant([bool(after) for _, after in _FORWARD]), what)
    return tf.strings.join([
        " | ",
        tf.gather(tf.constant([before for before, _ in _FORWARD]), what),
        tf.where(has_name & (layer >= 0), name, ""),
        tf.gather(tf.constant([after for _, after in _FORWARD]), what),
    ])


def flag_vector(flags):
    """Per-variable finite flags as one bool vector (given as a list of scalars, or a vector)."""
    return flags if tf.is_tensor(flags) else tf.stack(list(flags))


def flag_count(flags) -> int:
    return int(flags.shape[0]) if tf.is_tensor(flags) else len(flags)


def log_overflow(config: LossScaleConfig, finite, old: loss_scale.LossScaleState, new: loss_scale.LossScaleState,
                 flags=(), variables=(), end="\n"):
    """One line on stderr when the step overflowed (not inside XLA: tf.print does not compile).

    With `flags` (finite or not, one per variable), the line ends with the
    first variables whose gradient was not finite, in the model's order.
    `end=""` leaves the line open for the step to end (`continued_line`).
    Returns a tensor computed after the print (None inside XLA).
    """
    if in_xla():
        return None

    def culprits():
        names = tf.constant([getattr(v, "path", None) or v.name for v in variables] or [""])
        bad = tf.boolean_mask(names, tf.logical_not(flag_vector(flags)))
        more = tf.size(bad) - NAMED
        text = tf.strings.reduce_join(bad[:NAMED], separator=", ")
        text += tf.where(more > 0, tf.strings.format(", and {} more", more), "")
        # Every gradient finite: only the float8 scaling state was not (it still skips the step, as in Keras).
        text = tf.where(tf.size(bad) > 0, text, "none (float8 scaling state only: amax history, scales)")
        return ["| non-finite gradients:", text]

    def line(*parts):
        def emit():
            tail = culprits() if flag_count(flags) and flag_count(flags) == len(variables) else []
            pieces = ["kmp: gradient overflow, step skipped.", *parts, *tail]
            # One string: tf.print quotes a string tensor printed beside others.
            text = tf.strings.join([_text(p) for p in pieces], separator=" ")
            tf.print(text, output_stream=sys.stderr, end=end)
        return emit

    if not config.dynamic:
        report = line("Static loss scale", old.scale)
    else:
        def report():
            tf.cond(
                old.hysteresis_left > 1,
                line("Loss scale stays", old.scale, "(hysteresis absorbed it;", new.hysteresis_left, "left)"),
                lambda: tf.cond(
                    new.scale < old.scale,
                    line("Attempted loss scale:", old.scale, ", reducing to", new.scale),
                    line("Loss scale stays at its minimum", old.scale),
                ),
            )
    # One line per step, not one per replica: replica 0 of the job reports
    # (merge_call paths arrive here once, in cross-replica context).
    context = tf.distribute.get_replica_context()
    first = True if context is None else tf.equal(context.replica_id_in_sync_group, 0)

    def printed():
        report()
        return tf.constant(True)

    # A tensor to order later writes after the print (an open line must be printed before its end).
    return tf.cond(tf.logical_and(tf.logical_not(finite), first), printed, lambda: tf.constant(False))
