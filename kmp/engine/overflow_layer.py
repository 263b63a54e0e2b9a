"""Which layer overflowed: the forward pass run again, layer by layer, after an overflow.

    kmp.find_overflow(model, x, y)   eagerly, on a batch the user caught: an OverflowReport
    diagnosing_step(model, step)     in fit(): kmp.prepare wraps the train step with it

How a layer is found (both):

    in a keras.StatelessScope (writes discarded: BatchNorm statistics, seeds),
    with each layer's `call` wrapped on its instance for this one call:
        model(x, training=True)
    a wrapped call notes when it starts (are its inputs finite?) and when it
    ends (are its outputs finite?). In that order of events, the first note
    that is not finite names the layer:
        an end:   "output inf/nan, inputs finite"   (the layer overflowed)
        a start:  "inputs not finite" while every earlier output was
                  (a float16 cast at its input, or code between layers)
    The batch itself not finite is said as such. Inner layers end before
    the layer or model that calls them, so the innermost layer is named.

Every layer has a number: its index in `layer_table(model)`, which is
`model.layers` first (so a top-level layer's number is its index there), then
the layers inside those (named "outer/inner"), then the model itself. This
works for Functional, Sequential and subclassed models alike; code of a
subclassed model between its layers is seen at the next layer's inputs.

In fit() (`diagnosing_step`), replica context:

    before = optimizer.skipped_steps
    logs = step(data)                        # Keras's train step, or kmp's per-replica one
    if optimizer.skipped_steps > before:     # tf.cond: a clean step runs none of this
        (cross-replica, after every replica's step) each replica re-runs its own
        share of the batch as above, eagerly, in a tf.py_function (inside a
        whole-step XLA computation, where no py_function compiles: traced into
        the step); the first replica that names a layer wins;
        state <- (layer number, what), and the optimizer's overflow line,
        printed without its line end, gets its end: " | forward overflow in ..."

The weights did not move (an overflowing step is skipped), so the re-run sees
what the step saw; only dropout draws another mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import threading

import keras
import tensorflow as tf

from kmp.distribute.tpu import is_tpu_strategy
from kmp.engine import engine
from kmp.engine import state as kmp_state
from kmp.scaling import overflow

logger = logging.getLogger(__name__)

FLOAT16_MAX = 65504.0

# What a diagnosis found (kept in an int32 variable in fit()).
NOTHING, OUTPUT_INF, OUTPUT_NAN, INPUTS, BATCH = 0, 1, 2, 3, 4

def layer_table(model: keras.Model) -> list[tuple[keras.layers.Layer, str]]:
    """(layer, name) for every layer a report can name, in index order (see the module docstring)."""
    table, seen = [], set()
    level = [(layer, layer.name) for layer in model.layers]
    while level:
        deeper = []
        for layer, name in level:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            table.append((layer, name))
            children = layer._flatten_layers(include_self=False, recursive=False)
            deeper += [(child, f"{name}/{child.name}") for child in children]
        level = deeper
    if id(model) not in seen:
        table.append((model, model.name))
    return table


@dataclasses.dataclass
class _Note:
    """One start or end of a layer call: finite?, any inf?, the largest finite-or-inf |value|."""

    index: int
    start: bool
    finite: object
    has_inf: object
    largest: object


def _floats(values) -> list:
    """The floating-point tensors in a nest of call arguments or outputs (sparse ones by their values)."""
    found = []
    for value in tf.nest.flatten(values, expand_composites=True):
        if hasattr(value, "__array__") and not tf.is_tensor(value):
            value = tf.convert_to_tensor(value)  # a numpy batch
        if isinstance(value, tf.Tensor) and value.dtype.is_floating:
            found.append(value)
    return found


def _all_finite(tensors):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors]) if tensors else tf.constant(True)


def _note(index: int, start: bool, values) -> _Note:
    tensors = _floats(values)
    if not tensors:
        return _Note(index, start, tf.constant(True), tf.constant(False), tf.constant(0.0))
    has_inf = tf.reduce_any([tf.reduce_any(tf.math.is_inf(t)) for t in tensors])
    # nan says nothing about size: left out of the largest value (inf is in it).
    largest = tf.reduce_max(tf.stack([
        tf.cast(tf.reduce_max(tf.abs(tf.where(tf.math.is_nan(t), tf.zeros_like(t), t))), tf.float32) for t in tensors
    ]))
    return _Note(index, start, _all_finite(tensors), has_inf, largest)


class _Recorder:
    """The notes of the forward passes running under `_recording`, one list per thread.

    MirroredStrategy traces each replica in its own thread; a call made inside
    a loop or branch of the layer's own (an RNN's cell in its while loop) is
    not noted: its tensors cannot leave that loop. The layer holding the loop is.
    """

    def __init__(self):
        self._graphs, self._notes = {}, {}

    def begin(self):
        key = threading.get_ident()
        self._graphs[key], self._notes[key] = tf.compat.v1.get_default_graph(), []

    def end(self) -> list[_Note]:
        key = threading.get_ident()
        del self._graphs[key]
        return self._notes.pop(key)

    def wrap(self, original, index: int):
        @functools.wraps(original)  # Keras reads the call signature through __wrapped__
        def call(*args, **kwargs):
            key = threading.get_ident()
            noting = self._graphs.get(key) is tf.compat.v1.get_default_graph()
            if noting:
                self._notes[key].append(_note(index, True, (args, kwargs)))
            outputs = original(*args, **kwargs)
            if noting:
                self._notes[key].append(_note(index, False, outputs))
            return outputs

        return call


@contextlib.contextmanager
def _recording(table):
    """Each layer of `table` notes its calls while inside; the instances are as before after."""
    recorder, wrapped = _Recorder(), []
    missing = object()
    try:
        for index, (layer, _) in enumerate(table):
            # Keras calls `quantized_call` instead of `call` on a quantized layer.
            name = "quantized_call" if getattr(layer, "quantization_mode", None) is not None else "call"
            wrapped.append((layer, name, vars(layer).get(name, missing)))
            # Set in the instance's __dict__: Keras's __setattr__ would track it.
            layer.__dict__[name] = recorder.wrap(getattr(layer, name), index)
        yield recorder
    finally:
        for layer, name, before in reversed(wrapped):
            if before is missing:
                del layer.__dict__[name]
            else:
                layer.__dict__[name] = before


def _call(model, x, training):
    return model(x, training=training) if model._call_has_training_arg else model(x)


def forward_notes(model: keras.Model, x, recorder: _Recorder, training=True) -> tuple[list[_Note], object]:
    """The notes of one forward pass that writes nothing, and whether the batch was finite."""
    recorder.begin()
    try:
        with keras.StatelessScope(collect_losses=True):
            _call(model, x, training)
    finally:
        notes = recorder.end()
    return notes, _all_finite(_floats(x))


def culprit(notes: list[_Note], batch_finite):
    """(layer number, what) as int32 tensors: the first note that is not finite (-1, NOTHING: none)."""
    if not notes:
        return tf.constant(-1), tf.where(batch_finite, NOTHING, BATCH)
    bad = tf.logical_not(tf.stack([n.finite for n in notes]))
    first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32)
    index = tf.gather(tf.constant([n.index for n in notes], tf.int32), first)
    ended = tf.where(tf.gather(tf.stack([n.has_inf for n in notes]), first), OUTPUT_INF, OUTPUT_NAN)
    what = tf.where(tf.gather(tf.constant([n.start for n in notes]), first), INPUTS, ended)
    found = tf.reduce_any(bad) & batch_finite
    return tf.where(found, index, -1), tf.where(batch_finite, tf.where(found, what, NOTHING), BATCH)


# --- In fit() ------------------------------------------------------------------


class State:
    """Where the last forward overflow was, for the monitor: kept out of the model's weights.

    `layer`: the layer number at the last overflow (-1: none named); `what`:
    NOTHING, OUTPUT_INF, ... ; `names`: "'name' (Class)" by layer number,
    set when the step is traced.
    """

    def __init__(self, model: keras.Model):
        with model.distribute_strategy.scope():
            # aggregation "none": written in cross-replica context, one value for all.
            self.layer = keras.Variable(-1, dtype="int32", trainable=False, aggregation="none", name="overflow_layer")
            self.what = keras.Variable(NOTHING, dtype="int32", trainable=False, aggregation="none",
                                       name="overflow_what")
            # Forward overflows found (kmp.engine.forward_overflow); `forward_seen`: how many the host acted on.
            self.forward = keras.Variable(0, dtype="int32", trainable=False, aggregation="none",
                                          name="forward_overflows")
        self.forward_seen = 0
        self.names: tuple[str, ...] = ()
        self.table: list = []  # layer_table(model) when the step was traced
        # Whether the host reads `forward` after each call (forward_overflow="float32", or "raise" in XLA,
        # where no assert compiles); set when the step is traced.
        self.host_checks = False
        self.moved: list[str] = []  # the layers forward_overflow="float32" moved to float32

    def text(self) -> str:
        """The line's ending for the state now, as the step prints it (host values)."""
        layer, what = int(self.layer.numpy()), int(self.what.numpy())
        return overflow.layer_text(what, self.names[layer] if 0 <= layer < len(self.names) else "")


