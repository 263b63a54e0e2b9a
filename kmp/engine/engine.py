"""The flat-buffer engine: fit() trains kmp.engine.buffers's buffers; the Keras variables are copies kept
current when observed.

A prepared model (`kmp.prepare(model, flat_buffers=True)`) trains with this
step, in replica context, on one device or several:

    weights = this replica's flat float32 weights
    grad, y_pred, loss, writes = forward_backward(weights, ...)   # XLA: the weights
                                 # split into the variables' values; the gradient one flat,
                                 # unscaled float32 tensor
    optimizer.apply_flat(grad)   # accumulate, ONE all-reduce (in buckets), one finite
                                 # check, clip, ONE XLA update of weights and slots (replicas
                                 # of one process on CPUs: each of its shard, kmp.engine.buffers)
    writes (BatchNorm statistics), loss tracker, metrics      # as Keras's train_step

No op on that path touches a per-variable optimizer state; the only
per-variable work left is the forward/backward pass itself.

Between calls of fit() and train_on_batch() the Keras variables are the
truth: each call stores the buffers into them when it ends, however it ends
(as Keras's JAX trainer syncs its state after each train_on_batch), and
loads the buffers whose variables were written since when it starts
(kmp.engine.buffers.written_since_store). Any read or write between calls,
by any route (`variable.assign`, `layer.set_weights`, a tf.function of the
user's own), is what stock Keras would see.

Inside fit() the buffers are the truth and the Keras variables lag. Like
Keras's JAX trainer (which keeps its state as arrays and writes them back
with `jax_state_sync` when observed), the engine copies the buffers into
the Keras variables before anything in fit() can observe them, and back
when something may have written them:

    buffers -> Keras variables (store), when the buffers are newer, before:
        save / save_weights, called on the model;
        evaluate / predict / get_weights / test_on_batch / predict_on_batch /
        export, called on the model (validation in fit() too): the weights only,
        the optimizer state when next something reads it (at the latest, the end);
        on_train_end (before the callbacks), and a TensorBoard's on_epoch_end where it logs
        histograms (the known callbacks' other epoch-end reads go through the model's methods above);
        each hook of a callback kmp does not know, that the callback overrides;
        an overflowing step's layer diagnosis (its forward pass reads them).
    Keras variables -> buffers (load, of what was written since the last store), before the next step, after:
        set_weights / load_weights on the model (Keras's BackupAndRestore and
        EarlyStopping restore through them; kmp's BackupAndRestore says so
        itself);
        each overridden hook (epoch or batch) of a callback kmp does not know.

Under MultiWorkerMirroredStrategy at ZeRO stage 1 each worker holds its
replicas' shards of the optimizer state, and storing the state gathers the
others' (a collective: kmp.engine.zero). It is stored where every worker is at the
same point: fit()'s end, callbacks' hooks, and the model's
save, save_weights and its writers (TensorFlow's multi-worker rule: every
worker calls them). The model's other readers (get_weights, evaluate,
predict, ...), which one worker may call alone, get the weights only.

Callbacks known to read and write no weights in their batch hooks, or to do
it only through the model's methods above, cost nothing per batch: Keras's
History, ProgbarLogger, TerminateOnNaN, CSVLogger, TensorBoard,
EarlyStopping, ReduceLROnPlateau, LearningRateScheduler, ModelCheckpoint,
BackupAndRestore, and kmp's callbacks. Another callback whose batch hooks
do neither can say so with `kmp_reads_weights = False` (a class or instance
attribute); otherwise each of its overridden batch hooks costs a copy each
way, and kmp says so once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

import keras
import tensorflow as tf

from kmp import seams
from kmp.engine import host_batches, replica_step
from kmp.engine import state as kmp_state
from kmp.engine import xla_choice
from kmp.engine import buffers as flat
from kmp.scaling import overflow
from kmp.scaling.replay import Replay

logger = logging.getLogger(__name__)

FLAT, SAME, KERAS = "buffers newer", "same", "keras newer"
STATE = "buffers' state newer"  # some buffers stored (the weights, or all but the sharded state), not all
# What an observe stores (Engine.observe): everything; what needs no gather across workers; the weights only.
ALL, NO_GATHER, WEIGHTS = "all", "no gather", "weights"

# Where the flat weights are split into the variables' values: in the XLA
# forward/backward (no copy), or before it, for models of more variables than
# this. XLA's compile time grows with the slices of one input (twice as long
# for P5's 1004 variables, benchmarks/p5_small_variables.py); but TensorFlow's split copies the
# weights (4 bytes per parameter per step), which models of few large
# variables would pay for nothing.
SPLIT_IN_XLA_UP_TO = 256

_READERS = ("evaluate", "predict", "save", "save_weights", "get_weights", "test_on_batch", "predict_on_batch",
            "export")
_SAVERS = ("save", "save_weights")  # the readers of the optimizer state
_WRITERS = ("set_weights", "load_weights")
_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_batch_begin", "on_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


_KERAS_KNOWN = ("History", "ProgbarLogger", "TerminateOnNaN", "CSVLogger", "TensorBoard", "EarlyStopping",
                "ReduceLROnPlateau", "LearningRateScheduler", "ModelCheckpoint", "BackupAndRestore")
# kmp's own callbacks, by module: kmp.callbacks sits above this engine and imports it.
_KMP_KNOWN = ("kmp.callbacks.monitor", "kmp.callbacks.backup")


def _is_known(callback) -> bool:
    kind = type(callback)
    return (kind.__module__ in _KMP_KNOWN
            or any(kind is getattr(keras.callbacks, name) for name in _KERAS_KNOWN))


class Engine:
    """The flat buffers of one prepared model and when they are copied (see the module docstring)."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.buffers = flat.FlatBuffers(model)
        self.buffers.load()
        self.state = SAME
        self.lagging = ()  # in STATE, the buffers not stored yet
        self.noted = set()  # callback classes whose per-batch copies were announced
        self._steps = {}  # the compiled forward/backward, by replica (_compiled)

    # --- The state machine ---

    def stepped(self) -> None:
        if self.state != FLAT:
            self.buffers.forget_stores()  # the buffers move on: what was stored is old
        self.state = FLAT

    def before_step(self) -> None:
        if self.state == KERAS:
            # Only what was written since the last store (usually nothing: a fit() after a fit()).
            names = self.buffers.written_since_store()
            if names:
                self.buffers.load(names)
            self.state = SAME

    def observe(self, what: str = ALL) -> None:
        """The Keras variables made current: all of them (ALL); or all but a state sharded across workers
        (NO_GATHER: no collective, see the module docstring); or the model's weights only (WEIGHTS, for the
        readers of the model alone: evaluate reads no optimizer state), the rest stored when next observed."""
        if self.state not in (FLAT, STATE):
            return
        buffers = self.buffers
        lagging = tuple(buffers.buffers) if self.state == FLAT else self.lagging
        names = [n for n in lagging
                 if not (what != ALL and buffers.layout.across_workers and buffers.is_shard(n))
                 and (what != WEIGHTS or n in flat.WEIGHT_BUFFERS)]
        if names:
            buffers.store(names)
        self.lagging = tuple(n for n in lagging if n not in names)
        self.state = STATE if self.lagging else SAME

    def written(self) -> None:
        self.observe()  # what was not written must be current too
        self.state = KERAS

    def forget_compiled(self) -> None:
        """For a new train function (after compile(), a new prepare()): the forward/backward is traced
        again, since a compiled one holds the old loss and metrics."""
        self._steps = {}

    def release(self) -> None:
        """Before Keras's per-variable update trains the model instead: its slot variables current,
        on every replica (kmp.engine.zero), and loaded again if the buffers come back."""
        self.written()
        self.buffers.forget_stores()
        self.buffers.place_slots(on_host=False)

    # --- The step (replica context) ---

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        model, buffers = self.model, self.buffers
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        other_values = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables + model.metrics_variables]
        scale = tf.convert_to_tensor(model.optimizer.scale_loss(tf.constant(1.0)))
        weights = buffers.read_weights()
        if len(buffers.sizes) > SPLIT_IN_XLA_UP_TO:
            weights = buffers.split(weights)
        weight = replica_step.row_weight(model, x)
        weighted = scale if weight is None else scale * weight  # the loss's factor; the gradient is unscaled by scale
        grad, y_pred, loss, writes = self._compiled()(weights, other_values, scale,
                                                      replica_step.in_turn(model, weighted), x, y, sample_weight)
        replica_step.passed(model, loss)
        replica_step.apply_writes_and_track_loss(model, writes, loss, x)
        # The layer diagnosis traced after an overflowing step (the whole step
        # in XLA) runs the model on its Keras variables; outside XLA it runs
        # eagerly and copies them itself (kmp.engine.overflow_layer).
        traced_diagnosis = kmp_state.setting(model, "find_overflow_layer") and overflow.in_xla()
        before = tf.convert_to_tensor(model.optimizer.skipped_steps.value) if traced_diagnosis else None
        replay = None
        if replica_step.replays(model):
            def again(new_scale):  # the same batch, weights and seeds, at another loss scale
                factor = new_scale if weight is None else new_scale * weight
                return self._compiled()(weights, other_values, new_scale, factor, x, y, sample_weight)[0]

            replay = Replay(again, loss)
        model.optimizer.apply_flat(grad, buffers, replay=replay)
        if traced_diagnosis:
            overflowed = tf.convert_to_tensor(model.optimizer.skipped_steps.value) > before
            tf.cond(overflowed, lambda: buffers.store_weights_here() or tf.no_op(), tf.no_op)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def forget_steps(self) -> None:
        """Drops the traced forward/backward functions: the next step traces the model again (a layer's
        dtype policy changed: kmp.engine.forward_overflow)."""
        self.__dict__.pop("_steps", None)

    def _compiled(self):
        key = replica_step.replica_key()
        cache = self._steps
        if key not in cache:
            cache[key] = (replica_step.compiled(self.model, self._forward_backward) if self.xla
                          else xla_choice.plain(self._forward_backward))
        return cache[key]

    @property
    def xla(self) -> bool:
        """Whether the forward/backward is compiled: unless prepare(jit_compile=False), a layer does not
        support XLA, or XLA failed on the model (kmp.engine.prepare); and unless its trace predicts minutes of
        compile (kmp.engine.xla_choice). The update (kmp.engine.buffers) always is."""
        model = self.model
        return (kmp_state.setting(model, "jit_compile") is not False and bool(seams.get("model_supports_jit")(model))
                and replica_step.XLA not in replica_step.path_of(model)["dropped"])

    def _forward_backward(self, weights, other_values, scale, weighted, x, y, sample_weight):
        with tf.GradientTape() as tape:
            values = weights if isinstance(weights, list) else self.buffers.split(weights)
            tape.watch(values)
            y_pred, loss, writes = replica_step.stateless_loss(self.model, values, other_values, x, y, sample_weight)
            scaled = keras.ops.multiply(loss, weighted)
        grads = tape.gradient(scaled, values)
        # Zeros where a variable got no gradient (it is then not updated); unscaled
        # here, fused into this computation.
        return self.buffers.join(grads, scale), y_pred, loss, writes


