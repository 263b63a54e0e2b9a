"""prepare(model): Keras's fit() under tf.distribute strategies, working and fast.

Keras 3.15 fails twice under MultiWorkerMirroredStrategy on TensorFlow
(keras-team/keras#20585): `_maybe_symbolic_build` all-reduces the first data
batch only to learn its shapes ("Attempt to convert a value (PerReplica:...)
to a Tensor", before the first step), and every step's logs are reduced with
`axis=0`, which fails for scalars. And under any strategy with several
replicas it turns XLA off (or fails when asked for it). `prepare` replaces
two methods of the given instance only, delegating to Keras's, and, with
several replicas, swaps Keras's train step for kmp.engine.replica_step's
(XLA per replica). On any number of replicas it also wraps the train step
so that an overflow names the layer whose forward output overflowed
(kmp.engine.overflow_layer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import traceback
import types

import keras
import tensorflow as tf

from kmp import seams, values
from kmp.distribute.leaving import leave_last
from kmp.distribute.tpu import is_tpu_strategy
from kmp.engine import engine, forward_overflow, host_batches, iterators, lower_precision, overflow_layer, recompute
from kmp.engine import replica_step
from kmp.engine import state, wall_clock
from kmp.engine import buffers as flat
from kmp.engine.replica_step import FINDER, FLAT, XLA
from kmp.errors import KmpError, Problem, check
from kmp.scaling import overflow
from kmp.scaling.optimizer import LossScaleOptimizer

logger = logging.getLogger(__name__)


def prepare(model: keras.Model, *, jit_compile: bool | str = "auto", find_overflow_layer: bool = True,
            flat_buffers: bool | str = "auto", wall_clock_breakdown: bool | int | str = "auto",
            activation_checkpointing: bool | str | list = "auto") -> keras.Model:
    """Make `model.fit()` work, and fast, under tf.distribute strategies; returns `model`.

    Call it after creating the model (in the strategy's scope, as Keras
    requires) and before `fit()`; inside or outside the scope both work.
    Calling it again only changes its settings. It changes this instance
    only: other models, and Keras's classes, are untouched.

    `jit_compile`, with several replicas (Mirrored, MultiWorkerMirrored):
    "auto" or True compiles each replica's forward/backward pass with XLA
    (kmp.engine.replica_step; "auto" unless a layer does not support XLA), and the
    all-reduce stays outside; False keeps Keras's step without XLA. Keras's
    own `compile(jit_compile=True)`, which fails under a strategy, is turned
    into the same. On one replica, True turns Keras's whole-step XLA on and
    "auto"/False leave the compile() setting as it is.

    `find_overflow_layer` (any number of replicas, with kmp's
    LossScaleOptimizer and Keras's own train step): after a step whose
    gradients overflowed, and only then, the forward pass of that step's
    batch runs again layer by layer, writing nothing, and the overflow line
    and `kmp.callbacks.LossScaleMonitor`'s `overflow_layer` name the first
    layer whose output was not finite while its inputs were
    (kmp.engine.overflow_layer). A clean step pays two reads of a counter and a
    branch not taken; tracing and XLA compilation take longer (the forward
    pass is traced twice). On one device without a strategy, an optimizer
    not built before the first step is built at its start from the batch's
    shapes, as Keras does under a strategy. False: the step is left as it is.

    `flat_buffers` (kmp.engine): "auto" or True trains the float32 master
    weights, the optimizer's slots and the accumulation sums as a few flat
    buffers (kmp.engine.buffers), on any number of replicas: one all-reduce, one
    overflow check and one XLA update per step, whatever the number of
    variables. The Keras variables are kept current wherever they can be
    observed (kmp.engine lists where); for that the model's evaluate,
    predict, save, save_weights, get_weights, set_weights, load_weights and
    fit are wrapped on this instance. "auto" falls back to the per-variable
    path, with a one-line note, where the buffers do not apply (an optimizer
    other than SGD, Adam, AdamW, Lion, Adagrad, Lamb; float64 variables;
    see kmp.engine.buffers.support); True says the same as a warning. False: off.

    `wall_clock_breakdown` (kmp.engine.wall_clock): True or N prints, every N steps
    (True: 10, DeepSpeed's `steps_per_print` default), the mean ms per step
    of data wait, forward+backward, all-reduce, loss-scale bookkeeping and
    update, as DeepSpeed's `"wall_clock_breakdown": true` does, and puts
    them in the logs. "auto": what `kmp.wrap` was told (the config's key),
    else off. On one device the timed step is not compiled as one XLA
    computation (a stamp cannot be placed inside one); this is said once.

    `activation_checkpointing` (kmp.engine.recompute): True recomputes each
    block's activations in the backward pass instead of keeping them: the
    blocks are every instance of the most repeated class of layers that
    hold layers (a keras-hub transformer's blocks; said in one line, as is a
    model where no class repeats). A list of layer names or classes names
    the blocks. "auto": on if the DeepSpeed config `kmp.wrap` was given has
    an `activation_checkpointing` block, else off. False: off (the blocks'
    own calls back).

    A DeepSpeed config given to `kmp.wrap` with `torch_autocast` enabled:
    every layer with no layers inside whose class is not one its
    `lower_precision_safe_modules` maps to computes in float32 (a float32
    dtype policy; its weights are float32 already), said in one line
    (kmp.engine.lower_precision).

    A `keras.optimizers.LossScaleOptimizer` on the model (compile() wraps any
    optimizer in it under mixed_float16) is replaced by kmp's on the same
    inner optimizer, initial scale and growth interval, with one logged line:
    Keras's checks only the first replica's gradients for inf/nan.

    Two of the instance's methods are replaced, each delegating to Keras's
    (besides the XLA step above):

    1. `_maybe_symbolic_build`: before the first step Keras builds the model,
       metrics and optimizer from the shapes and dtypes of one data batch,
       which it gets from the distributed first batch as

           batch = strategy.reduce("MEAN", first_batch, axis=None)      # Keras
           batch = strategy.experimental_local_results(first_batch)[0]  # prepared

       Every replica's share of a global batch has the same shapes. Keras's
       reduce fails across workers (keras-team/keras#20585), and it turns
       integer labels into float64; one local replica's share needs no
       communication and has the dtypes the train step will see. Without a
       strategy Keras builds inside the first step instead; the prepared
       model builds before it, from the dataset's element spec, so the step
       is traced once (`_build_on_one_device`).
    2. `_make_function`, which builds the train and test functions:
       - with several replicas, the XLA train step above;
       - `find_overflow_layer`: the train step wrapped as said above;
       - multi-worker: Keras reduces each step's logs with
         `strategy.reduce("MEAN", v, axis=0)`, which fails for a scalar
         loss. The step's outputs get a leading axis of 1, so that same
         reduce is the mean over replicas and returns the original shape;
       - `steps_per_execution > 1` with several replicas (not TPU): Keras's
         loop fails under Mirrored and MultiWorkerMirrored
         (keras-team/keras#19246); kmp's runs the same steps (`_own_loop`);
       - several CPU replicas of one process: fit()'s and evaluate()'s global
         batches are read on the host and split in the step
         (kmp.engine.host_batches).

    And `fit` and `evaluate` are wrapped: there, the data is made into Keras's
    own data adapter before Keras's call, whose dataset is then distributed
    only if something other than the split step reads it
    (kmp.engine.host_batches.hand_over).

    The train and test functions it builds hand each input iterator to a
    thread of kmp's, which destroys it once nothing else holds it
    (kmp.engine.iterators): fit() never waits for tf.data's teardown. Each
    epoch's iterator is made when a step first reads it: Keras makes one
    after the last epoch too, which nothing reads.

    Under MultiWorkerMirroredStrategy the workers leave together at exit,
    the coordination leader (chief 0, else worker 0) last
    (kmp.distribute.leaving).
    """
    stock = getattr(type(model), "_maybe_symbolic_build", None)
    if not isinstance(model, keras.Model) or stock is None:
        check([Problem("model", "a keras.Model built by Keras's TensorFlow backend", type(model).__name__,
                       "Pass the model itself, e.g. kmp.distribute.prepare(model).")],
              "kmp.distribute.prepare arguments")
    problems = []
    if jit_compile not in replica_step.JIT_CHOICES:
        problems.append(Problem("jit_compile", '"auto", True or False', jit_compile))
    values.boolean("find_overflow_layer", find_overflow_layer, problems)
    if flat_buffers not in ("auto", True, False):
        problems.append(Problem("flat_buffers", '"auto", True or False', flat_buffers))
    if not (wall_clock_breakdown in ("auto", True, False) or values.is_int(wall_clock_breakdown)
            and wall_clock_breakdown >= 1):
        problems.append(Problem("wall_clock_breakdown", '"auto", True, False or the steps between lines (>= 1)',
                                wall_clock_breakdown))
    blocks = recompute.blocks_of(model, activation_checkpointing, problems)
    check(problems, "kmp.distribute.prepare arguments")
    kept = state.ensure(model)  # model.__dict__["_kmp"]: all kmp keeps on the model
    if isinstance(activation_checkpointing, (list, tuple)):
        activation_checkpointing = tuple(activation_checkpointing)
    settings = (jit_compile, find_overflow_layer, flat_buffers, wall_clock_breakdown, activation_checkpointing)
    if kept.prepared and kept.settings != settings:
        model.train_function = None  # built with the old settings: rebuild at the next fit()
    (kept.jit_compile, kept.find_overflow_layer, kept.flat_buffers, kept.wall_clock_breakdown,
     kept.activation_checkpointing) = settings
    kept.prepared = True
    lower_precision.apply(model, getattr(getattr(model, "optimizer", None), "kmp_lower_precision_safe_modules",
                                         None))
    recompute.apply(model, blocks)
    leave_last(model.distribute_strategy)  # a strategy users built themselves, not resolve_strategy's
    _with_kmp_loss_scaling(model)
    if flat_buffers:
        engine.install(model)  # its fit() and evaluate() hand the data over too
    elif not kept.engine_methods:
        for name in ("fit", "evaluate"):  # the data handed over (kmp.engine.host_batches)
            stock = host_batches.handing_over(getattr(type(model), name), fit=name == "fit")
            setattr(model, name, types.MethodType(stock, model))
    if is_prepared(model):
        return model
    # Bound methods stored on the instance shadow the class's methods for
    # this instance only (tests/test_distribute.py checks both).
    for name, method in _REPLACEMENTS.items():
        setattr(model, name, types.MethodType(method, model))
    return model


def _with_kmp_loss_scaling(model: keras.Model) -> None:
    """Keras's LossScaleOptimizer on the model replaced by kmp's, on the same inner optimizer and settings.

    compile() wraps any optimizer in Keras's class under mixed_float16. Under
    a strategy it checks replica 0's local gradients only, so an inf on another
    replica reaches the weights; kmp's checks the all-reduced ones (and is what
    the flat buffers train with).
    """
    stock = model.optimizer if model.compiled else None
    if type(stock) is not keras.optimizers.LossScaleOptimizer:
        return
    scale = float(stock.dynamic_scale.numpy()) if stock.built else stock.initial_scale
    with model.distribute_strategy.scope():
        ours = LossScaleOptimizer(stock.inner_optimizer, initial_scale=scale,
                                  dynamic_growth_steps=stock.dynamic_growth_steps, name=stock.name)
    model.optimizer = ours
    model._compile_config.config["optimizer"] = ours  # what save() writes: reloaded with kmp's class
    model.train_function = None
    logger.warning("kmp: prepare replaced %s's keras.optimizers.LossScaleOptimizer (compile() adds it under "
                   "mixed_float16) by kmp.LossScaleOptimizer on the same %s, initial_scale=%g, "
                   "dynamic_growth_steps=%d: Keras's checks only the first replica's gradients for inf/nan, kmp's "
                   "the all-reduced ones, and raises kmp.LossScaleError at its floor of 1. kmp.wrap(optimizer) in "
                   "compile() gives kmp's directly.",
                   model.name, type(stock.inner_optimizer).__name__, scale, stock.dynamic_growth_steps)


def is_prepared(model: keras.Model) -> bool:
    """Whether `prepare(model)` was called on this instance."""
    return all(
        getattr(vars(model).get(name), "__func__", None) is method for name, method in _REPLACEMENTS.items()
    )


def _build_from_local_batch(self, iterator=None, data_batch=None):
    if iterator is not None:  # Keras's epoch iterator for this fit() or evaluate()
        distributed = getattr(iterator, "_distributed_dataset", None)
        iterators.defer_next_epochs(iterator, host_batches.undistributed(self.distribute_strategy, distributed))
    if self._distribute_strategy is None:
        return _build_on_one_device(self, iterator, data_batch)
    # Keras's method skips its reduce when handed a batch instead of an
    # iterator; hand it one replica's share of the first batch. Only when
    # something is still unbuilt: Keras reads the batch then only, and drawing
    # it costs every later fit() and evaluate() a new distributed iterator.
    if iterator is not None:
        if _unbuilt(self):
            for _, _, batches in iterator:
                data_batch = local_batch(self.distribute_strategy, next(batches))
                break
        iterator = None
    return type(self)._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)


def _build_on_one_device(model, iterator, data_batch) -> None:
    """What Keras builds inside the first step without a strategy (layers, compiled metrics and
    loss, the optimizer), built before it from the data's shapes, as Keras does under one.

    Variables made in a tf.function's first trace make TensorFlow trace the whole step twice. A
    model Keras cannot build from shapes alone is left to build in its first step, as without kmp.
    """
    if not _unbuilt(model) and (model.optimizer is None or model.optimizer.built):
        return
    if data_batch is None:
        # The shapes and dtypes of Keras's epoch iterator's dataset: no batch drawn.
        dataset = getattr(iterator, "_distributed_dataset", None)
        if dataset is None:
            return
        data_batch = dataset.element_spec
    stack = seams.get("get_global_attribute")("name_scope_stack", default=[], set_to_default=True)
    depth = len(stack)
    try:
        model._symbolic_build(data_batch=data_batch)
    except Exception as error:  # noqa: BLE001 - the first step builds it, as in stock Keras
        # Keras opens a layer's name scope before TensorFlow's, which may refuse the name: close it.
        del stack[depth:]
        logger.info("kmp: %s is built in its first step, as Keras does without a strategy: %s", model.name, error)


def _unbuilt(model) -> bool:
    """Whether Keras's `_symbolic_build` needs a batch: a layer, the compiled metrics or loss unbuilt."""
    compiled = [model._compile_metrics, model._compile_loss]
    return not all(layer.built for layer in model._flatten_layers()) or any(
        c is not None and not c.built for c in compiled)


def _make_function_prepared(self, step_function):
    if getattr(step_function, "__func__", None) is getattr(type(self), "test_step", None):
        return _build_function(self, step_function, train=False)  # evaluate()'s
    if getattr(step_function, "__func__", None) is not seams.get("TensorFlowTrainer").train_step:
        return _build_function(self, step_function)  # the model's own train_step
    # Made again when a layer moves to float32 (forward_overflow="float32").
    return forward_overflow.watching(self, lambda: _falling_back(self, step_function))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one train function is made of, decided once per build (_plan)."""

    step: object          # the per-replica step: Keras's, the model's own, kmp.engine.replica_step's or the engine's
    engine: object        # the flat buffers' engine (kmp.engine.engine.Engine), or None: per-variable update
    stock: bool           # Keras's own train_step (a model's own is kept, on the per-variable path)
    kmp_step: bool        # kmp's step (the engine's or kmp.engine.replica_step's), not Keras's
    whole_step_xla: bool  # Keras's jit_compile: the whole step one XLA computation (one device only)
    replica_xla: bool     # kmp's step, its forward/backward compiled per replica
    finder: bool          # the overflow-layer finder wraps the step
    every: int            # the wall-clock breakdown's lines every `every` steps (0: off)
    timed_apart: bool     # timed on one device: compiled in parts, as under a strategy


def _plan(model, step_function) -> _Plan:
    setting = state.setting(model, "jit_compile")
    dropped = replica_step.path_of(model)["dropped"]
    if XLA in dropped:
        setting = False
    several = model.distribute_strategy.num_replicas_in_sync > 1
    # Only Keras's own train_step is swapped: a model's custom one is kept.
    stock = getattr(step_function, "__func__", None) is seams.get("TensorFlowTrainer").train_step
    every = wall_clock.interval(_breakdown_setting(model))
    xla = _xla_asked(model)
    # Timed on one device: the parts compiled as under a strategy, since no stamp fits inside one XLA step.
    timed_apart = bool(every) and xla and not several
    # Replaying an overflowing step recomputes its forward/backward: on one device too, kmp's step, which can.
    if stock and (replica_step.wants_replica_xla(model, setting) or timed_apart or replica_step.replays(model)):
        # A new train function (after compile(), a new prepare(), frozen
        # layers) traces new XLA functions: a cached one holds the old loss,
        # metrics and trainable variables.
        replica_step.forget(model)
        step_function = functools.partial(replica_step.train_step, model)
    if not stock:
        flat_engine = _no_engine(model, "the model has its own train_step")
    elif FLAT in dropped:
        flat_engine = _no_engine(model, None)  # said when it was dropped
    else:
        flat_engine = _engine_for(model)
    if flat_engine is not None:
        replica_step.forget(model)
        step_function = flat_engine.train_step
    kmp_step = flat_engine is not None or getattr(step_function, "func", None) is replica_step.train_step
    # A custom train_step may not call the model on x as Keras's does: left as it is.
    finder = (stock and bool(state.setting(model, "find_overflow_layer")) and FINDER not in dropped
              and overflow_layer.can_diagnose(model))
    # Keras's jit_compile puts the whole distributed step in one XLA
    # computation, which fails with several replicas.
    return _Plan(step=step_function, engine=flat_engine, stock=stock, kmp_step=kmp_step,
                 whole_step_xla=xla and not several and not timed_apart,
                 replica_xla=kmp_step and (flat_engine.xla if flat_engine is not None else several or xla),
                 finder=finder, every=every,
                 timed_apart=timed_apart)


def _build_function(self, step_function, train: bool = True):
    """The train function (or, with train=False, the test function) of a prepared model."""
    plan = _plan(self, step_function) if train else _test_plan(self, step_function)
    step_function = plan.step
    if plan.finder:
        step_function = overflow_layer.diagnosing_step(self, step_function)
    if plan.every:
        step_function = wall_clock.timed_step(step_function)
    # Under MultiWorkerMirroredStrategy, Keras reduces each step's outputs
    # (the logs) with strategy.reduce("MEAN", v, axis=0), which fails for
    # scalars and averages a vector's entries. With a leading axis of 1 per
    # replica, that same reduce is the mean over replicas, shape unchanged.
    if seams.get("collective_all_reduce_multi_worker")(self.distribute_strategy):
        step_function = _with_replica_axis(step_function)
    saved, self._jit_compile = self._jit_compile, plan.whole_step_xla
    try:
        function = type(self)._make_function(self, step_function)
    finally:
        self._jit_compile = saved
    # Global batches from the host, split in the step (kmp.engine.host_batches).
    strategy = self.distribute_strategy
    on_host = not self.run_eagerly and host_batches.possible(strategy)
    if on_host or (self.steps_per_execution > 1 and not self.run_eagerly and replica_step.splits_replicas(strategy)):
        function = _own_loop(self, step_function, function)
    if plan.engine is not None:
        function = _around_steps(plan.engine, function)
    if plan.every:
        function = _timed(self, plan, function)
    if train:
        replica_step.path_of(self).update(taken=_path_taken(plan), off={})
        function = _in_its_own_strategy(self, function)
    # The main thread never destroys an input iterator (that waits on tf.data's autotune thread).
    # The floor's check after each call is the one kmp's optimizer puts around the model's train function.
    return overflow.raising_loss_scale_errors(iterators.releasing(function, on_host))


class StrategyMismatchError(KmpError, ValueError):
    """fit() inside the scope of a strategy other than the one the model was built in."""


def _in_its_own_strategy(model, function):
    """`function` (a train function), which refuses to run inside another strategy's scope than the model's.

    Keras makes a model's variables for the strategy whose scope it is built in, and trains under the strategy
    whose scope fit() runs in: with another, its step fails deep in the graph (stock Keras's, an AssertionError).
    Evaluation and prediction run there as stock Keras's do.
    """

    def call(iterator):
        ambient = tf.distribute.get_strategy()
        if tf.distribute.has_strategy() and model._distribute_strategy is not ambient:
            built = ("outside any strategy's scope" if model._distribute_strategy is None
                     else f"under another {type(model._distribute_strategy).__name__}")
            raise StrategyMismatchError(
                f"kmp: {model.name} was built {built}, and is trained inside a {type(ambient).__name__}'s scope, "
                "whose replicas its variables are not on: build and compile the model inside that "
                "`with strategy.scope():`, or train it outside the scope.")
        return function(iterator)

    call.__wrapped__ = function
    return call


def _xla_asked(model) -> bool:
    """Whether prepare's or compile()'s jit_compile asks for XLA, unless XLA was dropped or the model runs eagerly."""
    asked = state.setting(model, "jit_compile") is True or bool(model.jit_compile)
    return asked and XLA not in replica_step.path_of(model)["dropped"] and not model.run_eagerly


def _test_plan(model, step_function) -> _Plan:
    """evaluate()'s: Keras's test step as it is; the train function's path, engine and clock untouched."""
    return _Plan(step=step_function, engine=None, stock=False, kmp_step=False,
                 whole_step_xla=_xla_asked(model) and model.distribute_strategy.num_replicas_in_sync == 1,
                 replica_xla=False, finder=False, every=0, timed_apart=False)


def _path_taken(plan: _Plan) -> str:
    """The path a train function takes, as kmp.engine.replica_step.describe_path says it."""
    if not plan.stock:
        return "the model's own train_step, per-variable update"
    xla = "whole-step XLA" if plan.whole_step_xla else replica_step.REPLICA_XLA if plan.replica_xla else "no XLA"
    return ", ".join(["flat buffers" if plan.engine is not None else "per-variable update", xla]
                     + (["overflow-layer finder"] if plan.finder else []))


_FALLBACK_ORDER = (FLAT, FINDER, XLA)
# kmp's files (below kmp/) whose errors name the fast path to drop.
_ORIGINS = {"engine/buffers.py": FLAT, "engine/engine.py": FLAT, "engine/zero.py": FLAT, "distribute/scatter.py": FLAT,
            "engine/overflow_layer.py": FINDER}
# What tracing kmp's step, or compiling it with XLA, raises on a model it cannot take.
_BUILD_ERRORS = (TypeError, ValueError, AttributeError, LookupError, NotImplementedError,
                 tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError)


def _falling_back(model, step_function):
    """The train function, rebuilt without one fast path after each failure of its first call.

    Stock Keras trains what kmp's fast paths may not take (a layer XLA
    cannot compile, a gradient the buffers cannot hold): rather than a
    traceback, kmp drops the path the error came from (the flat buffers,
    the overflow-layer finder, XLA), says so in one line, and tries again.
    A failure after a first step that ran, or with nothing left to drop, is
    raised as it is.
    """
    function, ran = _build_function(model, step_function), False

    def call(iterator):
        nonlocal function, ran
        if not ran and not iterators.of_a_dataset(iterator):
            iterator = _Replayed(iterator)  # train_on_batch's batch: the next try takes it again
        while True:
            try:
                result = function(iterator)
            except _BUILD_ERRORS as error:
                if ran or isinstance(error, KmpError) or overflow.FORWARD_MARKER in str(error):
                    raise  # a forward overflow's assert: kmp.engine.forward_overflow.watching raises it
                path = _path_to_drop(model, error)
                if path is None:
                    raise
                _drop(model, path, error, lost=not isinstance(iterator, _Replayed))
                function = call.__wrapped__ = _build_function(model, step_function)
                if isinstance(iterator, _Replayed):
                    iterator.again()
                continue
            ran = True
            return result

    call.__wrapped__ = function
    return call


class _Replayed:
    """A Python iterator of batches (train_on_batch's, Keras's loop over a list), whose batches a failed try took
    are given to the next try first. A TensorFlow iterator's batch is gone with its failed step (said in _drop)."""

    def __init__(self, iterator):
        self._iterator, self._taken, self._again = iter(iterator), [], []

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._again.pop(0) if self._again else next(self._iterator)
        self._taken.append(batch)
        return batch

    def again(self) -> None:
        self._again, self._taken = self._taken + self._again, []


def _path_to_drop(model, error) -> str | None:
    """Which fast path `error` came from (by the kmp module it was raised in), if kmp took it."""
    taken = [p for p in _FALLBACK_ORDER if p not in replica_step.path_of(model)["dropped"] and _took(model, p)]
    if isinstance(error, tf.errors.OpError):
        origin = XLA if "XLA" in str(error) or "compil" in str(error) else None
    else:
        # The innermost of kmp's modules the error passed through; a traced function's error
        # lists its frames in its message.
        files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
        files += re.findall(r'File "([^"]+)"', str(error))
        below_kmp = [f.replace("\\", "/").rsplit("/kmp/", 1)[-1] for f in reversed(files) if "/kmp/" in f]
        origin = next((_ORIGINS[f] for f in below_kmp if f in _ORIGINS), None)
    if origin in taken:
        return origin
    return taken[0] if taken else None


def _took(model, path) -> bool:
    if path == FLAT:
        return engine.engine_of(model) is not None and flat_reason(model) is None
    if path == FINDER:
        return state.setting(model, "find_overflow_layer") and overflow_layer.can_diagnose(model)
    return state.setting(model, "jit_compile") is not False and (
        replica_step.wants_replica_xla(model, state.setting(model, "jit_compile"))
        or engine.engine_of(model) is not None or bool(model.jit_compile))


def _drop(model, path, error, lost: bool = True) -> None:
    # A traced function's error ends with the original message; its first line is "in user code:".
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    prefix = f"{type(error).__name__}: "
    message = message[len(prefix):] if message.startswith(prefix) else message
    layer = _layer_in(error)
    where = f" in layer {layer!r}" if layer else ""
    why = f"{type(error).__name__}{where}: {message[:300]}"
    replica_step.path_of(model)["dropped"][path] = f"its first step failed on them ({why})"
    logger.warning("kmp: %s off for %s, falling back (%s)%s.", path, model.name, why,
                   "; the batch of the failed step was not trained" if lost and isinstance(error, tf.errors.OpError)
                   else "")


def _layer_in(error) -> str | None:
    """The innermost Keras layer whose call the error passed through, if any."""
    name = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.layers.Layer) and not isinstance(owner, keras.Model):
            name = owner.name
    return name


def _breakdown_setting(model):
    setting = state.setting(model, "wall_clock_breakdown")
    if setting == "auto":
        return getattr(model.optimizer, "kmp_wall_clock_breakdown", False)
    return setting


def _timed(model, plan: _Plan, function):
    """`function` timed by kmp.engine.wall_clock, with what it cannot cut on this model said once."""
    strategy = model.distribute_strategy
    notes = []
    if plan.timed_apart:
        notes.append("the step is not compiled as one XLA computation while timed (its forward/backward and "
                     "update are); its total with the breakdown off is the one to compare")
    if is_tpu_strategy(strategy):
        notes.append("TPUStrategy's step is one XLA program: only its total is measured")
    if getattr(model.optimizer, "accumulation", None) is not None:
        notes.append("with gradient accumulation the all-reduce, loss scale and update run inside the window's "
                     "branch and count in other")
    kmp_optimizer = hasattr(model.optimizer, "apply_flat")  # kmp.LossScaleOptimizer's
    if not plan.kmp_step and not kmp_optimizer:
        notes.append("Keras's own train step (no XLA here) with a Keras optimizer: fwd_bwd and step are not "
                     "separated and count in other (kmp.wrap gives kmp's optimizer under fp16, a strategy or "
                     "accumulation)")
    elif not kmp_optimizer:
        notes.append("the optimizer is not kmp's: allreduce and loss_scale are not separated from step")
    steps = int(model.steps_per_execution or 1)
    if steps > 1:
        notes.append(f"steps_per_execution={steps}: the parts are each call's last step, total the call / {steps}, "
                     "data_wait is not separated")
    chief = bool(strategy.extended.should_checkpoint)
    if chief and notes:
        print("kmp: wall-clock breakdown: " + "; ".join(notes) + ".", flush=True)
    return wall_clock.Breakdown(plan.every, steps, chief)(function)


def flat_reason(model) -> str | None:
    """Why fit() would not train `model` on the flat buffers (None: it would), by prepare's `flat_buffers`.

    Also read by kmp.memory.allocation (what `kmp memory` counts). A model's own
    train_step keeps the per-variable path too (_make_function_prepared).
    """
    setting = state.setting(model, "flat_buffers")
    if not setting:
        return "flat_buffers=False"
    if model.run_eagerly:
        return "run_eagerly=True (the buffers' step is compiled)"
    reason = flat.support(model)
    sharding = getattr(model.optimizer, "zero_stage", 0) and model.distribute_strategy.num_replicas_in_sync > 1
    if setting == "auto" and reason is None and not sharding:  # ZeRO stage 1 needs the buffers
        sizes = flat.sizes(model.trainable_variables)
        mean = sum(sizes) // len(sizes)
        if mean > AUTO_MEAN_PARAMETERS:
            reason = (f"its variables hold {mean:,} parameters on average (> {AUTO_MEAN_PARAMETERS:,}), where "
                      f"per-variable updates measured faster; flat_buffers=True uses the buffers anyway")
    return reason


def _engine_for(model):
    """The model's flat-buffer engine for this train function, or None (then why is noted once)."""
    if not state.setting(model, "flat_buffers"):
        return _no_engine(model, "flat_buffers=False")  # (says nothing: not asked for)
    reason = flat_reason(model)
    if reason is not None:
        return _no_engine(model, reason)
    if not model.optimizer.built:
        # Unbuilt only where the build from shapes could not run (_build_on_one_device);
        # the buffers need its slots now.
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)
    current = engine.engine_of(model)
    key = (id(model.optimizer), tuple(id(v) for v in model.trainable_variables))
    if current is None or current.buffers.key != key:
        if current is not None:
            current.release()  # the old buffers' last values, into the variables the new ones start from
        current = state.ensure(model).engine = engine.Engine(model)
    else:
        current.buffers.place_slots(on_host=True)  # back from a per-variable fit (_no_engine)
        current.forget_compiled()
    return current


def _no_engine(model, reason: str | None) -> None:
    """None, after saying once per model and reason why the flat buffers are off (if they were asked for)."""
    if engine.engine_of(model) is not None:
        engine.engine_of(model).release()  # the per-variable update needs Keras's slots on every replica
    setting = state.setting(model, "flat_buffers")
    if setting and reason is not None and reason not in state.ensure(model).flat_noted:
        state.ensure(model).flat_noted.add(reason)
        log = logger.warning if setting is True else logger.info
        log("kmp: flat buffers off for %s, per-variable updates instead: %s.", model.name, reason)
    return None


# "auto" keeps the per-variable path for models of large variables: there the
# gradient's concatenation and the weights' slices cost more passes over memory
# than the variables cost in overhead (benchmarks/p3_fit_path.py measures both).
AUTO_MEAN_PARAMETERS = 65_536


def _around_steps(flat_engine, function):
    def call(iterator):
        flat_engine.before_step()
        try:
            return function(iterator)
        finally:
            flat_engine.stepped()

    call.__wrapped__ = function
    return call


def _own_loop(self, step_function, keras_function):
    """A train or test function's steps in kmp's own tf.function, where Keras's fails or costs more.

    - `steps_per_execution > 1`: Keras 3.15 runs each step of an execution
      inside a tf.cond, and a step under MirroredStrategy or
      MultiWorkerMirroredStrategy calls merge_call (every all-reduce does),
      which fails inside a cond: fit() stops with "You must feed a value for
      placeholder tensor '.../while/cond/Placeholder_1'" for any
      steps_per_execution > 1, with any optimizer (keras-team/keras#19246).
      Here the while loop's own condition checks that a batch is there, and
      its body runs the step unconditionally. Keras's
      `unrolled_steps_per_execution` is not applied: it needs the cond.
    - A plain iterator of global batches (kmp.engine.host_batches): each
      batch is split between the replicas in the step.

    One step per call on tf.distribute's own iterator stays Keras's.
    """
    strategy = self.distribute_strategy
    steps = self.steps_per_execution

    @tf.autograph.experimental.do_not_convert
    def one_step(data):
        if host_batches.is_global(data):
            data = host_batches.split(strategy, data)
        outputs = strategy.run(step_function, args=(data,))
        return seams.get("reduce_per_replica")(outputs, strategy, reduction="auto")

    one_step = self._autoconvert_optionals(tf.function(one_step, reduce_retracing=True))

    @tf.autograph.experimental.do_not_convert
    def multi_step(iterator):
        if steps == 1:  # as Keras's: the end of the data is get_next's OutOfRangeError
            return tf.experimental.Optional.from_value(one_step(iterator.get_next()))
        outputs = tf.experimental.Optional.empty(None)  # its spec is known after the first trace

        def body(step, _, inputs):
            result = tf.experimental.Optional.from_value(one_step(inputs.get_value()))
            outputs._element_spec = result.element_spec
            # Fetching a batch calls no merge_call: this cond is safe.
            inputs = tf.cond(step + 1 < steps, iterator.get_next_as_optional, lambda: inputs)
            return step + 1, result, inputs

        def more(step, _, inputs):
            return tf.logical_and(step < steps, inputs.has_value())

        start = [tf.constant(0), outputs, iterator.get_next_as_optional()]
        _, last, _ = tf.while_loop(more, body, start)
        last._element_spec = outputs.element_spec
        return last

    multi_step = tf.function(multi_step, reduce_retracing=True)

    def function(iterator):
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)) or (
                steps == 1 and isinstance(iterator, tf.distribute.DistributedIterator)):
            return keras_function(iterator)  # Keras's Python loop over a list of batches, or its own step
        last = multi_step(iterator)
        if not last.has_value():
            raise StopIteration
        return last.get_value()

    return function


def _with_replica_axis(step_function):
    @functools.wraps(step_function)
    def step(data):
        return keras.tree.map_structure(
            lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, step_function(data)
        )

    return step


_REPLACEMENTS = {
    "_maybe_symbolic_build": _build_from_local_batch,
    "_make_function": _make_function_prepared,
}


def local_batch(strategy: tf.distribute.Strategy, batch):
    """The first local replica's part of a distributed batch; other batches as they are."""
    leaves = keras.tree.flatten(batch)
    if leaves and all(isinstance(v, tf.distribute.DistributedValues) for v in leaves):
        return keras.tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)
    return batch