def state_of(model: keras.Model) -> State | None:
    prepared = kmp_state.of(model)
    return None if prepared is None else prepared.overflow_layer


def can_diagnose(model: keras.Model) -> bool:
    """Whether fit() can name the layer: kmp's LossScaleOptimizer counts the skipped steps.

    Not under TPUStrategy: it merges nothing, and the state's write would sit
    in replica context (never run: no TPU here).
    """
    return getattr(model.optimizer, "loss_scale_config", None) is not None and not is_tpu_strategy(
        model.distribute_strategy)


def diagnosing_step(model: keras.Model, step_function):
    """`step_function`, followed by the diagnosis on the steps that overflowed (module docstring)."""
    state = state_of(model)
    if state is None:
        # Kept in kmp's one object on the model (kmp.engine.state): not tracked, saved or checkpointed.
        state = kmp_state.ensure(model).overflow_layer = State(model)
    optimizer = model.optimizer

    @functools.wraps(step_function)
    def step(data):
        if not optimizer.built:
            # A model kmp.prepare could not build from shapes builds inside
            # its first step; the optimizer's counter must exist to be read.
            model._symbolic_build(data_batch=data)
        before = tf.convert_to_tensor(optimizer.skipped_steps.value)
        # The scale state the step starts from: a forward overflow puts it back (no scale fixes one).
        kept = [] if forward_mode(optimizer) == "backoff" else [
            tf.convert_to_tensor(v.value) for v in (optimizer.dynamic_scale, optimizer.hysteresis_left)]
        ending = optimizer.log_overflows and not overflow.in_xla()
        with overflow.continued_line(optimizer) if ending else contextlib.nullcontext():
            logs = step_function(data)
        overflowed = tf.convert_to_tensor(optimizer.skipped_steps.value) > before
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        context = tf.distribute.get_replica_context()
        replica = tf.constant(0) if context is None else context.replica_id_in_sync_group
        merge = functools.partial(_diagnose_if, model, state, ending)
        tf.__internal__.distribute.interim.maybe_merge_call(merge, tf.distribute.get_strategy(), overflowed, x, replica,
                                                             kept)
        return logs

    return step