def _overridden(callback) -> set:
    base = keras.callbacks.Callback
    return {h for h in _HOOKS if h in vars(callback) or getattr(type(callback), h, None) is not getattr(base, h)}


class _Sync(keras.callbacks.Callback):
    """First in fit()'s list: the buffers are copied out before the run's end hooks. Not at each epoch's
    end: the callbacks kmp knows read the weights there through the model's methods, which copy them."""

    def on_train_end(self, logs=None):
        observe(self.model)


class _Around(keras.callbacks.Callback):
    """Just before (or after) a callback kmp does not know: a copy out (or in) around its overridden hooks."""

    def __init__(self, callback, hooks: set, before: bool, what: str = ALL):
        super().__init__()
        self.watched, self.before, self.what = callback, before, what
        for hook in hooks:
            setattr(self, hook, functools.partial(self._around, hook))

    def _around(self, hook, *_, **__):
        engine = _engine_behind(self)
        if engine is None:
            return
        if self.before and "batch" in hook and type(self.watched) not in engine.noted:
            engine.noted.add(type(self.watched))
            logger.warning(
                "kmp: %s overrides %s: the flat-buffer engine copies the weights to the model before each "
                "call and back after it. If it neither reads nor writes weights there, set "
                "kmp_reads_weights = False on it.", type(self.watched).__name__, hook)
        if self.before:
            engine.observe(self.what)
        else:
            engine.written()


