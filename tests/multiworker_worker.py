"""One worker of tests/test_multiworker.py, and the single-process reference run.

As a script (one process per worker, TF_CONFIG set by the test):

    python tests/multiworker_worker.py OUT.json

it resolves the strategy with `kmp.distribute.resolve_strategy()` (which must
give MultiWorkerMirroredStrategy), records the errors of stock `fit()` and of
`fit()` with only the first of prepare's two replacements, trains with
`kmp.distribute.prepare`, and writes all that to OUT.json.

Imported as a file, `train(tf.distribute.get_strategy())` is the reference:
the same model, data and global batches in one process.

Data: one tf.data pipeline, `.batch(GLOBAL_BATCH)`, auto-sharded by DATA. Under
MultiWorkerMirroredStrategy each global batch is split in two: worker 0 gets
its first half, worker 1 its second half, so the step sees the same global
batches, in the same order, as the one-process run (the test checks the
split). Row SPIKE_ROW has a target of 1e4: its float16 output gradient,
2 * 1e4 / 8 * scale, passes float16's 65504 at any scale >= 32, so the step
that holds it is skipped, on both workers, although only worker 1 sees the
inf. The scale starts at 64, so it shrinks on those steps and grows between.
"""

from __future__ import annotations

import json
import os
import sys

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS = 48, 16, 8, 2
SPIKE_ROW = 5  # global batch 0, second half: worker 1's share
INITIAL_SCALE, GROWTH_STEPS = 64.0, 2
COLLECTIVE_TIMEOUT_S = 45
ACCUMULATION = 3  # micro-batches per optimizer step in the accumulation run


def make_data():
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(ROWS, 1))).astype("float32")
    y[SPIKE_ROW] = 1e4
    return x, y


def make_dataset(x, y):
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)


def build_model(units=32, accumulation=None, steps_per_execution=1):
    import keras

    import kmp

    init = lambda seed: keras.initializers.GlorotUniform(seed=seed)  # noqa: E731
    inputs = keras.Input((FEATURES,))
    # tanh, not relu: a relu input near 0 can land on either side in the two
    # runs (float16 rounding of differently split sums), and the runs then
    # differ by a whole Adam step in that unit.
    hidden = keras.layers.Dense(units, activation="tanh", kernel_initializer=init(1))(inputs)
    outputs = kmp.float32_output(keras.layers.Dense(1, kernel_initializer=init(2))(hidden))
    model = keras.Model(inputs, outputs)
    # Adam's update hardly depends on the gradient's size when epsilon is
    # tiny; with epsilon near the gradients' size, a gradient summed twice
    # or not averaged moves the weights by ~1e-2 and fails the parity test.
    optimizer = kmp.wrap(
        keras.optimizers.Adam(1e-2, epsilon=0.1), initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH_STEPS,
        **({} if accumulation is None else {"gradient_accumulation_steps": accumulation}),
    )
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def train(strategy, prepare=True, accumulation=None, steps_per_execution=1) -> dict:
    """Train under `strategy`; weights, losses and loss-scale state, as JSON-able values.

    With `accumulation`, also counts the all-reduces this replica makes.
    """
    import keras
    import tensorflow as tf

    import kmp.distribute
    import kmp.optimizer

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = make_data()
    with strategy.scope():
        model = build_model(accumulation=accumulation, steps_per_execution=steps_per_execution)
        calls = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.NONE, trainable=False)
    reduce = kmp.distribute.communication.all_reduce_sum

    def counting(grads, *args, **kwargs):
        calls.assign_add(1)
        return reduce(grads, *args, **kwargs)

    kmp.distribute.communication.all_reduce_sum = counting  # this process only, restored below
    if prepare:
        kmp.distribute.prepare(model)
    try:
        history = model.fit(make_dataset(x, y), epochs=EPOCHS, verbose=0, shuffle=False)
    finally:
        kmp.distribute.communication.all_reduce_sum = reduce
    clean = [row for row in range(ROWS) if row != SPIKE_ROW][:40]  # 5 full global batches
    eval_loss = model.evaluate(make_dataset(x[clean], y[clean]), verbose=0)
    opt = model.optimizer
    return {
        "optimizer": type(opt).__name__,
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "eval_loss": eval_loss,
        "all_reduces": int(strategy.experimental_local_results(calls)[0].numpy()),
        # kmp.distribute.replica_step's XLA functions, one per local replica (prepare's default).
        "xla_per_replica": len(vars(model).get("_kmp_replica_steps", {})),
        "state": {
            "scale": float(opt.dynamic_scale.numpy()),
            **{k: int(getattr(opt, k).numpy()) for k in
               ("iterations", "overflows", "skipped_steps", "good_steps", "hysteresis_left")},
        },
    }


def local_rows(strategy) -> list[list[int]]:
    """The data rows this worker's replica receives, per step."""
    import numpy as np

    x, y = make_data()
    out = []
    for batch_x, _ in strategy.experimental_distribute_dataset(make_dataset(x, y)):
        local = strategy.experimental_local_results(batch_x)[0].numpy()
        out.append([int(np.flatnonzero((x == row).all(axis=1))[0]) for row in local])
    return out


def fit_error(strategy, replaced=()) -> str | None:
    """The error fit() raises for a throwaway model with only `replaced` of prepare's methods, or None."""
    import types

    import kmp.distribute.fit as kmp_prepare

    x, y = make_data()
    with strategy.scope():
        model = build_model(units=4)
    for name in replaced:
        setattr(model, name, types.MethodType(kmp_prepare._REPLACEMENTS[name], model))
    try:
        model.fit(make_dataset(x, y).take(1), epochs=1, verbose=0, shuffle=False)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"[:300]
    return None


def main(argv: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tensorflow as tf

    import kmp.distribute

    # Two workers share this machine's cores; one thread each keeps them from
    # fighting over both.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    strategy = kmp.distribute.resolve_strategy(communication_options=options)
    result = {
        "multi_worker_mirrored": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
        "replicas": strategy.num_replicas_in_sync,
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "rows": local_rows(strategy),
        "stock_fit_error": fit_error(strategy),
        "symbolic_build_fix_only_error": fit_error(strategy, ["_maybe_symbolic_build"]),
    }
    result.update(train(strategy, prepare=True))
    result["accumulated"] = train(strategy, prepare=True, accumulation=ACCUMULATION)
    # Keras 3.15 fails for steps_per_execution > 1 under any multi-replica
    # strategy (keras-team/keras#19246); prepared, 6 batches an epoch run as
    # executions of 4 and 2 steps.
    result["four_steps_per_call"] = train(strategy, prepare=True, steps_per_execution=4)
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