def forward_mode(optimizer) -> str:
    """What a forward overflow does (kmp.engine.forward_overflow): the optimizer's `forward_overflow`, or
    "backoff" where the scale is static (float32, bfloat16: the step is skipped as any other)."""
    config = getattr(optimizer, "loss_scale_config", None)
    return getattr(optimizer, "forward_overflow", "backoff") if config is not None and config.dynamic else "backoff"


def is_forward(layer, what):
    """Whether a diagnosis (layer number, what) names a forward overflow: a layer's output not finite, or
    its inputs, while the batch and every earlier output were."""
    return (layer >= 0) & ((what == OUTPUT_INF) | (what == OUTPUT_NAN) | (what == INPUTS))


def _diagnose_if(model, state, ending, strategy, overflowed, x, replica, kept):
    # Cross-replica context (after every replica's step) where the strategy
    # merges: a collective or merge_call inside a replica-context cond fails.
    local = strategy.experimental_local_results
    table = layer_table(model)
    state.names = tuple(f"'{name}' ({type(layer).__name__})" for layer, name in table)
    state.table = table
    optimizer, mode = model.optimizer, forward_mode(model.optimizer)

    def diagnose():
        if overflow.in_xla():  # the whole step is one XLA computation (one device): traced into it
            with _recording(table) as recorder:  # once, here: the replicas' threads share the layers
                found = _each_replica(
                    strategy, lambda x: tf.stack(culprit(*forward_notes(model, x, recorder)))[None], x)
        else:
            found = _each_replica(strategy, lambda x: _culprit_when_run(model, table, x)[None], x)
        found = _every_replica(strategy, found)  # [replicas of the whole job, 2]
        # A named layer first, then a non-finite batch, then nothing; replica order breaks ties.
        rank = tf.where(found[:, 0] >= 0, 0, tf.where(found[:, 1] == BATCH, 1, 2))
        layer, what = tf.unstack(tf.gather(found, tf.argmin(rank, output_type=tf.int32)))
        state.layer.assign(layer)
        state.what.assign(what)
        if mode != "backoff":  # kmp.engine.forward_overflow
            forward = is_forward(layer, what)
            scale = local(kept[0])[0]

            def keep():
                optimizer.dynamic_scale.assign(scale)
                optimizer.hysteresis_left.assign(local(kept[1])[0])
                state.forward.assign_add(1)
                return tf.constant(True)

            tf.cond(forward, keep, lambda: tf.constant(False))
            state.host_checks = state.host_checks or mode == "float32" or overflow.in_xla()
        # The optimizer printed its line, without its end, where replica 0 runs
        # (this worker, unless multi-worker; the ids are constants in practice).
        ids = [tf.get_static_value(i) for i in local(replica)]
        if ending and (0 in ids or None in ids):
            text = overflow.layer_text_tensor(what, layer, state.names)
            if mode != "backoff":
                text += tf.where(forward, tf.strings.format(overflow.FORWARD_KEPT, scale), "")
            here = tf.reduce_any(tf.equal(tf.stack(local(replica)), 0))
            tf.cond(here, lambda: tf.print(text, output_stream=sys.stderr), tf.no_op)
        if mode == "raise" and not overflow.in_xla():
            # After the writes above (program order): kmp.engine.forward_overflow.watching raises
            # kmp.LossScaleError from the state.
            tf.debugging.Assert(tf.logical_not(forward), [overflow.FORWARD_MARKER])

    tf.cond(local(overflowed)[0], diagnose, lambda: None)