def callbacks(model: keras.Model, given) -> list:
    """fit()'s callbacks with the copies around them (they do nothing while no engine is built)."""
    given = keras.tree.flatten(given) if given else []
    out = [_Sync()]
    for callback in given:
        hooks = _overridden(callback)
        if type(callback) is keras.callbacks.TensorBoard and callback.histogram_freq:
            # Its histograms read the model's variables themselves at an epoch's end: the weights out before.
            out += [_Around(callback, {"on_epoch_end"}, before=True, what=WEIGHTS), callback]
            continue
        # Exact types: a subclass may read weights in a hook it overrides.
        if _is_known(callback) or getattr(callback, "kmp_reads_weights", True) is False or not hooks:
            out.append(callback)
            continue
        out += [_Around(callback, hooks, before=True), callback, _Around(callback, hooks, before=False)]
    return out


def observe(model_or_callback, *_, what: str = ALL, **__) -> None:
    """Before something reads the Keras variables of `model` (or a callback's model): they get the buffers
    (all of them, or part: Engine.observe)."""
    engine = _engine_behind(model_or_callback)
    if engine is not None:
        engine.observe(what)


def _observe_weights(model, *_, **__) -> None:
    observe(model, what=WEIGHTS)


def written(model_or_callback, *_, **__) -> None:
    """Before (or after) something writes the Keras variables: the buffers reload them before the next step."""
    engine = _engine_behind(model_or_callback)
    if engine is not None:
        engine.written()


