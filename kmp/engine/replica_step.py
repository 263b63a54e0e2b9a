"""fit()'s train step with XLA per replica, for a model prepared by kmp.

Keras compiles a step function with XLA whole or not at all. Under a
strategy with several replicas `jit_compile="auto"` turns XLA off, and
`jit_compile=True` fails, because the step holds every replica's work and
its cross-device parts ("Trying to access resource dense/kernel/replica_1
located in device CPU:1 from device CPU:0"). A prepared model's train step
(`kmp.prepare(model)`) compiles the per-replica parts only, on each replica:

    values = this replica's copy of every model and metric variable
    weight = rows * N / the global batch's rows         # row_weight: uneven shares
    grads, y_pred, loss, writes = forward_backward(values, scale * weight, data)  # XLA
    variable.assign(w) for each write   # BatchNorm statistics, dropout seeds:
                                        # as Keras assigns them in replica context,
                                        # except non-finite statistics
    optimizer.apply(grads)              # kmp: one all-reduce (not in XLA), then
                                        # kmp.engine.fused's XLA update per replica
    loss tracker and metrics            # as Keras's train_step

`forward_backward` is Keras's forward pass and loss inside a StatelessScope:
variables are read from the values passed in and writes are returned, so
nothing inside XLA touches a distributed variable or calls merge_call. It is
traced once per replica (keyed like kmp.engine.fused), so anything read that is not
passed in is still this replica's own copy. benchmarks/p1_p2_step_time.py
and p1_parts.py measure the step.
"""

from __future__ import annotations

import logging
import math
import warnings

import keras
import tensorflow as tf

from kmp import seams
from kmp.distribute.communication import all_reduce_sum, cpus_of_one_process
from kmp.distribute.tpu import is_tpu_strategy
from kmp.engine import state, wall_clock, xla_choice
from kmp.scaling.replay import Replay

logger = logging.getLogger(__name__)

JIT_CHOICES = ("auto", True, False)
# The fast paths a prepared model's first train step falls back from when it cannot be built on them
# (kmp.engine.prepare), in that order.
FLAT, FINDER, XLA = "flat buffers", "overflow-layer finder", "XLA"
REPLICA_XLA = "XLA per replica"  # in describe_path's line


def path_of(model) -> dict:
    """The path the model's train function took: "taken" (a description), "dropped" ({path: why}, for
    every later build) and "off" ({path: why}, for this build: kmp.engine.xla_choice)."""
    return state.ensure(model).path


def describe_path(model) -> str:
    """One line: what a prepared model's last train function took, and what it fell back from, and why."""
    path = path_of(model)
    notes = [f"{name} dropped: {why}" for name, why in path["dropped"].items()]
    notes += [f"{name} off: {why}" for name, why in path["off"].items()]
    return (path["taken"] or "not built yet") + (f" ({'; '.join(notes)})" if notes else "")


def splits_replicas(strategy) -> bool:
    """Whether kmp builds `strategy`'s steps itself, replica by replica.

    True for several replicas on CPUs/GPUs (Mirrored, MultiWorkerMirrored).
    TPUStrategy compiles the whole step, all replicas and the all-reduce,
    into one XLA program and uses no merge_call: Keras's step and loop stay.
    """
    return strategy.num_replicas_in_sync > 1 and not is_tpu_strategy(strategy)


def wants_replica_xla(model: keras.Model, setting) -> bool:
    """Whether `fit()` should use the per-replica XLA train step for `model` now."""
    if setting is False or model.run_eagerly or not splits_replicas(model.distribute_strategy) or (
            XLA in path_of(model)["dropped"]):
        return False
    return setting is True or bool(seams.get("model_supports_jit")(model))


