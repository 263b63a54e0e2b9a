"""Global batches read on the host and split between the replicas inside the step.

Under a strategy, Keras's fit() and evaluate() hand each epoch's dataset to
`strategy.experimental_distribute_dataset`, whose iterator is a
MultiDeviceIterator: it prefetches each replica's share onto its device and
traces a dozen small tf.functions every time it is made. When the replicas
are CPU devices of one machine they share the host's memory, so that buys
nothing, and it costs about 0.1 s per fit() call (benchmarks/p1_fit_parts.py).

A prepared model's train and test functions read such a strategy's batches
from a plain tf.data iterator on the undistributed dataset instead, and
split each global batch by rows in the step (`split`):

    replica k of N gets rows [k * ceil(B / N), (k + 1) * ceil(B / N)) of a batch of B rows

as tf.distribute splits it (tests/test_host_batches.py trains both ways,
uneven last batches included, and compares bit for bit). kmp's step weighs
each replica by the rows it had (kmp.engine.replica_step.row_weight), and
metrics sum their replicas' rows, as before.

Only where the dataset is Keras's own distribution of dense, batched
tensors: a dataset distributed with InputOptions or from a function, sparse
or ragged elements, several workers, GPUs and TPUs keep tf.distribute's
iterator.

Keras distributes the dataset when it makes fit()'s or evaluate()'s epoch
iterator, before any step, at about 0.012 s per call on P1, the same again
for fit()'s validation data. A prepared model's fit() and evaluate() make
Keras's own data adapter themselves (`hand_over`), with the arguments Keras
would, and give it to Keras in place of the data: its dataset counts as
distributed already and is distributed when something other than the
split step reads it (a first batch to build an unbuilt model, a dataset
the step cannot split). A model class with a fit() of its own that calls
Keras's (keras-hub's task models: they preprocess into a dataset first)
reaches Keras's through super(), which an instance's method cannot wrap:
there Keras distributes the dataset as before.
"""

from __future__ import annotations

import functools
import inspect

import keras
import tensorflow as tf

from kmp import seams
from kmp.engine.replica_step import splits_replicas


def possible(strategy: tf.distribute.Strategy) -> bool:
    """Whether `strategy`'s replicas are several CPU devices of this process alone."""
    if not splits_replicas(strategy) or seams.get("collective_all_reduce_multi_worker")(strategy):
        return False
    return all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in strategy.extended.worker_devices)


def undistributed(strategy: tf.distribute.Strategy, dataset) -> tf.data.Dataset | None:
    """The dataset Keras's fit() distributed into `dataset`, where its batches can be split in the step."""
    if not possible(strategy) or not isinstance(dataset, tf.distribute.DistributedDataset):
        return None
    # Keras distributes without InputOptions; a user's own distribution (options, a function) stays.
    if dataset._options is not None or not hasattr(dataset, "_original_dataset"):
        return None
    original = dataset._original_dataset
    specs = keras.tree.flatten(original.element_spec)
    if not all(type(s) is tf.TensorSpec and s.shape.rank for s in specs):
        return None
    return original


def is_global(batch) -> bool:
    """Whether `batch` (a step's input, traced) is one batch for all replicas, not one share per replica."""
    leaves = [v for v in keras.tree.flatten(batch) if v is not None]
    return bool(leaves) and not any(isinstance(v, tf.distribute.DistributedValues) for v in leaves)


def split(strategy: tf.distribute.Strategy, batch):
    """`batch` as per-replica values: each replica's rows (see the module docstring)."""
    n = strategy.num_replicas_in_sync

    def share(context):
        k = context.replica_id_in_sync_group
        return keras.tree.map_structure(lambda t: None if t is None else _rows(t, k, n), batch)

    return strategy.experimental_distribute_values_from_function(share)


