"""Every private Keras and TensorFlow internal kmp uses, in one place.

kmp fixes Keras 3.15's mixed precision from the outside (subclasses and
per-instance method swaps), and some of that needs private parts of Keras and
TensorFlow. They are listed here and nowhere else:

- `MODULE_SEAMS`: private functions and classes, imported by `get(name)` when
  first used, never at `import kmp`. If an upgrade moves one, only the feature
  that uses it fails (with `KmpError` naming the seam and the pinned versions),
  not the whole package.
- `ATTRIBUTE_SEAMS`: private attributes kmp reads or writes on Keras and
  TensorFlow objects, by the kind of object that has them. They cannot be
  imported; this table documents them.

tests/test_keras_seams.py checks every entry of both tables against the
installed versions, so an upgrade fails there first, naming the seam. It also
reads kmp's source: a private name kmp uses on an object not its own and not
listed here fails there, naming the file and line. (What kmp keeps on a
user's model is its own: one attribute, kmp.engine.state.)
"""

from __future__ import annotations

import importlib
from typing import Any

from kmp.errors import KmpError

# name -> (module, attribute, who needs it)
MODULE_SEAMS: dict[str, tuple[str, str, str]] = {
    "TensorFlowTrainer": (
        "keras.src.backend.tensorflow.trainer", "TensorFlowTrainer",
        "kmp.prepare: to recognise Keras's own train_step and build its functions",
    ),
    "reduce_per_replica": (
        "keras.src.backend.tensorflow.trainer", "reduce_per_replica",
        "kmp.prepare: the multi-step loop reduces each step's logs as Keras does",
    ),
    "collective_all_reduce_multi_worker": (
        "keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker",
        "kmp.prepare, kmp.callbacks.BackupAndRestore, saves of an open window: Keras's own test for "
        "MultiWorkerMirroredStrategy",
    ),
    "model_supports_jit": (
        "keras.src.trainers.trainer", "model_supports_jit",
        "kmp.prepare: jit_compile='auto' follows Keras's rule",
    ),
    "unscale_loss_for_distribution": (
        "keras.src.losses.loss", "unscale_loss_for_distribution",
        "kmp.prepare: the per-replica step tracks the loss as Keras's train_step does",
    ),
    "DotNotTrackScope": (
        "keras.src.utils.tracking", "DotNotTrackScope",
        "kmp.LossScaleOptimizer.build: state variables are tracked once, as Keras's build does",
    ),
    "AutocastScope": (
        "keras.src.backend", "AutocastScope",
        "kmp.prepare(activation_checkpointing=...): a block's recomputation casts its weights as its forward pass did",
    ),
    "get_autocast_scope": (
        "keras.src.backend", "get_autocast_scope",
        "kmp.prepare(activation_checkpointing=...): the autocast dtype a block's forward pass ran in",
    ),
    "in_xla_context": (
        "tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext",
        "kmp.LossScaleOptimizer: no tf.print or assert inside XLA",
    ),
    "register_checkpoint_saver": (
        "tensorflow.python.saved_model.registration", "register_checkpoint_saver",
        "kmp.LossScaleOptimizer with accumulation: tf.train.Checkpoint saves every replica's open window",
    ),
    "ResourceVariable": (
        "tensorflow.python.ops.resource_variable_ops", "ResourceVariable",
        "ZeRO stage 1 (kmp.engine.zero.to_host): one plain variable inside a strategy's scope, where tf.Variable "
        "is mirrored",
    ),
    "MirroredExtended": (
        "tensorflow.python.distribute.mirrored_strategy", "MirroredExtended",
        "kmp.Adam8bit under MultiWorkerMirroredStrategy (kmp.distribute.same_start): uint8 variables made "
        "without the initial value's broadcast, which takes no uint8",
    ),
    "all_to_all_v2": (
        "tensorflow.python.ops.collective_ops", "all_to_all_v2",
        "the flat gradient's reduce-scatter under MultiWorkerMirroredStrategy (kmp.distribute.scatter)",
    ),
    "TFOptimizer": (
        "keras.src.backend.tensorflow.optimizer", "TFOptimizer",
        "kmp.LossScaleOptimizer(fused=False): the inner optimizer's all-reduce hook",
    ),
    "eager_context": (
        "tensorflow.python.eager.context", "context",
        "kmp.distribute.leaving: the coordination service's barrier, where a multi-worker job's tasks meet at exit; "
        "kmp.engine.buffers: whether eager ops already run asynchronously",
    ),
    "execute": (
        "tensorflow.python.eager.execute", "execute",
        "kmp.engine.buffers: reads many variables by one eager op (_ReadVariablesOp, which tf.raw_ops does not list)",
    ),
    "new_executor": (
        "tensorflow.python.eager.executor", "new_executor",
        "kmp.engine.buffers: the copies between the flat buffers and the Keras variables queue their eager ops",
    ),
    "executor_scope": (
        "tensorflow.python.eager.context", "executor_scope",
        "kmp.engine.buffers: the copies between the flat buffers and the Keras variables queue their eager ops",
    ),
    "DataAdapter": (
        "keras.src.trainers.data_adapters.data_adapter", "DataAdapter",
        "kmp.engine.host_batches: fit() and evaluate() take data already made into an adapter as it is",
    ),
    "get_data_adapter": (
        "keras.src.trainers.data_adapters", "get_data_adapter",
        "kmp.engine.host_batches: the data adapter Keras's epoch iterator would make, made by kmp",
    ),
    "regroup": (
        "tensorflow.python.distribute.distribute_utils", "regroup",
        "kmp.scaling.replay: each replica's replayed gradients, built across replicas, handed back to it",
    ),
    "get_global_attribute": (
        "keras.src.backend.common.global_state", "get_global_attribute",
        "kmp.prepare on one device: a build from shapes that fails leaves no Keras name scope open",
    ),
}