@tf.autograph.experimental.do_not_convert
def _culprit_when_run(model, table, x):
    """culprit() of this replica's batch as a [2] int32 tensor, computed eagerly when the graph runs it.

    A tf.py_function: tracing the re-run forward pass into the step about
    doubles a large model's first fit() (benchmarks/p5_small_variables.py)
    for a branch that runs only on an overflow. Eagerly it costs a forward
    pass then, and nothing before. An overflowing step updated no weight, so the weights read here
    are the ones the step saw, whenever this runs within the step.
    """
    spec = x

    def run(*flat):
        batch = tf.nest.pack_sequence_as(spec, list(flat), expand_composites=True)
        with _EAGER_RUN:  # replicas share the layers' instances, which _recording wraps
            try:
                # The flat-buffer engine's weights, into the model's variables (no optimizer state:
                # no collective inside the step).
                engine.observe(model, what=engine.WEIGHTS)
                with _recording(table) as recorder:
                    return tf.stack(culprit(*forward_notes(model, batch, recorder)))
            except Exception as error:  # a diagnosis that fails must not stop the training it explains
                logger.warning("kmp: naming the overflowing layer failed (%s: %s); the step was skipped as "
                               "usual. kmp.prepare(model, find_overflow_layer=False) turns the diagnosis off.",
                               type(error).__name__, error)
                return tf.constant([-1, NOTHING], tf.int32)

    found = tf.py_function(run, tf.nest.flatten(x, expand_composites=True), Tout=tf.int32)
    found.set_shape([2])
    return found


_EAGER_RUN = threading.Lock()


def _every_replica(strategy, found):
    """Each replica's [1, 2] finding, stacked in replica order: [replicas of the whole job, 2].

    Under MultiWorkerMirroredStrategy a worker holds only its own replicas'
    findings, so they are gathered: one small collective, on an overflowing
    step only, which every worker reaches (the overflow decision is shared).
    Every worker then names the same layer, and the line printed where
    replica 0 runs says what any worker's share showed.
    """
    local = strategy.experimental_local_results(found)
    if strategy.num_replicas_in_sync == len(local):
        return tf.concat(local, axis=0)
    # The collective loses the static shape; the row count is known.
    return tf.reshape(strategy.gather(found, axis=0), [strategy.num_replicas_in_sync, 2])


def _each_replica(strategy, fn, *args):
    if tf.distribute.in_cross_replica_context():
        return strategy.extended.call_for_each_replica(fn, args=args)
    return fn(*args)


