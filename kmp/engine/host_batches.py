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
"""

from __future__ import annotations

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