def _rows(tensor, k: int, n: int):
    rows = tensor.shape[0]
    if rows is not None and rows % n:
        # Unequal static shares get an unknown row count, as tf.distribute's have:
        # kmp.engine.replica_step.row_weight takes static shapes for equal shares.
        tensor = tf.raw_ops.PlaceholderWithDefault(input=tensor, shape=[None] + tensor.shape[1:])
        rows = None
    rows = tf.shape(tensor)[0] if rows is None else rows
    each = -(-rows // n)  # ceil; a static batch's shares are static
    return tensor[k * each:(k + 1) * each]  # a slice past the end is empty (a batch of 1 on two replicas)


def handing_over(stock, fit: bool):
    """`stock` (Keras's fit or evaluate, unbound), its data handed over first (`hand_over`)."""
    parameters = inspect.signature(stock)

    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        bound = parameters.bind(self, *args, **kwargs)
        bound.apply_defaults()
        hand_over(self, bound.arguments, fit)
        return stock(*bound.args, **bound.kwargs)

    return method


def hand_over(model: keras.Model, arguments: dict, fit: bool = True) -> None:
    """fit()'s (or evaluate()'s) `arguments`, bound with their defaults, with the data as Keras's own adapter of
    it whose dataset is distributed only when read (see the module docstring). Left as they are where the
    batches are not split in the step, the data is an adapter already, or fit() splits arrays for validation."""
    strategy = model.distribute_strategy
    if model.run_eagerly or not possible(strategy) or not _KERAS[fit] <= set(arguments) or _made(arguments["x"]):
        return  # (or a fit() or evaluate() of the model class's own, with other arguments: keras-hub's)
    if fit and arguments["validation_split"] and arguments["validation_data"] is None:
        return
    if not fit and arguments.get("kwargs"):
        return  # Keras's own keyword for fit()'s validation, whose epoch iterator is made already
    steps = arguments["steps_per_epoch" if fit else "steps"]
    limit = keras.config.max_steps_per_epoch()  # the epoch iterator's own cap, for its debugging runs
    if limit and (not steps or limit < steps):
        steps = limit
    arguments.update(
        x=_adapter(strategy, arguments["x"], arguments["y"], arguments["sample_weight"], arguments["batch_size"],
                   steps, arguments["shuffle"] if fit else False, arguments["class_weight"] if fit else None),
        y=None, sample_weight=None)
    if fit:
        arguments["class_weight"] = None
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(arguments["validation_data"])
        if not _made(x):  # as fit() makes the validation's epoch iterator
            arguments["validation_data"] = _adapter(
                strategy, x, y, sample_weight, arguments["validation_batch_size"] or arguments["batch_size"],
                arguments["validation_steps"], False, None)


# The arguments of Keras 3.15's fit() and evaluate() that hand_over reads.
_KERAS = {True: {"x", "y", "sample_weight", "batch_size", "steps_per_epoch", "shuffle", "class_weight",
                 "validation_split", "validation_data", "validation_batch_size", "validation_steps"},
          False: {"x", "y", "sample_weight", "batch_size", "steps", "kwargs"}}


def _made(x) -> bool:
    """Whether `x` is no data, or data Keras takes as it is (an adapter, a distributed dataset)."""
    return x is None or isinstance(x, (seams.get("DataAdapter"), tf.distribute.DistributedDataset))


def _adapter(strategy, x, y, sample_weight, batch_size, steps, shuffle, class_weight):
    adapter = seams.get("get_data_adapter")(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                                           steps_per_epoch=steps, shuffle=shuffle, class_weight=class_weight)
    return _adapter_class()(strategy, adapter)


class _Handed:
    """Keras's data adapter `adapter`, whose tf.data dataset comes as `_Undistributed`; every other member of
    Keras's DataAdapter is the adapter's own (`_adapter_class`)."""

    def __init__(self, strategy, adapter):
        self._strategy, self._adapter = strategy, adapter

    def get_tf_dataset(self):
        return _Undistributed(self._strategy, self._adapter.get_tf_dataset())


@functools.lru_cache(maxsize=None)
def _adapter_class():
    """_Handed as a DataAdapter (what Keras's epoch iterator takes as it is), the rest of whose public members,
    methods and properties, are delegated to the adapter: whatever Keras's DataAdapter declares."""
    base = seams.get("DataAdapter")

    def delegated(name):
        if isinstance(getattr(base, name), property):
            return property(lambda self: getattr(self._adapter, name))
        return lambda self, *args, **kwargs: getattr(self._adapter, name)(*args, **kwargs)

    members = {name: delegated(name) for name in vars(base) if not name.startswith("_") and name not in vars(_Handed)}
    return type("HostBatchesAdapter", (_Handed, base), members)


class _Undistributed(tf.distribute.DistributedDataset):
    """A dataset Keras takes as distributed, distributed by `strategy` when first read (iterated, or anything
    but its undistributed original asked of it); `undistributed` finds the original in it."""

    def __init__(self, strategy, dataset):
        self._strategy, self._original_dataset, self._options, self._distributed = strategy, dataset, None, None

    def _whole(self):
        if self._distributed is None:
            self._distributed = self._strategy.experimental_distribute_dataset(self._original_dataset)
        return self._distributed

    def __iter__(self):
        return iter(self._whole())

    @property
    def element_spec(self):
        return self._whole().element_spec

    def reduce(self, initial_state, reduce_func):
        return self._whole().reduce(initial_state, reduce_func)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_strategy", "_original_dataset", "_options", "_distributed"):
            raise AttributeError(name)
        return getattr(self._whole(), name)