@tf.autograph.experimental.do_not_convert
def train_step(model: keras.Model, data):
    """Keras's `train_step`, with the forward/backward pass under XLA on this replica."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if model.optimizer is None:
        raise ValueError("The model has no optimizer: call model.compile(optimizer=...) before fit().")
    if not model.trainable_variables:
        warnings.warn("The model does not have any trainable weights.")
        return seams.get("TensorFlowTrainer").train_step(model, data)
    trainable = model.trainable_variables
    others = model.non_trainable_variables + model.metrics_variables
    values = [tf.convert_to_tensor(v.value) for v in trainable]
    other_values = [tf.convert_to_tensor(v.value) for v in others]
    # The loss-scale factor, read here (replica context), applied inside as
    # Keras's scale_loss does: loss * scale.
    scale = tf.convert_to_tensor(model.optimizer.scale_loss(tf.constant(1.0)))
    weight = row_weight(model, x)
    if weight is not None:
        scale = scale * weight  # the optimizer unscales by the loss scale alone: the weight stays
    grads, y_pred, loss, writes = _compiled(model)(values, other_values, in_turn(model, scale), x, y, sample_weight)
    passed(model, loss)
    wall_clock.stamp("gradients", grads)
    apply_writes_and_track_loss(model, writes, loss, x)
    if replays(model):
        def again(new_scale):  # the same batch, weights and seeds, at another loss scale
            factor = new_scale if weight is None else new_scale * weight
            # Across replicas the weights are read again (not updated yet): the replay, built across
            # replicas, then takes each variable in, not each value (kmp.scaling.replay). On one device
            # the values read: XLA's whole step then updates the variables in place after the branch.
            now = values if model.distribute_strategy.num_replicas_in_sync == 1 else [
                tf.convert_to_tensor(v.value) for v in trainable]
            return _compiled(model)(now, other_values, factor, x, y, sample_weight)[0]

        model.optimizer.apply(grads, trainable, replay=Replay(again, loss))
    else:
        model.optimizer.apply(grads, trainable)
    wall_clock.stamp("updated", trainable[:1])  # kmp's optimizer stamped its own parts already
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def replays(model: keras.Model) -> bool:
    """Whether the model's optimizer replays overflowing steps (kmp.scaling.replay): its step then passes
    the optimizer a way to compute the batch's gradients again."""
    return bool(getattr(model.optimizer, "replays", False))


# Below this many trainable parameters replicas on CPUs run their passes together (in_turn).
IN_TURN_PARAMETERS = 4_000_000


def in_turn(model: keras.Model, scale):
    """`scale`, once the previous replica's forward/backward is done, where the replicas are CPUs of one process
    and the model has at least IN_TURN_PARAMETERS (else itself): their passes then compile, and hold their
    activations, one at a time.

    They share the cores. A transformer's pass already takes both, so in turn costs it little time, and
    its two XLA compiles and two sets of activations are not held at once; a small MLP's passes cannot
    fill the cores alone, and run together faster (benchmarks/RESULTS.md, "Memory as the process holds
    it": the threshold lies between the two models measured there). MirroredStrategy traces its replicas
    one after another, in order, so the previous replica's pass is in the graph when this one is traced.
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync < 2 or not cpus_of_one_process(strategy):
        return scale
    if sum(math.prod(v.shape) for v in model.trainable_variables) < IN_TURN_PARAMETERS:
        return scale
    previous = state.ensure(model).last_pass
    if previous is not None and previous.graph is tf.compat.v1.get_default_graph():
        with tf.control_dependencies([previous]):
            scale = tf.identity(scale)
    return scale


def passed(model: keras.Model, output) -> None:
    """Marks this replica's forward/backward `output` as the one the next replica waits for (in_turn)."""
    if model.distribute_strategy.num_replicas_in_sync > 1:
        state.ensure(model).last_pass = output  # one graph's tensor at a time: no old graph is kept alive


def row_weight(model: keras.Model, x):
    """This replica's weight in the all-reduced gradient: rows * N / the global batch's rows (None: 1).

    Keras's mean losses divide each replica's loss by its own rows and by the
    replicas N, so the summed gradient is the mean of the replicas' means.
    With uneven shares (a global batch of 3 on two replicas; the last batch of
    an epoch; a batch of 1, whose second share is empty) rows then weigh
    unequally, and an empty share halves the step. Times this weight, the sum
    is the gradient of the mean over the global batch's rows, as on one
    device; terms that are not per row (regularizers) keep their sum. It costs
    one all-reduce of a scalar per step, skipped where the batch size is static
    (every share then has the same rows).
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    first = next(i for i in keras.tree.flatten(x) if i is not None)
    if first.shape[0] is not None or not _mean_per_row(model):
        return None
    rows = tf.cast(tf.shape(first)[:1], tf.float32)
    (total,) = all_reduce_sum([rows])
    return (rows * context.num_replicas_in_sync / total)[0]


def _mean_per_row(model) -> bool:
    """Whether the loss is known to be a mean per row, which the weight makes exact.

    A sum per row (reduction "sum") is exact unweighted; other losses are said once.
    """
    reductions = {getattr(loss, "reduction", "sum_over_batch_size")  # strings and functions: compile's mean
                  for loss in keras.tree.flatten(model.loss) if loss is not None}
    reason = None
    if type(model).compute_loss is not keras.Model.compute_loss:
        reason = "the model has its own compute_loss"
    elif not reductions:
        reason = "the model has no compiled loss"
    elif reductions == {"sum"}:
        return False
    elif not reductions <= {"sum_over_batch_size", "mean"}:
        reason = f"its losses reduce by {sorted(reductions)}"
    if reason is None:
        return True
    if not state.ensure(model).rows_noted:
        state.ensure(model).rows_noted = True
        logger.warning("kmp: %s: uneven shares of a global batch across replicas (the last batch of an epoch) are "
                       "weighted per replica, as Keras does, not per row: %s, not a mean per row known to kmp.",
                       model.name, reason)
    return False


def forget(model: keras.Model) -> None:
    """Drops the model's per-replica XLA functions; the next trace makes new ones."""
    if state.of(model) is not None:
        state.of(model).replica_steps = {}