# --- The model's methods (installed by kmp.prepare) ---


def install(model: keras.Model) -> None:
    """Wraps the model's observing and writing methods on this instance (idempotent)."""
    prepared = kmp_state.ensure(model)
    if prepared.engine_methods:
        return
    prepared.engine_methods = True
    for name in _READERS + _WRITERS + ("fit", "train_on_batch"):
        stock = getattr(type(model), name, None)
        if stock is None:
            continue
        if name in ("fit", "evaluate"):  # their data handed over, as kmp.prepare does without the buffers
            stock = host_batches.handing_over(stock, fit=name == "fit")
        first = written if name in _WRITERS else observe if name in _SAVERS else _observe_weights
        if name == "fit":
            method = _fit(stock)
        elif name == "train_on_batch":
            method = _training(stock, stock)
        else:
            method = _calling_first(first, stock)
        setattr(model, name, types.MethodType(method, model))


def engine_of(model: keras.Model) -> Engine | None:
    prepared = kmp_state.of(model)
    return None if prepared is None else prepared.engine


def _engine_behind(model_or_callback) -> Engine | None:
    if isinstance(model_or_callback, keras.callbacks.Callback):
        model_or_callback = model_or_callback.model
    return engine_of(model_or_callback) if isinstance(model_or_callback, keras.Model) else None


def _calling_first(first, stock):
    """`stock`, with `first(model)` (observe or written) called before it."""

    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        first(self)
        return stock(self, *args, **kwargs)

    return method


def _fit(stock):
    parameters = inspect.signature(stock)

    def fit(self, *args, **kwargs):
        bound = parameters.bind(self, *args, **kwargs)
        bound.arguments["callbacks"] = callbacks(self, bound.arguments.get("callbacks"))
        return stock(*bound.args, **bound.kwargs)

    return _training(fit, stock)


def _training(call, stock):
    """`call`, trained from the Keras variables and leaving them current, however it ends.

    Before it, the buffers are loaded: anything may have written the
    variables since (`variable.assign`, `layer.set_weights`, code of the
    user's own between train_on_batch calls). After it, they are stored, as
    Keras's JAX trainer syncs its state after each train_on_batch.
    """

    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        written(self)
        try:
            result = call(self, *args, **kwargs)
        except BaseException:
            # The other workers may not come to a gather of the state: all but that.
            observe(self, what=NO_GATHER)
            raise
        observe(self)
        return result

    return method