# kind of object -> private attributes kmp uses on it (documentation; tested).
ATTRIBUTE_SEAMS: dict[str, tuple[str, ...]] = {
    "keras.Model (TensorFlow trainer)": (
        "_maybe_symbolic_build",   # kmp.prepare shadows it on the instance
        "_make_function",          # kmp.prepare shadows it on the instance
        "_jit_compile",            # read, and set while Keras builds a function
        "_distribute_strategy",
        "_compute_loss",
        "_compile_config",         # kmp.prepare: a replaced LossScaleOptimizer is what save() writes
        "_loss_tracker",
        "_call_has_training_arg",
        "_autoconvert_optionals",
        "_initial_epoch",          # kmp.callbacks.BackupAndRestore: the epoch fit() resumes at
        "_symbolic_build",         # kmp.prepare on one device, kmp.engine.overflow_layer: builds before the step
        "_compile_metrics",        # kmp.prepare: whether Keras still needs a batch to build them
        "_compile_loss",
    ),
    "keras.layers.Layer": (
        "_flatten_layers",         # kmp.engine.overflow_layer: a layer's direct sublayers, to number them
        "call",                    # kmp.engine.overflow_layer shadows it (or quantized_call) on the instance,
        "quantized_call",          # for one traced or eager forward pass, then restores it
        "_call_has_training_arg",
    ),
    "keras.optimizers.Optimizer": (
        "_learning_rate",          # kmp.engine.fused: variable, schedule or callable
        "_iterations",             # (also read by tests/real_models.py: the steps an optimizer took)
        "_get_current_learning_rate",  # kmp.engine.layout: the rate of the flat update's step
        "_trainable_variables",
        "_trainable_variables_indices",
        "_var_key",
        "_get_variable_index",
        "_use_weight_decay",
        "_filter_empty_gradients",
        "_overwrite_variable_with_gradient",
        "_momentums",              # Adam, AdamW
        "_velocities",             # Adam, AdamW
    ),
    "keras.optimizers.Optimizer(gradient_accumulation_steps=N)": (
        "_accumulated_gradients",  # kmp.memory.allocation: counted as accumulators
    ),
    # kmp.engine.rules: the slots the flat buffers train in place of Keras's.
    "keras.optimizers.Adagrad": ("_accumulators",),
    "keras.optimizers.Lion": ("_momentums",),
    "keras.optimizers.Lamb": ("_momentums", "_velocities"),
    "keras.Variable (TensorFlow backend)": (
        "_value",                  # kmp.engine.zero: the TensorFlow variable behind it, moved to host memory and back;
                                   # kmp.LossScaleOptimizer.build: an optimizer's step counter made outside the scope
    ),
    "keras TFOptimizer": (
        "_all_reduce_sum_gradients",  # shadowed on the inner optimizer for one call, then restored
        "_distribution_strategy",  # kmp.Adam8bit.build: the strategy its variables are made under; set by
                                   # kmp.LossScaleOptimizer.build on an optimizer made outside the scope
    ),
    "keras TFEpochIterator": (
        "_distributed_dataset",    # kmp.prepare: the data's shapes, to build a model before its first step
        "_get_iterator",           # kmp.engine.iterators: each epoch's iterator made when first used
    ),
    "tf.distribute DistributedDataset": (
        "_options",                # kmp.engine.host_batches: None where Keras's fit() distributed the dataset
        "_original_dataset",       # kmp.engine.host_batches: the dataset before it was distributed
    ),
    "tf.experimental.Optional": (
        "_element_spec",           # kmp.prepare's multi-step loop: the spec is known after one trace
    ),
    "tf.distribute DistributedVariable": (
        "_get_on_device_or_primary",  # kmp.engine.fused: this replica's own component
    ),
    "tf.distribute MirroredStrategy's extended (MultiWorkerMirrored's too)": (
        "_get_variable_creator_initial_value",  # kmp.distribute.same_start: shadowed on the instance for a block
        "_use_merge_call",         # kmp.distribute.communication: whether its replicas run with merge_call
    ),
    "tf.distribute MultiWorkerMirroredStrategy's extended": (
        "_cross_device_ops",       # kmp.distribute.scatter: its launchers, for the all-to-all
    ),
    "tf.distribute CollectiveAllReduce (those cross-device ops)": (
        "_launchers",              # one per local replica
    ),
    "tf.distribute CollectiveReplicaLauncher": (
        "_group_key", "_group_size", "_device", "_options",
        "_next_instance_key", "_get_ordering_token",  # the keys and order its own collectives use
    ),
    "tf.distribute ReplicaContext": (
        "_replica_id",             # kmp.distribute.scatter: this replica's local index (its launcher)
    ),
    "tf.data.Dataset": (
        "_inputs",                 # kmp.input_pipeline: walks the pipeline to refuse a batched dataset
    ),
    "type names in a tf.data pipeline": (  # kmp.input_pipeline compares them: an unbatch undoes a batch
        "_UnbatchDataset", "_DenseToRaggedDataset",
    ),
    "TensorFlow's registered ops": (  # run by name (kmp.seams "execute"): tf.raw_ops lists no private op
        "_ReadVariablesOp",        # kmp.engine.buffers: many variables read by one eager op
    ),
    "tf.__internal__.distribute": (
        "interim",                 # .maybe_merge_call (kmp.LossScaleOptimizer): Keras's own route to merge_call or not
    ),
    "tf.__internal__.tracking": (
        "Trackable",               # kmp.engine.replica_state.PerReplicaWindow: saved by tf.train.Checkpoint
    ),
}

_resolved: dict[str, Any] = {}


def get(name: str) -> Any:
    """The private object `name` of MODULE_SEAMS, imported on first use."""
    if name in _resolved:
        return _resolved[name]
    module_name, attribute, needed_by = MODULE_SEAMS[name]
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise KmpError(
            f"{needed_by}: expected Keras/TensorFlow to have {module_name}.{attribute}. "
            f"Received: this installation does not ({e}). kmp is tested with keras 3.15 and "
            "tensorflow 2.21: pip install 'keras>=3.15,<3.16' 'tensorflow>=2.21,<2.22'."
        ) from None
    _resolved[name] = value
    return value


def resolved() -> tuple[str, ...]:
    """The seams imported so far (tests check that `import kmp` imports none)."""
    return tuple(_resolved)