# --- Eagerly: kmp.find_overflow ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """What `kmp.find_overflow` found on one batch.

    layer, layer_class: the first layer whose output was not finite while its
        inputs were (or, with what="inputs not finite", whose inputs were not
        while every earlier output was); None when the forward pass was finite.
    what: "output inf", "output nan", "inputs not finite", "batch not finite" or None.
    output_max, inputs_max: the largest |value| of that call's outputs and
        inputs (inf counts, nan does not); float16 holds up to 65504.
    loss, loss_scale: the loss and the scale the gradients were taken at
        (None: no y, or the model is not compiled with a loss).
    nonfinite_gradients: paths of the variables whose gradient of the
        scaled loss held inf or nan, in `model.trainable_variables` order.
    """

    layer: str | None
    layer_class: str | None
    what: str | None
    output_max: float | None
    inputs_max: float | None
    loss: float | None
    loss_scale: float | None
    nonfinite_gradients: tuple[str, ...]
    float16_max: float = FLOAT16_MAX

    def __str__(self):
        what = _CODES[self.what]
        name = f"'{self.layer}' ({self.layer_class})" if self.layer is not None else ""
        text = overflow.layer_text(what, name).removeprefix(" | ")
        if what in (OUTPUT_INF, OUTPUT_NAN, INPUTS):
            text += (f"; max |output| {self.output_max:g}, max |inputs| {self.inputs_max:g} "
                     f"(float16 max {self.float16_max:g})")
        if self.loss_scale is None:
            return text
        grads = self.nonfinite_gradients
        listed = ", ".join(grads[:overflow.NAMED])
        if len(grads) > overflow.NAMED:
            listed += f", and {len(grads) - overflow.NAMED} more"
        return f"{text}. Loss {self.loss:g} at loss scale {self.loss_scale:g}: " + (
            f"non-finite gradients: {listed}" if grads else "gradients finite")


_WHAT = {OUTPUT_INF: "output inf", OUTPUT_NAN: "output nan", INPUTS: "inputs not finite", BATCH: "batch not finite"}
_CODES = {text: code for code, text in _WHAT.items()} | {None: NOTHING}


def find_overflow(model: keras.Model, x, y=None, sample_weight=None, *, training=True) -> OverflowReport:
    """Runs one batch through `model` eagerly and says where it stops being finite.

    Nothing is written: BatchNormalization statistics, seed generators and
    the weights are as before. With `y` and a compiled loss, also takes the
    gradients of the loss times the optimizer's current loss scale (1 without
    a LossScaleOptimizer) and lists the variables whose gradient is not
    finite. Works for Functional, Sequential and subclassed models.
    """
    table = layer_table(model)
    wants_grads = y is not None and getattr(model, "compiled", False)
    with tf.GradientTape() as tape, _recording(table) as recorder:
        recorder.begin()
        try:
            with keras.StatelessScope(collect_losses=True):
                y_pred = _call(model, x, training)
                if wants_grads:
                    loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                              training=training)
        finally:
            notes = recorder.end()
        if wants_grads:
            optimizer = getattr(model, "optimizer", None)
            scale = tf.constant(1.0) if optimizer is None else optimizer.scale_loss(tf.constant(1.0))
            scaled = tf.cast(loss, tf.float32) * tf.cast(scale, tf.float32)
    layer, what = (int(v) for v in culprit(notes, _all_finite(_floats(x))))
    inputs_max, output_max = _culprit_call(notes, layer)
    grads_bad: tuple[str, ...] = ()
    loss_value = scale_value = None
    if wants_grads:
        variables = model.trainable_variables
        grads = tape.gradient(scaled, variables)
        grads_bad = tuple(v.path for v, g in zip(variables, grads) if g is not None and not _finite_now(g))
        loss_value, scale_value = float(loss), float(scale)
    return OverflowReport(
        layer=table[layer][1] if layer >= 0 else None,
        layer_class=type(table[layer][0]).__name__ if layer >= 0 else None,
        what=_WHAT.get(what),
        output_max=output_max, inputs_max=inputs_max,
        loss=loss_value, loss_scale=scale_value, nonfinite_gradients=grads_bad,
    )


def _finite_now(grad) -> bool:
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    return bool(tf.reduce_all(tf.math.is_finite(values)))


def _culprit_call(notes, layer):
    """(max |inputs|, max |output|) of the named call, as Python floats."""
    if layer < 0:
        return None, None
    starts = [k for k, n in enumerate(notes) if n.start and n.index == layer]
    for k, note in enumerate(notes):  # the first bad note belongs to this call
        if not bool(note.finite):
            start = k if note.start else max(s for s in starts if s < k)
            end = next(j for j in range(start + 1, len(notes)) if notes[j].index == layer and not notes[j].start)
            return float(notes[start].largest), float(notes[end].largest)
    return None, None
