"""Flat buffers: the float32 master weights, optimizer slots and accumulators of a model, each one tensor.

    buffers = FlatBuffers(model)           # after the optimizer is built
    buffers.load()                         # Keras variables -> buffers
    weights = buffers.local("weights")     # this replica's flat weights (in a step)
    values = buffers.split(weights)        # one tensor per trainable variable
    buffers.update(grad, clip_scale, lr)   # the optimizer's step, one XLA computation
    buffers.store()                        # buffers -> Keras variables

Why: TensorFlow's cost per resource variable (every op and every XLA launch
that touches one) dominates the update of many small variables: Adam on
2000 x 1K parameters runs far below a flat copy's speed, Keras's update or
kmp's per-variable one (benchmarks/p3_fit_path.py). Three variables (weights and
Adam's two moments) instead of 6000 take that cost away; what is left is
the bytes.

Replicas of one process on CPUs (MirroredStrategy on logical CPU devices)
share its memory: there, at every ZeRO stage, each replica holds and steps
its shard of the weights and slots in place, and every replica's forward
pass reads all the weight shards. Elsewhere (GPUs, several
workers) each replica steps its own copy, or at stage 1 its shard, gathered
into every replica's whole weights (kmp.engine.zero). A replica that steps a
shard receives only that shard of the summed gradient (kmp.distribute
.scatter). Lamb, whose trust ratio needs each variable whole, steps once on
those CPUs, on the first replica's buffers, which every replica reads.
Which of these a model gets is its layout (kmp.engine.layout), chosen once.

Layout: the trainable variables (float32 masters: mixed precision's own
float32 variables, or of 16-bit variables, which each copy out rounds) in
Keras's `model.trainable_variables` order, except that the ones
the optimizer decays are one run, so weight decay is `start <= index < end`
(with 8-bit states, the variables that keep float32 ones come first), and
in each run the variables of one shape lie together (a copy out splits
them by one op). Each
buffer is a variable of the model's strategy (mirrored: each replica owns a
component) that Keras does not track: checkpoints and `.keras` files hold the
Keras variables only, in Keras's format (kmp.engine copies the buffers into
them before anything can observe them).

The update is Keras's `update_step`, op for op: for SGD (momentum,
nesterov), Adam and AdamW kmp.engine.fused's `_SGD`/`_Adam` rules run on the flat
slots; Lion, Adagrad and Lamb have their rules here (Lamb's trust ratio per
variable, as segment norms). Weights agree with the per-variable path to
about one ulp per step, except where a sparse gradient's rows repeat: Keras
squares them one by one, the buffers their sum (join says so; docs/engine.md).

8-bit states (kmp.Adam8bit, kmp.AdamW8bit) are quantized by blocks of each
variable: with them every quantized variable starts on a block in every
buffer (its span padded with zeros, `spans`), each moment is a uint8 buffer
of codes and a float32 buffer of one scale per block, and ZeRO stage 1
shards by whole blocks, so a buffer's blocks are the Keras variables'
blocks. The variables under the optimizer's min_8bit_size keep float32
moments: they come first, one run (`kept` variables), stepped by Adam's
rule, and their two float32 slot buffers cover that run only (`covers`).
The code buffers cover every element, so that the 8-bit rule steps whole
buffers in place; the run's codes are scratch, mirrored by no Keras
variable (`scratch`). Where the update writes in place (not GatheredShards)
the run's weights are a buffer of their own too (`apart`, "kept_weights"),
which the forward pass reads, and the weights buffer's run is scratch: one
buffer joined out of the two rules' new weights is written apart by XLA on
CPU and copied into the variable, a pass over all the weights. Sharded, a
replica's shard may hold some of the run: each replica's buffer of it is as
long as the most any replica's shard needs of it, and its first entries are
used (`_window`).

Memory: the buffers are a second copy of the weights and slots (the Keras
variables stay, as the observable copy): 4 bytes per parameter for the
weights, 4 (SGD with momentum, Lion, Adagrad) or 8 (Adam, Lamb) for the slots
(8-bit: 2 + 8/block, and for the small variables' elements 8 more for their
float32 moments and, where `apart`, 4 for their own weights), 4 for the
accumulation window; with Lamb, 4 more for each element's variable index.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math

import keras
import numpy as np
import tensorflow as tf

from kmp import seams
from kmp.distribute.same_start import same_start
from kmp.distribute.tpu import is_tpu_strategy
from kmp.engine import fused, layout, replica_state, zero
from kmp.engine.rules import ADAM_SLOTS, HYPERPARAMETERS, RULES, SQUARING
from kmp.memory.estimate import ALIGN
from kmp.scaling import overflow
from kmp.scaling.gradients import unscale

logger = logging.getLogger(__name__)

EAGER_COPIES = 50  # loads made eagerly before one traced graph makes them (see _copy)
WEIGHT_BUFFERS = ("weights", "kept_weights")  # the model's weights; the other buffers are the optimizer's state
IN_PLACE_FROM = 16384  # elements: a variable's gradient this large is written into the flat one in place (join)
# The variables' dtypes the buffers train, from float32 masters: a 16-bit variable (a "bfloat16" or "float16"
# policy) is the master rounded, as DeepSpeed's bf16 and fp16 optimizers keep it.
MASTERED = ("float32", "bfloat16", "float16")


def support(model: keras.Model) -> str | None:
    """None if the flat buffers can train this model with its optimizer now, else why not."""
    optimizer = model.optimizer
    if getattr(optimizer, "loss_scale_config", None) is None:
        return "the optimizer is not kmp's (kmp.wrap or kmp.LossScaleOptimizer)"
    if not optimizer.fused:
        return "the optimizer was made with fused=False"
    inner = optimizer.inner_optimizer
    reason = fused.fused_support(inner, HYPERPARAMETERS,
                                 "the flat buffers update SGD, Adam, AdamW, Lion, Adagrad and Lamb")
    if reason is not None:
        return reason
    own = [name for name in ("clipnorm", "global_clipnorm", "clipvalue") if getattr(inner, name)]
    if own:
        return f"the inner optimizer clips itself ({own[0]}); kmp's gradient_clipping is applied in the buffers"
    if is_tpu_strategy(model.distribute_strategy):
        return "TPUStrategy compiles the whole step itself"
    strategy = model.distribute_strategy
    if getattr(optimizer, "zero_stage", 0) and strategy.num_replicas_in_sync > 1:
        if getattr(RULES[type(inner)], "per_variable", False):
            return "ZeRO stage 1 shards the buffers by element, and Lamb's trust ratio needs each variable whole"
    variables = model.trainable_variables
    if not variables:
        return "the model has no trainable variables"
    for v in variables:
        if v.dtype not in MASTERED:
            return f"variable {v.path} has dtype {v.dtype} (the buffers hold float32 masters of float32, bfloat16 " \
                   "and float16 variables)"
        if getattr(v, "constraint", None) is not None:
            return f"variable {v.path} has a constraint"
        if optimizer._overwrite_variable_with_gradient(v):
            return f"variable {v.path} has overwrite_with_gradient=True (float8)"
        if any(d is None for d in v.shape):
            return f"variable {v.path} has an unknown shape"
    return None


def sizes(variables) -> list[int]:
    """Each variable's (or shape's) number of elements."""
    return [int(tf.TensorShape(getattr(v, "shape", v)).num_elements()) for v in variables]


class FlatBuffers:
    """The flat state of one model and its (built) kmp optimizer. See the module docstring."""

    def __init__(self, model: keras.Model):
        optimizer = model.optimizer
        inner = optimizer.inner_optimizer
        self.model, self.optimizer, self.inner = model, optimizer, inner
        self.strategy = model.distribute_strategy
        trainable = list(model.trainable_variables)
        self.key = (id(optimizer), tuple(id(v) for v in trainable))
        decays = [inner.weight_decay is not None and inner._use_weight_decay(v) for v in trainable]
        self.rule = RULES[type(inner)]
        # 8-bit states: the variables under the optimizer's min_8bit_size keep Adam's float32 moments.
        kept = [hasattr(self.rule, "float32_slots") and not inner.quantizes(n) for n in sizes(trainable)]
        # Those first (the undecayed, then the decayed), then the other decayed ones: the variables with float32
        # states are then one run of the buffer, and the decayed ones another, `decay`.
        group = [(0 if d else -1) if k else (1 if d else 2) for k, d in zip(kept, decays)]
        # In each group, the variables of one shape next to each other (in the order their shapes first
        # appear): a copy out of the buffers then splits such a run by one op, not a reshape each (_CopyPlan).
        first = {}
        shape_of = [first.setdefault(tuple(v.shape), k) for k, v in enumerate(trainable)]
        self.order = sorted(range(len(trainable)), key=lambda k: (group[k], shape_of[k]))
        self.variables = [trainable[i] for i in self.order]
        self.sizes = sizes(self.variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        # 8-bit states quantize by blocks of each variable (kmp.scaling.eight_bit): each quantized variable
        # then starts on a block, its span padded with zeros, so the buffer's blocks are the Keras ones.
        self.block = inner.block_size if getattr(self.rule, "blocks", False) else 1
        self.kept = sum(kept)  # the variables with float32 states, first: not padded, as a run
        self.spans = [n if k < self.kept else -(-n // self.block) * self.block for k, n in enumerate(self.sizes)]
        # The last span padded too (and the last with float32 states), so that the buffers, their shards and
        # the codes' run are whole units: XLA:CPU vectorizes the update's loop (it reads the learning rate at
        # run time) only over a multiple of 8 elements (benchmarks/p7_update_scalars.py measures it).
        self.unit = math.lcm(self.block, ALIGN)
        if self.kept:
            self.spans[self.kept - 1] += -sum(self.spans[:self.kept]) % self.unit
        self.spans[-1] += -sum(self.spans) % self.unit
        self.size = sum(self.spans)
        before = [sum(g < k for g in group) for k in (0, 2)]  # the variables before the decayed, after them
        self.decay = tuple(sum(self.spans[:k]) for k in before)  # [start, end) in elements
        # The Keras variables each buffer mirrors, in buffer order; a slot buffer of 8-bit states covers the
        # variables of its kind only (`covers`: [first, last) in buffer order).
        index = [inner._get_variable_index(v) for v in self.variables]
        self.float32_names = ()
        self.covers = {}
        self.scratch = {}  # buffer name -> its first mirrored variable: the elements before it are scratch
        if isinstance(inner, keras.optimizers.SGD):
            slots = {"momentum": [inner.momentums[i] for i in index]} if inner.momentum != 0 else {}
        elif hasattr(self.rule, "float32_slots"):
            # The float32 moments cover the kept run only; the codes cover every element, so that the 8-bit
            # rule steps whole buffers in place, but mirror the quantized variables only (the kept run's codes
            # are scratch, never read).
            slots = {}
            for name, attribute in self.rule.float32_slots if self.kept else ():
                slots[name] = [getattr(inner, attribute)[i] for i in index[:self.kept]]
                self.covers[name] = (0, self.kept)
            for name, attribute in self.rule.slots if self.kept < len(index) else ():
                slots[name] = [getattr(inner, attribute)[i] for i in index[self.kept:]]
                if self.kept:
                    self.scratch[name] = self.kept
            self.float32_names = tuple(n for n, _ in self.rule.float32_slots if n in slots)
        else:
            slots = {name: [getattr(inner, attribute)[i] for i in index]
                     for name, attribute in getattr(self.rule, "slots", ADAM_SLOTS)}
        self.mirrors = {"weights": self.variables, **slots}
        if optimizer.accumulation is not None:
            position = {id(v): k for k, v in enumerate(trainable)}
            self.mirrors["sums"] = [optimizer.accumulation.sums[position[id(v)]] for v in self.variables]
        self.slot_names = tuple(slots)
        self.hyper = {name: getattr(inner, name) for name in HYPERPARAMETERS[type(inner)] + ("weight_decay",)}
        self.replicas = self.strategy.num_replicas_in_sync
        self.layout = layout.choose(self, optimizer, self.strategy, getattr(self.rule, "per_variable", False))
        # Both kinds of states, on buffers stepped in place: the kept run's weights in a buffer of their own,
        # stepped by Adam's rule, while the 8-bit rule steps the whole weights buffer, whose kept run is then
        # scratch. One buffer for both would be joined out of two rules, and XLA on CPU writes that join
        # apart and copies it into the variable (benchmarks/eight_bit_split_update.py).
        self.apart = bool(self.scratch) and self.layout.in_place
        if self.apart:
            self.mirrors["kept_weights"] = self.variables[:self.kept]
            self.mirrors["weights"] = self.variables[self.kept:]
            self.covers["kept_weights"] = (0, self.kept)
            self.scratch["weights"] = self.kept
        # `length`: the flat gradient (and the accumulation sums), zero padded to N whole shards when sharded.
        self.shard, self.length = self.layout.sizes(self.size, self.unit, self.replicas)
        self.place_slots(on_host=True)
        dtypes = getattr(self.rule, "dtypes", {})
        # Zeros on every worker: made without MultiWorkerMirrored's broadcast, which takes no uint8 (8-bit codes).
        with self.strategy.scope(), same_start(self.strategy):
            self.buffers = {
                name: tf.Variable(tf.zeros([self._length(name, self._elements(name))], dtypes.get(name, tf.float32)),
                                  trainable=False, name=f"kmp_flat_{name}")
                for name in self.mirrors
            }
        if getattr(self.rule, "per_variable", False):
            # Each element's variable, for Lamb's per-variable norms. A variable,
            # not a constant of the buffer's size in the graph, nor computed in
            # XLA: XLA gives tf.repeat a padded dynamic shape past a few million
            # elements, and compiles a cumsum of that size for minutes.
            with self.strategy.scope():
                self.segment_ids = tf.Variable(np.repeat(np.arange(len(self.spans), dtype=np.int32), self.spans),
                                               trainable=False, name="kmp_flat_segments")
        self._updates = {}
        self._calls, self._graphs = {}, {}  # copies made and traced, by direction
        self._held = {}  # name -> [(Keras variable component, the tensor stored, its address)] (written_since_store)
        self._split_now = {}  # during a store: id of a buffer gathered whole -> its parts, for every replica
        self._plans = {}  # buffer name -> _CopyPlan
        self._component_lists = {}  # (buffer name, local replica) -> _components
        self.missing = ()  # model positions of the variables without a gradient (see join)
        self._sparse_noted = False  # join's note on sparse gradients, said once

    def place_slots(self, on_host: bool) -> None:
        """At ZeRO stage 1, and on replicas that are CPUs of one process: Keras's whole copy of the slots once in
        host memory, or (for Keras's own per-variable update) one per replica again (kmp.engine.zero). Otherwise
        nothing moves."""
        if self.layout.slots_on_host:
            slots = [v for name in self.slot_names for v in self.mirrors[name]]
            if zero.to_host(slots, zero.host(self.strategy)) if on_host else zero.to_replicas(slots, self.strategy):
                self._component_lists = {}  # the slots' variables are new

    # --- In a step (replica context) ---

    def local(self, name: str) -> tf.Variable:
        """This replica's component of buffer `name` (a plain tf.Variable); in the FirstCopy layout
        the first replica's, except for the replica's own accumulation sums."""
        return self._first(self.buffers[name]) if self.layout.first_only(name) else fused._local(self.buffers[name])

    def read_weights(self):
        """This replica's flat weights as its forward pass reads them (split takes either): a
        tensor, or, in the SharedShards layout, every replica's shard (a tuple); with the kept run
        `apart`, a dict of both buffers' (weights, kept_weights)."""
        if self.apart:
            return {name: self.layout.read_weights(name) for name in ("weights", "kept_weights")}
        return self.layout.read_weights()

    def split(self, flat) -> list:
        """`flat` (read_weights()'s, or one whole flat tensor) as one tensor per trainable variable, in
        `model.trainable_variables` order. Inside XLA, joining the shards copies nothing: each
        variable's slice is taken from the shard that holds it."""
        if isinstance(flat, dict):  # the kept run's weights from their own buffer; the scratch run not read
            parts = self._parts(self._whole(flat["kept_weights"], "kept_weights"), self.kept)
            parts += self._parts(self._whole(flat["weights"], "weights"))[self.kept:]
        else:
            parts = self._parts(self._whole(flat, "weights"))
        out = [None] * len(self.sizes)
        for position, part, variable in zip(self.order, parts, self.variables):
            out[position] = _as_dtype(part, variable.dtype)  # a 16-bit variable: its master rounded
        return out

    def _whole(self, flat, name: str):
        """Buffer `name`'s whole elements from read_weights()'s (a tensor, or every replica's shard)."""
        if not isinstance(flat, tuple):
            return flat
        return tf.concat([zero.first_entries(shard, self.used(name, k)) for k, shard in enumerate(flat)], axis=0)[
            :self._region(name)]

    @tf.autograph.experimental.do_not_convert
    def join(self, grads, scale) -> tf.Tensor:
        """Per-variable gradients (model order, None for no gradient), unscaled (kmp.scaling.gradients.unscale:
        float32 / scale), as one flat tensor (`length` elements: zero padded to N whole shards when
        sharded).

        Keras skips a variable whose gradient is None (no step, no weight
        decay, slots untouched); so does the update, for the variables noted
        here while the step is traced.
        """
        missing = tuple(i for i, g in enumerate(grads) if g is None)
        if missing != self.missing:
            if self._updates:  # traced with the other set: trace the update again
                self._updates = {}
            self.missing = missing
            if missing:
                names = ", ".join(self.model.trainable_variables[i].path for i in missing[:3])
                logger.warning("kmp: no gradient for %d trainable variable(s) (%s%s); they are not updated, "
                               "as Keras does.", len(missing), names, ", ..." if len(missing) > 3 else "")
        sparse = [self.model.trainable_variables[i].path for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if sparse and self.rule in SQUARING and not self._sparse_noted:
            self._sparse_noted = True
            logger.warning(
                "kmp: the gradient of %s is sparse (an embedding lookup). The flat buffers add up its repeated "
                "rows, and the replicas' rows, before %s squares it (as tf.keras 2 and PyTorch do); Keras 3 squares "
                "each row first. So where ids repeat, training differs from stock Keras, whose result then also "
                "depends on the number of replicas. kmp.prepare(model, flat_buffers=False) keeps Keras's update.",
                sparse[0] if len(sparse) == 1 else f"{len(sparse)} variables ({', '.join(sparse[:3])})",
                type(self.inner).__name__)
        # Each length from its variable: a traced gradient's static shape may be unknown (a tied
        # embedding's IndexedSlices made dense, keras-hub's transformers).
        # Each op runs on its own outside XLA: there, one division of the joined gradient, not one per variable.
        xla = overflow.in_xla()
        each = scale if xla else None
        parts = [None if grads[i] is None else _reshaped(tf.convert_to_tensor(unscale(grads[i], each)), [n])
                 for i, n in zip(self.order, self.sizes)]
        if xla and self.layout.shares_cores and max(self.sizes) >= IN_PLACE_FROM:
            return self._written_in_place(parts)
        joined = _pad_to(tf.concat(self._padded(parts), axis=0), self.length)
        return joined if xla else unscale(joined, scale)

    def _written_in_place(self, parts) -> tf.Tensor:
        """join's flat tensor inside XLA on replicas that are CPUs of one process: each
        variable of IN_PLACE_FROM elements or more written into a zero buffer in place,
        the runs of smaller ones between them joined.

        XLA:CPU keeps a concatenate of many operands apart from the per-variable
        conversions and the division, so the gradient is written three times;
        a dynamic-update-slice takes its operand's conversion and division into
        its own loop, in place. That loop runs on one thread, where the
        division's runs on all of them, so only replicas sharing the cores
        take it (on one device it is slower). Each in-place write has a fixed
        cost, so runs of small variables are joined first.
        """
        flat = tf.zeros([self.length], tf.float32)
        run, run_start, start = [], 0, 0

        def write(flat, value, begin):
            return tf.raw_ops.TensorStridedSliceUpdate(input=flat, begin=[begin], end=[begin + value.shape[0]],
                                                       strides=[1], value=value)

        for k, (part, size, span) in enumerate(zip(parts, self.sizes, self.spans)):
            if size < IN_PLACE_FROM:
                run.append(k)
            else:
                if run:
                    flat = write(flat, tf.concat(self._padded(parts, run), axis=0), run_start)
                if part is not None:  # a variable without a gradient stays zero
                    flat = write(flat, part, start)
                run, run_start = [], start + span
            start += span
        if run:
            flat = write(flat, tf.concat(self._padded(parts, run), axis=0), run_start)
        return flat

    def _padded(self, parts, indices=None) -> list:
        """parts[k] (zeros for None) padded to its span, for the k in `indices` (all by default)."""
        indices = range(len(parts)) if indices is None else indices
        return [_pad_to(tf.zeros([self.sizes[k]], tf.float32) if parts[k] is None else parts[k], self.spans[k])
                for k in indices]

    def segment_finite(self, flat, offset: int = 0) -> tf.Tensor:
        """Per trainable variable (model order): True iff its part of `flat` is finite. `flat` is
        join's whole gradient, or the part of it that starts at element `offset` (a shard: the
        variables outside it count as finite)."""
        # The non-finite elements counted up to each variable's end: no index of the buffer's size. Grappler
        # constant-folds tf.repeat's segment ids through a [variables, largest variable] tile, and
        # TensorFlow's CPU allocator keeps that peak (about 1 GB for a 5M-parameter GPT-2; benchmarks/memory.py).
        ends = np.cumsum(self.spans) - offset  # each variable's end in `flat`, clipped to it below
        ends = np.clip(ends, 0, flat.shape[0])
        bad = tf.concat([[0], tf.cumsum(tf.cast(~tf.math.is_finite(flat), tf.int32))], axis=0)
        at_ends = tf.gather(bad, ends)
        ok = at_ends - tf.concat([[0], at_ends[:-1]], axis=0) == 0
        return tf.gather(ok, tf.argsort(self.order))

    def shard_offset(self) -> int:
        """Where this replica's shard starts in the whole buffer (replica context; 0 when not sharded)."""
        return self._offset(fused._replica()[0])

    def update(self, grad, clip_scale, learning_rate) -> tf.Tensor | None:
        """The optimizer's step on this replica's buffers: one XLA computation (replica context).
        `grad` is the reduced gradient: whole, or this replica's shard of it when the buffers are
        sharded (kmp.distribute.scatter). Returns the new shard in the GatheredShards layout.

        The caller checks the gradient and skips this when it is not finite.
        Moving the check inside, as a select of the old or new weights and
        slots (or an XLA conditional), is slower: XLA then copies every
        buffer instead of updating it in place.
        """
        return self._compiled_update()(*self._update_args(grad, clip_scale, learning_rate))

    def update_once(self, finite, grad, clip_scale, learning_rate) -> None:
        """Lamb on replicas of one process (the FirstCopy layout): the step once, on the first replica's
        buffers, if `finite` (replica context). Every replica reads the first's weights
        (`local`), as memory this process shares; the others' weight and slot buffers are unused.
        """
        tf.distribute.get_replica_context().merge_call(
            self._update_first, args=(finite, grad, clip_scale, learning_rate))
        if fused._replica()[0][1]:  # Keras's iteration count, read per replica (learning-rate schedules)
            iterations = _tf_variable(self.inner._iterations)
            fused._local(iterations).assign(self._first(iterations).read_value())

    def _update_first(self, strategy, *args):
        finite, grad, clip_scale, learning_rate = (None if a is None else self._first(a) for a in args)
        with tf.device(self.local("weights").device):
            update = self._compiled_update((id(strategy), 0))
            tf.cond(finite, lambda: update(*self._update_args(grad, clip_scale, learning_rate)) or tf.no_op(),
                    tf.no_op)

    def _update_args(self, grad, clip_scale, learning_rate) -> list:
        args = [grad, tf.cast(learning_rate, tf.float32)]
        return args if clip_scale is None else args + [clip_scale]

    def _compiled_update(self, replica=None):
        """The XLA update of `replica`'s (this replica's by default) buffers."""
        replica = fused._replica()[0] if replica is None else replica
        if replica not in self._updates:
            iterations = _tf_variable(self.inner._iterations)
            # With one update, called in cross-replica context (update_once): the first replica's.
            iterations = self._first(iterations) if self.layout.first_only("iterations") else fused._local(iterations)
            kept_weights = self.local("kept_weights") if self.apart else None
            self._updates[replica] = tf.function(
                functools.partial(self._update, self.local("weights"), kept_weights,
                                  tuple(self.local(n) for n in self.slot_names), iterations, self._offset(replica)),
                jit_compile=True, autograph=False)
        return self._updates[replica]

    def _offset(self, replica) -> int:
        """Where this replica's shard starts in the buffer (0 when not sharded)."""
        return self.layout.offset(replica[1])

    def shard_of(self, flat, offset=None, name="weights"):
        """This replica's [offset, offset + shard) of a whole buffer `name`, zeros past its end."""
        offset = self._offset(fused._replica()[0]) if offset is None else offset
        start, _, n = self._window(name, offset)
        length = self._elements(name) if name in self.covers else self.shard
        return _pad_to(flat[self._length(name, start):self._length(name, start + n)], self._length(name, length))

    def used(self, name: str, replica: int) -> int:
        """How many entries of replica `replica`'s buffer `name` hold its shard (the rest pads it)."""
        return self._length(name, self._window(name, self.layout.offset(replica))[2])

    def _elements(self, name: str) -> int:
        """How many elements each replica's buffer `name` holds."""
        if name in self.covers:  # the most any replica's shard needs of the variables it covers
            offsets = [self.layout.offset(k) for k in range(self.replicas)] if self.is_shard(name) else [0]
            return max(self._window(name, offset)[2] for offset in offsets)
        if self.is_shard(name):
            return self.shard
        return self.length if name == "sums" else self.size  # the sums add up join's gradients

    def _window(self, name: str, offset: int) -> tuple[int, int, int]:
        """Buffer `name`'s part of the elements a replica steps, [offset, offset + shard) (the whole buffer
        when not sharded): where it starts among the buffer's elements, where among those, and how many.

        A slot of 8-bit states covers some variables only (`covers`): elements [lo, hi) of the whole buffer, to
        the end (the shards' padding too) when it covers the last variable.
        """
        first, last = self._covered(name)
        lo = sum(self.spans[:first])
        hi = offset + self.shard if last == len(self.spans) else sum(self.spans[:last])
        begin, end = max(lo, offset), min(hi, offset + self.shard)
        return begin - lo, begin - offset, max(0, end - begin)

    def _covered(self, name: str) -> tuple[int, int]:
        """[first, last) of the variables (buffer order) buffer `name` holds: all, but for 8-bit states' slots."""
        return self.covers.get(name, (0, len(self.spans)))

    def _region(self, name: str) -> int:
        """How many elements of the whole buffer `name` covers (its variables' spans)."""
        first, last = self._covered(name)
        return sum(self.spans[first:last])

    def _length(self, name, elements: int) -> int:
        """How many entries of buffer `name` hold `elements` elements (8-bit scales: one per block)."""
        return elements // self.block if name in getattr(self.rule, "per_block", ()) else elements

    def _update(self, weights, kept_weights, slots, iterations, offset, grad, learning_rate, clip_scale=None):
        h = self.hyper
        step = iterations.read_value()
        s = self.rule.scalars(h, learning_rate, tf.cast(step + 1, tf.float32), tf.float32)
        s["lr"] = learning_rate
        if getattr(self.rule, "per_variable", False):
            s["segments"] = fused._local(self.segment_ids).read_value()
            s["count"] = len(self.sizes)
        value = self.layout.stepped(weights, offset)
        if clip_scale is not None:
            grad = grad * clip_scale
        index = tf.range(offset, offset + value.shape[0])  # each element's place in the whole buffer
        keep = self._updated_mask(index) if self.missing else None
        views = {name: self._view(name, slot, offset, keep) for name, slot in zip(self.slot_names, slots)}
        # 8-bit states with float32 ones for the small variables: those (the shard's first `kept` elements)
        # step by Adam's rule, and every element by the 8-bit one, whose result for them is scratch.
        kept = self._window(self.float32_names[0], offset)[2] if self.float32_names else 0
        float32 = [views.pop(n) for n in self.float32_names]
        if float32 and self.kept == len(self.spans):  # no variable quantized: Adam's rule alone, on every element
            rule, rule_slots, kept = fused._Adam, float32, 0
        else:
            rule, rule_slots = self.rule, tuple(views.values())
        new = self._stepped(rule, s, h, value, grad, rule_slots, index, keep)
        if kept:
            mask = None if keep is None else keep[:kept]
            if self.apart:
                run = _Prefix(kept_weights, kept) if kept < kept_weights.shape[0] else kept_weights
                run.assign(self._stepped(fused._Adam, s, h, run.read_value(), grad[:kept], float32, index[:kept], mask))
            else:  # the new weights are a tensor of their own here (GatheredShards: gathered, not written in place)
                kept_new = self._stepped(fused._Adam, s, h, value[:kept], grad[:kept], float32, index[:kept], mask)
                new = tf.concat([kept_new, new[kept:]], axis=0)
        iterations.assign_add(1)
        return self.layout.write(weights, new)

    def _stepped(self, rule, s, h, value, grad, slots, index, keep):
        """`rule`'s new weights for `value`, the elements at buffer positions `index`: weight decay, the step,
        and the old weights kept where `keep` is False."""
        old = value
        start, end = self.decay
        if end > start:
            # Keras (TF backend): variable.assign_sub(variable * wd * lr), before the step.
            decayed = value - value * tf.constant(h["weight_decay"], tf.float32) * s["lr"]
            value = tf.where((index < end) & (index >= start) if start else index < end, decayed, value)
        new = rule.update(s, h, value, grad, slots)
        return new if keep is None else tf.where(keep, new, old)

    def _view(self, name, slot, offset, keep):
        """This replica's slot buffer `name` as the step reads and writes it: the entries its shard uses (a
        slot of 8-bit states covers some variables only), and with `keep`, only where it is True."""
        _, at, n = self._window(name, offset)
        entries = self._length(name, n)
        view = slot if entries == slot.shape[0] else _Prefix(slot, entries)
        if keep is None:
            return view
        # A variable's blocks are its own (self.block): a block's scale is kept with its elements.
        keep = keep[at:at + n]
        return _Masked(view, keep[::self.block] if name in getattr(self.rule, "per_block", ()) else keep)

    def _updated_mask(self, index):
        """True on the elements (at buffer positions `index`) of variables that got a gradient.

        Built from the few runs of variables without one, compared with the
        element index: no constant or index of the buffer's size (see segment_ids).
        """
        keep = tf.ones(index.shape, tf.bool)
        for start, end in self._missing_runs():
            keep = keep & ((index < start) | (index >= end))
        return keep

    def _missing_runs(self) -> list[tuple[int, int]]:
        """[start, end) element ranges of the variables without a gradient, adjacent ones merged."""
        runs, offset = [], 0
        for position, size in zip(self.order, self.spans):
            if position in self.missing:
                if runs and runs[-1][1] == offset:
                    runs[-1] = (runs[-1][0], offset + size)
                else:
                    runs.append((offset, offset + size))
            offset += size
        return runs

    # --- Between steps (eagerly): copies to and from the Keras variables ---

    def load(self, names=None) -> None:
        """Keras variables -> buffers (`names`, all by default), on every local replica."""
        self._copy("load", tuple(self.buffers) if names is None else tuple(names))

    def store(self, names=None) -> None:
        """Buffers (`names`, all by default) -> Keras variables, on every local replica.

        Under several workers at stage 1, storing a slot buffer is a
        collective every worker must join (kmp.engine.zero.whole_shards).
        """
        self._copy("store", tuple(self.buffers) if names is None else tuple(names))

    def written_since_store(self) -> tuple:
        """The buffers whose Keras variables may have been written since they were last stored (all of them
        but those known unchanged); every record of the stores is dropped.

        A store keeps, for each Keras variable it wrote, the tensor it wrote. While that tensor is held,
        TensorFlow writes the variable into a new buffer (copy-on-write: a read value never changes), by
        any route: `assign`, a scatter, Keras's optimizer, XLA. So a variable that still holds the same
        buffer still holds what was stored (tests/test_keras_seams.py checks each route). Only variables in
        host memory are compared (a tensor elsewhere has no address here); a variable written sparsely is
        read as a copy from then on, so it always counts as written. Of a mirrored variable the first
        local replica's component is compared: every route above writes all of them (a write to another
        component alone, through `variable.values`, is not seen).
        """
        held, self._held = self._held, {}
        records = [(n, variable, address) for n in held for variable, _, address in held[n] if address is not None]
        with _queued():  # every read made before the first address is asked for
            values = _read_all([variable for _, variable, _ in records])
        moved = {n for n in held if any(address is None for _, _, address in held[n])}  # not in host memory
        moved |= {n for (n, _, address), value in zip(records, values) if _address(value) != address}
        return tuple(n for n in self.buffers if n not in held or n in moved)

    def forget_stores(self) -> None:
        """Drop the records of the stores (their tensors keep written-over buffers alive)."""
        self._held = {}

    def is_shard(self, name: str) -> bool:
        """Whether each replica holds only its shard of buffer `name` (kmp.engine.layout)."""
        return self.layout.holds_shard(name)

    def store_weights_here(self) -> None:
        """Buffers -> this replica's Keras weights (in a step: an overflowing step's diagnosis reads them)."""
        values = self.split(self.read_weights())  # model order
        for position, variable in zip(self.order, self.variables):
            fused._local(variable).assign(values[position])

    def _parts(self, flat, last=None):
        """The whole weights (of the first `last` variables: all by default) as one tensor per variable, in
        buffer order (traced: split's)."""
        # One split into each variable and each padding after it: no slice per variable.
        pieces, keep = [], []
        for span, n in zip(self.spans[:last], self.sizes[:last]):
            keep.append(len(pieces))
            pieces += [n, span - n] if span > n else [n]
        parts = tf.split(flat, pieces)
        return [_reshaped(parts[k], s) for k, s in zip(keep, self.shapes)]

    def _copy(self, direction: str, names: tuple) -> None:
        # Component by component, each on its own device. Eagerly (planned bare ops, _CopyPlan); a load
        # made often (a callback kmp does not know writes each batch) by one traced graph after
        # EAGER_COPIES loads: it reads and joins faster, but takes seconds to optimize on its first call
        # for a model of a thousand variables. A traced store is slower than the eager one
        # (benchmarks/RESULTS.md, p1_fit_parts), so the store is never traced.
        calls = self._calls[direction] = self._calls.get(direction, 0) + 1
        copy = self._load_component if direction == "load" else self._store_component
        if direction == "load" and calls > EAGER_COPIES:
            if direction not in self._graphs:
                self._graphs[direction] = tf.function(copy, autograph=False)
            copy = self._graphs[direction]
        # A load makes every record old; a store records what it wrote, name by name.
        self._held = {} if direction == "load" else {n: h for n, h in self._held.items() if n not in names}
        # Queued to a thread of their own (_queued); not across workers, where a store gathers by a collective.
        with contextlib.nullcontext() if self.layout.across_workers else _queued():
            # Stored whole, once, into Keras's one copy in host memory (kmp.engine.zero).
            whole = zero.whole_shards(self, names) if direction == "store" and any(map(self.is_shard, names)) else {}
            written = self._copy_replicas(copy, direction, names, whole)
        for n, variable, value in written:
            self._held.setdefault(n, []).append((variable, value, _address(value)))

    def _copy_replicas(self, copy, direction: str, names: tuple, whole: dict) -> list:
        """`copy` (a load or a store) of `names` on every local replica; what a store wrote."""
        local = self.strategy.experimental_local_results
        written = []
        self._split_now = {}
        for k, replica in enumerate(self._replica_ids()):
            buffers = {}
            for n in names:
                # In the FirstCopy layout only the first replica's weights and slots are used: the
                # others' are not loaded, and every replica is stored from the first's. A buffer
                # gathered whole is stored once into Keras's one host copy (the slots,
                # kmp.engine.zero), and into each replica's Keras variables otherwise (weight shards).
                first_only = self.layout.first_only(n)
                if k and ((n in whole and zero.on_host(self.mirrors[n][0])) or (direction == "load" and first_only)):
                    continue
                buffers[n] = whole[n] if n in whole else local(self.buffers[n])[0 if first_only else k]
            mirrors = {n: self._components(n, k) for n in buffers}
            with tf.device(local(self.buffers["weights"])[k].device):
                stored = copy(buffers, mirrors, replica * self.shard) or []
            if not k:  # a mirrored variable's components are written together: the first stands for all
                written += stored
        self._split_now = {}
        return written

    def _components(self, name: str, k: int) -> list:
        """The k-th local replica's component of each Keras variable buffer `name` mirrors (a plain
        tf.Variable): looked up once (until place_slots moves the slots), not per copy of hundreds."""
        if (name, k) not in self._component_lists:
            local = self.strategy.experimental_local_results
            self._component_lists[name, k] = [_component(local(_tf_variable(v)), k) for v in self.mirrors[name]]
        return self._component_lists[name, k]

    def _first(self, value):
        """The first replica's component of a distributed variable or value."""
        return self.strategy.experimental_local_results(value)[0]

    def _replica_ids(self) -> list[int]:
        """Each local replica's index among all replicas (its shard's), in local order."""
        if "_ids" not in self.__dict__:
            local = len(self.strategy.experimental_local_results(self.buffers["weights"]))
            self._ids = ([int(i) for i in replica_state.replica_ids(self.strategy)] if self.layout.across_workers
                         else list(range(local)))
        return self._ids

    def _load_component(self, buffers, mirrors, offset):
        for name, buffer in buffers.items():
            # Read and assign as bare ops: no Identity, no read back (eagerly, each op's Python counts).
            flat = self._copy_plan(name).joined([_as_dtype(v, buffer.dtype) for v in _read_all(mirrors[name])])
            if self.is_shard(name):
                # A shard is a slice sharing the whole joined tensor's memory; the buffer would adopt it and
                # keep the whole alive (N times its size, from one load to the next): a copy of its own.
                _assign(buffer, tf.raw_ops.DeepCopy(x=self.shard_of(flat, offset, name)))
            else:
                _assign(buffer, _pad_to(flat, buffer.shape[0]))

    def _store_component(self, buffers, mirrors, offset):
        """Eagerly (never traced: see _copy); returns (name, variable, the tensor it now holds) for each variable."""
        stored = []
        for name, buffer in buffers.items():
            if id(buffer) in self._split_now:  # a buffer gathered whole, split for an earlier replica
                parts = self._split_now[id(buffer)]
            else:
                # A variable, or a sharded buffer gathered whole; either can be zero padded at the end.
                flat = buffer.value() if isinstance(buffer, tf.Variable) else buffer
                flat = flat[:self._length(name, self._region(name))]
                parts = self._copy_plan(name).parts(flat)
                if not isinstance(buffer, tf.Variable):
                    self._split_now[id(buffer)] = parts
            for variable, part in zip(mirrors[name], parts):
                part = _as_dtype(part, variable.dtype)  # a 16-bit variable gets its master rounded
                _assign(variable, part)  # the variable takes the part's buffer: assigning copies nothing
                stored.append((name, variable, part))
        return stored

    def _copy_plan(self, name: str) -> "_CopyPlan":
        plans = self._plans
        if name not in plans:
            pad = getattr(self.rule, "pads", {}).get(name, 0)
            shapes = [tuple(v.shape) for v in self.mirrors[name]]
            first, last = self._covered(name)
            mirrored = self.scratch.get(name, first)  # the variables before it are scratch: zeros, never stored
            plans[name] = _CopyPlan(shapes, [self._length(name, span) for span in self.spans[mirrored:last]], pad,
                                    self.buffers[name].dtype, self._length(name, sum(self.spans[first:mirrored])))
        return plans[name]


class _CopyPlan:
    """One buffer split into its variables' values and joined back, as bare ops whose shapes and paddings
    are made once: the copies between fit() calls run a few hundred ops per replica, and eagerly each op's
    Python counts. The traced load (_copy) takes the same ops. The first `scratch` entries are no variable's
    (FlatBuffers.scratch): joined as `pad`, dropped when split."""

    def __init__(self, shapes, spans, pad, dtype, scratch=0):
        pieces, self.wanted, self.flat, self.pads = [], [], [], []
        with tf.init_scope():
            self.lead = tf.fill((scratch,), tf.constant(pad, dtype)) if scratch else None
            if scratch:
                pieces.append(scratch)
            for shape, n, span in zip(shapes, sizes(shapes), spans):
                self.flat.append(None if len(shape) == 1 else _shape_tensor((n,)))
                self.pads.append(tf.fill((span - n,), tf.constant(pad, dtype)) if span > n else None)
            for shape, count, n, padding in _runs(shapes, spans):
                # Each run's piece, reshaped unless 1-D (a run of several split by one Unpack), then its padding.
                self.wanted.append((len(pieces), count, None if len(shape) == 1 and count == 1
                                    else _shape_tensor(shape if count == 1 else (count, *shape))))
                pieces += [count * n, padding] if padding else [count * n]
            self.splits, self.count = tf.constant(pieces, tf.int64), len(pieces)
            self.axis = tf.constant(0, tf.int32)

    def parts(self, flat) -> list:
        parts, out = tf.raw_ops.SplitV(value=flat, size_splits=self.splits, axis=self.axis, num_split=self.count), []
        for k, count, shape in self.wanted:
            part = parts[k] if shape is None else tf.raw_ops.Reshape(tensor=parts[k], shape=shape)
            # Unpack along the first axis slices the run's buffer where SplitV does (pieces of 64-byte multiples).
            out += [part] if count == 1 else tf.raw_ops.Unpack(value=part, num=count, axis=0)
        return out

    def joined(self, values):
        pieces = [] if self.lead is None else [self.lead]
        for value, flat, pad in zip(values, self.flat, self.pads):
            pieces.append(value if flat is None else tf.raw_ops.Reshape(tensor=value, shape=flat))
            if pad is not None:
                pieces.append(pad)
        return pieces[0] if len(pieces) == 1 else tf.raw_ops.ConcatV2(values=pieces, axis=self.axis)


def _runs(shapes, spans):
    """(shape, count, elements, padding after) of each run of variables of one shape, at least 2-D, with no padding
    between them; every other variable a run of its own."""
    runs = []
    for shape, n, span in zip(shapes, sizes(shapes), spans):
        last = runs[-1] if runs else None
        if last and len(shape) > 1 and last[0] == shape and not last[3]:
            last[1] += 1
            last[3] = span - n
        else:
            runs.append([shape, 1, n, span - n])
    return [tuple(run) for run in runs]


class _Prefix:
    """The first `n` entries of a slot variable (a replica's buffer longer than its shard needs)."""

    def __init__(self, variable, n):
        self.variable, self.n = variable, n

    def read_value(self):
        return self.variable.read_value()[:self.n]

    def assign(self, value):
        return self.variable[:self.n].assign(value)  # in place


class _Masked:
    """A slot variable whose assignments keep the old value where `keep` is False."""

    def __init__(self, variable, keep):
        self.variable, self.keep, self.old = variable, keep, variable.read_value()

    def read_value(self):
        return self.old

    def assign(self, value):
        return self.variable.assign(tf.where(self.keep, value, self.old))


def _reshaped(tensor, shape):
    """`tensor` in `shape`: itself where it has that shape already (one op less to trace and, outside XLA, to run)."""
    if tensor.shape.is_fully_defined() and tensor.shape == tf.TensorShape(shape):
        return tensor
    if tf.executing_eagerly():  # the copies between fit() calls: a shape tensor made once, not a tuple converted each time
        return tf.reshape(tensor, _shape_tensor(tuple(shape)))
    return tf.reshape(tensor, shape)


@functools.lru_cache(maxsize=None)
def _shape_tensor(shape: tuple):
    with tf.init_scope():
        return tf.constant(shape, tf.int32)


def _read(variable):
    """`variable.value()`; eagerly, the op alone (as `_assign`)."""
    if tf.executing_eagerly():
        return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
    return variable.value()


def _read_all(variables) -> list:
    """Each variable's `_read` value; eagerly, those in host memory by one op per device: TensorFlow's
    _ReadVariablesOp reads many as ReadVariableOp reads one (the buffers they hold, no copy), for the Python
    of one op (the check reads hundreds; kmp.seams)."""
    if not tf.executing_eagerly():
        return [variable.value() for variable in variables]
    values, groups = [None] * len(variables), {}
    for k, variable in enumerate(variables):
        if _on_host(variable.device):
            groups.setdefault(variable.device, []).append(k)
        else:
            values[k] = _read(variable)
    for device, ks in groups.items():
        dtypes = [variables[k].dtype.as_datatype_enum for k in ks]
        with tf.device(device):
            read = seams.get("execute")("_ReadVariablesOp", num_outputs=len(ks), inputs=[variables[k].handle for k in ks],
                                        attrs=("N", len(ks), "dtypes", dtypes), ctx=seams.get("eager_context")())
        for k, value in zip(ks, read):
            values[k] = value
    return values


def _address(tensor) -> tuple | None:
    """Where a host tensor's data starts, and its shape (numpy's view of it copies nothing); None elsewhere."""
    if not _on_host(tensor.device):
        return None
    view = np.asarray(tensor)
    if view.flags.owndata or not view.size:  # a copy's address says nothing (and may be reused)
        return None
    return view.__array_interface__["data"][0], view.shape


@functools.lru_cache(maxsize=None)
def _on_host(device: str) -> bool:
    return tf.DeviceSpec.from_string(device).device_type == "CPU"


_QUEUE = []  # the copies' asynchronous executor, made when first used (_queued)


@contextlib.contextmanager
def _queued():
    """Eager ops made in here are queued to an executor thread of their own, which runs each while Python
    makes the next: a copy makes hundreds, each costing tens of microseconds to make and as much to run
    (benchmarks/RESULTS.md, p1_fit_parts). All have run when it exits; an op's error is raised then."""
    if seams.get("eager_context")().is_async():  # already queued, in order with what was queued before
        yield
        return
    if not _QUEUE:
        _QUEUE.append(seams.get("new_executor")(enable_async=True))
        atexit.register(_QUEUE.clear)  # deleted while TensorFlow is loaded: its __del__ waits for the queue
    queue = _QUEUE[0]
    try:
        with seams.get("executor_scope")(queue):
            yield
    finally:
        try:
            queue.wait()
        except Exception:
            queue.clear_error()  # or every later op queued there fails with it
            raise


def _assign(variable, value) -> None:
    """`variable.assign(value, read_value=False)`; eagerly, the op alone, without assign()'s Python around it
    (the copies between fit() calls make one per variable and replica). The shape is still checked."""
    if tf.executing_eagerly():
        tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value, validate_shape=True)
    else:
        variable.assign(value, read_value=False)


def _as_dtype(tensor, dtype):
    """`tensor` cast to `dtype`; itself when it has it (no op)."""
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


def _pad_to(flat, length: int):
    """`flat` with zeros appended up to `length` elements."""
    return tf.pad(flat, [[0, length - flat.shape[0]]]) if flat.shape[0] < length else flat


def _component(components, k):
    """Replica k's component of a variable; the one variable of one held in host memory (kmp.engine.zero)."""
    return components[k] if len(components) > 1 else components[0]


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras variable (a distributed one under a strategy)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