def _compiled(model):
    """The XLA forward/backward function of this model on this replica (one per replica)."""
    cache = state.ensure(model).replica_steps
    key = replica_key()
    if key not in cache:
        function = lambda *args: _forward_backward(model, *args)  # noqa: E731
        # On one device (a replaying step, kmp.scaling.replay) XLA only where Keras's whole step would have it.
        one_device_plain = not splits_replicas(model.distribute_strategy) and not (
            state.setting(model, "jit_compile") is True or model.jit_compile)
        cache[key] = xla_choice.plain(function) if one_device_plain else compiled(model, function)
    return cache[key]


def compiled(model, fn):
    """`fn`, a forward/backward of `model`, compiled with XLA unless kmp.engine.xla_choice predicts
    minutes of compile under jit_compile="auto" (then plain, and the path says so)."""
    if XLA in path_of(model)["off"]:  # another replica's trace of this build declined it: not traced for XLA again
        return xla_choice.plain(fn)
    forced = state.setting(model, "jit_compile") is True or bool(model.jit_compile)
    return xla_choice.function(fn, forced, lambda ops, longest: _xla_declined(model, ops, longest))


def _xla_declined(model, ops, longest) -> None:
    # For this build only: the next one (a new compile() or prepare()) measures again.
    path = path_of(model)
    why = f"its graph ({ops} ops, {ops / max(longest, 1):.0f} wide on average) would take XLA minutes to compile"
    path["off"][XLA] = why
    path["taken"] = path["taken"] and path["taken"].replace(REPLICA_XLA, "no XLA")
    if not state.ensure(model).xla_noted:  # said once, not per replica or per build
        state.ensure(model).xla_noted = True
        logger.warning("kmp: %s: the forward/backward runs without XLA: %s; the update keeps XLA. "
                       "kmp.prepare(model, jit_compile=True) compiles it anyway.", model.name, why)


def replica_key() -> tuple:
    """(the strategy, this replica's id): per-replica functions are cached under it.

    The id is None where it is not known while tracing: one function then,
    fed with values passed in only.
    """
    context = tf.distribute.get_replica_context()
    replica = 0 if context is None else tf.get_static_value(context.replica_id_in_sync_group)
    return id(tf.distribute.get_strategy()), None if replica is None else int(replica)


def _forward_backward(model, values, other_values, scale, x, y, sample_weight):
    with tf.GradientTape() as tape:
        tape.watch(values)
        y_pred, loss, writes = stateless_loss(model, values, other_values, x, y, sample_weight)
        scaled = keras.ops.multiply(loss, scale)  # as Keras's scale_loss: float16 * float32 -> float32
    return tape.gradient(scaled, values), y_pred, loss, writes


def stateless_loss(model, values, other_values, x, y, sample_weight):
    """(y_pred, loss, writes): Keras's forward pass and loss on these values of
    the trainable and the other (non-trainable, metric) variables, in a
    StatelessScope. `writes` maps the index (in non-trainable + metrics order,
    as a string) of each variable the pass wrote to its new value."""
    others = model.non_trainable_variables + model.metrics_variables
    mapping = list(zip(model.trainable_variables, values)) + list(zip(others, other_values))
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        entered = dict(scope.state_mapping)  # the scope's own copies of the values
        kwargs = {"training": True} if model._call_has_training_arg else {}
        y_pred = model(x, **kwargs)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    # Only the variables the step wrote come back; the others keep their value.
    writes = {}
    for k, variable in enumerate(others):
        after = scope.get_current_value(variable)
        if after is not entered[id(variable)]:
            writes[str(k)] = after
    return y_pred, loss, writes


def apply_writes_and_track_loss(model, writes, loss, x) -> None:
    """After `stateless_loss`, in replica context: its writes assigned, the loss tracked, as Keras's train_step."""
    others = model.non_trainable_variables + model.metrics_variables
    for index, value in writes.items():
        variable = others[int(index)]
        if value.dtype.is_floating:
            # An inf batch makes BatchNormalization's moving statistics nan; its
            # step overflows and is skipped, and the statistics keep their value.
            value = tf.where(tf.reduce_all(tf.math.is_finite(value)), value, variable.value)
        variable.assign(value)
    model._loss_tracker.update_state(
        seams.get("unscale_loss_for_distribution")(loss),
        sample_weight=tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0],
    )
