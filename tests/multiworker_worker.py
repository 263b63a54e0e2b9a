"""One worker of tests/test_multiworker.py, and the single-process reference run.

As a script (one process per worker, TF_CONFIG set by the test):

    python tests/multiworker_worker.py OUT.json WINDOW_DIR ONE_DEVICE_DIR

it resolves the strategy with `kmp.distribute.resolve_strategy()` (which must
give MultiWorkerMirroredStrategy), records the errors of stock `fit()` and of
`fit()` with only the first of prepare's two replacements, loads the open
accumulation window saved in WINDOW_DIR by two replicas of one process,
trains with `kmp.distribute.prepare`, resumes an accumulation window from
kmp's BackupAndRestore (`resume_mid_window`), trains at ZeRO stage 1 and
resumes there the epoch saved on one device in ONE_DEVICE_DIR
(`zero_stage1`), and writes all that to OUT.json.

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
import time

_START = time.monotonic()


def phase(name: str) -> None:
    """A timestamped line in the worker's log: a failure's tail says where each worker was."""
    print(f"[worker phase +{time.monotonic() - _START:6.1f} s] {name}", flush=True)

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS = 48, 16, 8, 2
SPIKE_ROW = 5  # global batch 0, second half: worker 1's share
INITIAL_SCALE, GROWTH_STEPS = 64.0, 2
# A collective waits this long for the other worker: on a loaded 2-core CI host both
# workers once stood still for 148 s in a 6-step fit() that takes 3 s alone. A dead
# peer is caught sooner by the harness (tests/test_multiworker.py stops both
# workers as soon as one exits).
COLLECTIVE_TIMEOUT_S = 300
ACCUMULATION = 3  # micro-batches per optimizer step in the accumulation run
SCATTER_SHARD = 5  # elements of each replica's shard in scatter_across_workers


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


def build_model(units=32, accumulation=None, steps_per_execution=1, zero_stage=0, inner=None, overflow="skip"):
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
        inner or keras.optimizers.Adam(1e-2, epsilon=0.1), initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS, zero_stage=zero_stage, overflow=overflow,
        **({} if accumulation is None else {"gradient_accumulation_steps": accumulation}),
    )
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def train(strategy, prepare=True, accumulation=None, steps_per_execution=1, zero_stage=0, overflow="skip") -> dict:
    """Train under `strategy`; weights, losses and loss-scale state, as JSON-able values.

    With `accumulation`, also counts the all-reduces this replica makes.
    """
    import keras
    import tensorflow as tf

    import kmp.distribute
    import kmp.engine.engine
    import kmp.engine.state
    import kmp.scaling.optimizer

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = make_data()
    with strategy.scope():
        model = build_model(accumulation=accumulation, steps_per_execution=steps_per_execution, zero_stage=zero_stage,
                            overflow=overflow)
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
    engine = kmp.engine.engine.engine_of(model)
    return {
        "optimizer": type(opt).__name__,
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "eval_loss": eval_loss,
        "all_reduces": int(strategy.experimental_local_results(calls)[0].numpy()),
        # The forward/backward XLA functions, one per local replica: the flat-buffer
        # engine's (prepare's default), else kmp.engine.replica_step's.
        "flat_buffers": engine is not None,
        "sharded": bool(engine and engine.buffers.layout.sharded),
        "xla_per_replica": (len(vars(engine).get("_steps", {})) if engine
                            else len(kmp.engine.state.ensure(model).replica_steps)),
        "state": {
            "scale": float(opt.dynamic_scale.numpy()),
            **{k: int(getattr(opt, k).numpy()) for k in
               ("iterations", "overflows", "skipped_steps", "good_steps", "hysteresis_left")},
            **({"replayed_steps": int(opt.replayed_steps.numpy())} if overflow == "replay" else {}),
        },
    }


def resume_mid_window(strategy, directory) -> dict:
    """Resuming inside accumulation windows, under this strategy, with each save method.

    Windows of ACCUMULATION micro-batches. The first run is interrupted after
    step 8; after step 5 (2 micro-batches into a window; step 1's window
    overflowed) it saves on every worker, as TensorFlow's multi-worker guide
    says (the chief to SAVES, the others to SAVES/workertemp_<task>):
    kmp.callbacks.BackupAndRestore (save_freq=5), Keras's ModelCheckpoint
    (`.weights.h5` and `.keras`), `tf.train.Checkpoint`, and the last three
    once more with kmp's gather of the other workers' window sums switched
    off (`control-`, what kmp wrote before it gathered). Then:

    - BackupAndRestore: resumed, interrupted after step 11 (backup after 10:
      1 micro-batch in), resumed to the end;
    - every other file: a new model loads the chief's file on every worker
      and trains steps 6 to 12 (the overflow of step 7 among them); of the
      control files, only the `.weights.h5` is trained on, the others are
      loaded only.

    Weights and optimizer variables are compared byte for byte with an
    uninterrupted run.
    """
    import hashlib

    import keras
    import numpy as np
    import tensorflow as tf

    import kmp
    import kmp.engine.replica_state
    from kmp.callbacks.backup import BackupAndRestore

    batches = ROWS // GLOBAL_BATCH

    class Interrupt(Exception):
        pass

    class InterruptAfter(keras.callbacks.Callback):
        def __init__(self, step):
            super().__init__()
            self.step, self.epoch = step, 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch * batches + batch + 1 == self.step:
                raise Interrupt()

    def run(backup_dir, interrupt_after=None, more_callbacks=()):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        x, y = make_data()
        with strategy.scope():
            model = build_model(accumulation=ACCUMULATION)
        kmp.prepare(model)
        backup = BackupAndRestore(backup_dir, save_freq=5)
        callbacks = [backup, *more_callbacks] + ([InterruptAfter(interrupt_after)] if interrupt_after else [])
        try:
            model.fit(make_dataset(x, y), epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)
        except Interrupt:
            pass
        return model, backup.restored

    def state(model):
        arrays = model.get_weights() + [v.numpy() for v in model.optimizer.variables]
        return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest(), arrays

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    saves = os.path.join(directory, "saves")
    mine = saves if task == 0 else os.path.join(saves, f"workertemp_{task}")  # the guide's write_filepath
    os.makedirs(mine, exist_ok=True)
    names = {"weights": "m.weights.h5", "keras": "m.keras", "checkpoint": "ckpt"}

    def write(model, where, suffix=""):
        model.save_weights(os.path.join(where, f"{suffix}{names['weights']}"))
        model.save(os.path.join(where, f"{suffix}{names['keras']}"))
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        checkpoint.write(os.path.join(where, suffix + names["checkpoint"]))

    def window(model):
        """This worker's window: micro-batches in it and each replica's sums."""
        accumulation = model.optimizer.accumulation
        return {"micro_steps": int(accumulation.micro_steps.numpy()),
                "sums": [c.numpy() for v in accumulation.local_state() for c in kmp.engine.replica_state.components(v)]}

    class SaveAfter(InterruptAfter):
        """tf.train.Checkpoint, and the control files, after step `step`, on every worker."""

        saved = None  # this worker's window when it saved

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch * batches + batch + 1 != self.step:
                return
            tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).write(
                os.path.join(mine, names["checkpoint"]))
            across = kmp.engine.replica_state._across_workers
            kmp.engine.replica_state._across_workers = lambda micro_steps: False  # kmp before it gathered
            try:
                write(self.model, mine, "control-")
            finally:
                kmp.engine.replica_state._across_workers = across
            self.saved = window(self.model)

    def resume_from(method, prefix="", train=True):
        """A new model, the chief's file loaded on every worker, trained from step 6 to the end."""
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        x, y = make_data()
        path = os.path.join(saves, prefix + names[method])
        with strategy.scope():
            if method == "keras":
                model = keras.models.load_model(path)
            else:
                model = build_model(accumulation=ACCUMULATION)
                model.optimizer.build(model.trainable_variables)
                if method == "weights":
                    model.load_weights(path)
                else:
                    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
                    checkpoint.read(path).assert_existing_objects_matched()
        loaded = window(model)
        if not train:
            return None, loaded
        kmp.prepare(model)
        # One fit() of the global batches left: the last of epoch 1, then epoch 2.
        rest = np.concatenate([np.arange(5 * GLOBAL_BATCH, ROWS), np.arange(ROWS)])
        model.fit(make_dataset(x[rest], y[rest]), epochs=1, verbose=0, shuffle=False)
        return model, loaded

    def compared(model, reference):
        (digest, arrays), (reference_digest, reference_arrays) = state(model), state(reference)
        return {
            "identical": all(a.tobytes() == b.tobytes() for a, b in zip(reference_arrays, arrays, strict=True)),
            "max_difference": max(float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
                                  for a, b in zip(reference_arrays, arrays)),
            "digests": [reference_digest, digest],
            "steps": int(model.optimizer.iterations.numpy()) + int(model.optimizer.skipped_steps.numpy()),
            "skipped_steps": int(model.optimizer.skipped_steps.numpy()),
        }

    def rows_in_files(prefix=""):
        """How many replicas' rows each accumulation variable has in this worker's `prefix` files."""
        import h5py

        with h5py.File(os.path.join(mine, prefix + names["weights"]), "r") as f:
            weights = [f["optimizer/vars"][k].shape[0] for k in f["optimizer/vars"] if k.startswith("per_replica_")]
        checkpoint = tf.train.list_variables(os.path.join(mine, prefix + names["checkpoint"]))
        return {"weights": weights, "checkpoint": [shape[0] for name, shape in checkpoint if ".PER_REPLICA/" in name]}

    whole, _ = run(os.path.join(directory, "reference"))
    backup_dir = os.path.join(directory, "backup")
    save_after = SaveAfter(5)
    checkpoints = [keras.callbacks.ModelCheckpoint(os.path.join(mine, names["weights"]), save_weights_only=True,
                                                   save_freq=5),
                   keras.callbacks.ModelCheckpoint(os.path.join(mine, names["keras"]), save_freq=5)]
    first, _ = run(backup_dir, interrupt_after=8, more_callbacks=checkpoints + [save_after])
    micro_steps = int(first.optimizer.accumulation.micro_steps.numpy())
    _, second_restored = run(backup_dir, interrupt_after=11)
    last, last_restored = run(backup_dir)
    # At a window boundary nothing is gathered: the chief may save alone (as
    # a "save on the chief" script does). Were it a collective, the chief
    # would wait here for worker 1, which goes on to the barrier below.
    boundary = {"micro_steps": int(last.optimizer.accumulation.micro_steps.numpy())}
    if task == 0:
        last.save_weights(os.path.join(saves, "boundary." + names["weights"]))
        checkpoint = tf.train.Checkpoint(model=last, optimizer=last.optimizer)
        checkpoint.write(os.path.join(saves, "boundary." + names["checkpoint"]))
        boundary.update(rows_in_files("boundary."))
    boundary["barrier"] = float(strategy.reduce(
        "SUM", strategy.experimental_distribute_values_from_function(lambda _: tf.constant(1.0)), axis=None))
    out = {
        "micro_steps_at_interrupt": micro_steps,
        "restored": [second_restored, last_restored],
        **compared(last, whole),
        "micro_steps_at_save": save_after.saved["micro_steps"],
        "rows_in_files": rows_in_files(),
        "rows_in_control_files": rows_in_files("control-"),
        "chief_alone_at_a_boundary": boundary,
        "saved": {},
    }
    for method in names:
        # The control files are loaded only; one of them is also trained on to the end.
        for prefix, train in (("", True), ("control-", method == "weights")):
            phase(f"resume from {prefix}{method} (train={train})")
            resumed, loaded = resume_from(method, prefix, train)
            out["saved"][prefix + method] = {
                **(compared(resumed, whole) if train else {}),
                "loaded_micro_steps": loaded["micro_steps"],
                # This worker's replicas got back the sums they had when the file was written.
                "own_sums_back": all(np.array_equal(a, b) for a, b in zip(save_after.saved["sums"], loaded["sums"],
                                                                           strict=True)),
                "zero_sums_back": not any(np.any(a) for a in loaded["sums"]),
            }
    return out


def zero_stage1(strategy, directory, one_device_dir) -> dict:
    """ZeRO stage 1 across the two workers (kmp.engine.zero), beside train()'s stage-0 run:

    - `trained`: train() at stage 1;
    - `bytes`: the optimizer state this worker's device holds (its one replica):
      the flat buffers' shards, and Keras's copy (once per process, on the host);
    - `saved`: one epoch at stage 1, then every worker saves a `.keras` file
      (the chief to `directory`, the other to workertemp_1, as TensorFlow's
      multi-worker guide says); on the way the chief alone reads get_weights()
      mid-epoch, which must not wait for worker 1 (no collective);
    - `resumed`: the `.weights.h5` of one epoch on one device (written by the
      test in `one_device_dir`) loaded at stage 1 on both workers, then the
      second epoch;
    - `eight_bit`: kmp.Adam8bit trained two epochs on the per-variable path,
      the flat buffers, and the flat buffers at stage 1 (its uint8 states are
      made without TensorFlow's broadcast: kmp.distribute.same_start);
    - `eight_bit_per_variable_again`: the stage 1 model trained on per variable
      after that, its slots mirrored again.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import kmp
    import kmp.engine.engine

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    mine = directory if task == 0 else os.path.join(directory, f"workertemp_{task}")
    os.makedirs(mine, exist_ok=True)
    out = {"directory": directory, "trained": train(strategy, zero_stage=1), "scatter": scatter_across_workers(strategy)}

    def state_bytes(model):
        buffers = kmp.engine.engine.engine_of(model).buffers
        inner = model.optimizer.inner_optimizer
        keras_copy = [v.value for v in inner.variables if v is not inner.iterations and kmp.engine.zero.on_host(v)]
        shards = [c for n in buffers.slot_names for c in strategy.experimental_local_results(buffers.buffers[n])]
        return {"shards": sum(c.numpy().nbytes for c in shards),
                "shard_elements": [int(c.shape[0]) for c in shards],
                "keras_copy_on_host": sum(v.numpy().nbytes for v in keras_copy),
                "host": kmp.engine.zero.host(strategy), "replica_device": strategy.extended.worker_devices[0]}

    class ChiefReadsWeights(keras.callbacks.Callback):
        kmp_reads_weights = False  # no copies around it: the model's get_weights makes its own
        read = None

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and task == 0:
                self.read = [w.tolist() for w in self.model.get_weights()]

    def model_and_data(inner=lambda: None):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        with strategy.scope():  # the optimizer too: it keeps the strategy it was made under
            model = build_model(zero_stage=1, inner=inner())
        return kmp.prepare(model), make_data()

    model, (x, y) = model_and_data()
    reads = ChiefReadsWeights()
    model.fit(make_dataset(x, y), epochs=1, verbose=0, shuffle=False, callbacks=[reads])
    model.save(os.path.join(mine, "zero1.keras"))
    out["saved"] = {"bytes": state_bytes(model), "chief_read_mid_epoch": reads.read is not None,
                    "optimizer": [v.numpy().tolist() for v in model.optimizer.variables]}

    model, (x, y) = model_and_data()
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(one_device_dir, "epoch1.weights.h5"))
    history = model.fit(make_dataset(x, y), epochs=1, verbose=0, shuffle=False)
    out["resumed"] = {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"],
                      "sharded": kmp.engine.engine.engine_of(model).buffers.layout.sharded,
                      "state": {k: float(getattr(model.optimizer, k).numpy()) for k in
                                ("dynamic_scale", "iterations", "overflows", "skipped_steps")}}

    out["eight_bit"] = {}
    for name, stage, flat in (("per variable", 0, False), ("flat", 0, True), ("flat stage 1", 1, True)):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        with strategy.scope():
            # The hidden kernel quantized; the smaller variables keep float32 states (min_8bit_size).
            model = build_model(zero_stage=stage, inner=kmp.Adam8bit(1e-2, epsilon=0.1, block_size=8,
                                                                     min_8bit_size=33))
        history = kmp.prepare(model, flat_buffers=flat).fit(make_dataset(x, y), epochs=2, verbose=0, shuffle=False)
        engine = kmp.engine.engine.engine_of(model)
        out["eight_bit"][name] = {
            "loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()],
            "optimizer": [v.numpy().tolist() for v in model.optimizer.variables],
            "engine": None if engine is None else ("sharded" if engine.buffers.layout.sharded else "whole"),
            "skipped_steps": int(model.optimizer.skipped_steps.numpy())}
    # Back to the per-variable update after stage 1's flat buffers: Keras's slots, the 8-bit codes among them,
    # mirrored over the workers again (kmp.engine.zero.to_replicas; TensorFlow's broadcast takes no uint8).
    history = kmp.prepare(model, flat_buffers=False).fit(make_dataset(x, y), epochs=1, verbose=0, shuffle=False)
    out["eight_bit_per_variable_again"] = {
        "loss": history.history["loss"],
        "codes_mirrored": [isinstance(v.value, tf.distribute.DistributedValues) for v in model.optimizer.variables
                           if v.dtype == "uint8"]}
    return out


def scatter_across_workers(strategy) -> dict:
    """kmp.distribute.scatter across the workers, per communication setting: each replica's shard of
    the summed flat gradient, every replica's row, and the collectives the traced step holds."""
    import tensorflow as tf

    from kmp.config.settings import Communication
    from kmp.distribute import scatter

    out = {}
    for name, communication in (("one collective", Communication()),
                                ("bytes_per_pack 16", Communication(bytes_per_pack=16)),
                                ("float16", Communication(dtype="float16"))):
        @tf.function
        def step():
            def on_replica():
                replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
                flat = tf.range(2 * SCATTER_SHARD, dtype=tf.float32) * (replica + 1.0) + 0.5
                return (scatter.reduce_scatter_mean(flat, SCATTER_SHARD, communication, tf.constant(4.0), count=2.0),
                        scatter.gather_rows(tf.stack([replica, 10.0 * replica])))

            return strategy.run(on_replica)

        shard, rows = (strategy.experimental_local_results(t)[0].numpy().tolist() for t in step())
        graph = step.get_concrete_function().graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        out[name] = {"shard": shard, "rows": rows,
                     "collectives": sorted(n.op for n in nodes if n.op.startswith("Collective"))}
    return out


def load_window(strategy, directory) -> dict:
    """Loads the open window that test_multiworker.py saved on two replicas of
    one process (`m.weights.h5`, `ckpt-1`): each worker's replica must get the
    rows of the replica with its index among all replicas."""
    import keras
    import tensorflow as tf

    import kmp.engine.replica_state

    keras.config.set_dtype_policy("mixed_float16")
    out = {}
    for method in ("weights", "checkpoint"):
        with strategy.scope():
            model = build_model(accumulation=ACCUMULATION)
            model.optimizer.build(model.trainable_variables)
            if method == "weights":
                model.load_weights(os.path.join(directory, "m.weights.h5"))
            else:
                tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
                    os.path.join(directory, "ckpt-1")).assert_existing_objects_matched()
        accumulation = model.optimizer.accumulation
        out[method] = {
            "replica_ids": [int(i) for i in kmp.engine.replica_state.replica_ids(strategy)],
            "micro_steps": int(accumulation.micro_steps.numpy()),
            "sums": [[c.numpy().tolist() for c in kmp.engine.replica_state.components(v)] for v in accumulation.sums],
        }
    return out


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

    import kmp.engine.prepare as kmp_prepare

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


def forward_overflow(strategy) -> dict:
    """One global batch whose worker-1 share overflows a layer's float16 output.

    Row 4 (worker 1's) times the all-ones kernel of layer 'hot' is 16 * 3e4,
    past float16's 65504, while the input itself is finite in float16. Each
    worker names the layer from every worker's diagnosis (gathered), so worker
    0, whose own share was clean, names 'hot' too.
    """
    import keras
    import numpy as np

    import kmp
    import kmp.distribute
    from kmp.engine import overflow_layer
    from kmp.callbacks import LossScaleMonitor

    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data()
    x, y = x[:GLOBAL_BATCH].copy(), np.zeros((GLOBAL_BATCH, 1), "float32")
    x[4] = 3e4
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        # Linear: tanh would turn the inf into 1 and nothing downstream would overflow.
        models = {}
        for mode in ("backoff", "raise"):  # "backoff": the step goes on, to read the state; "raise": the default
            inputs = keras.Input((FEATURES,))
            hidden = keras.layers.Dense(4, kernel_initializer="ones", name="hot")(inputs)
            models[mode] = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(1, name="out")(hidden)))
            models[mode].compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1), initial_scale=INITIAL_SCALE,
                                                    forward_overflow=mode), loss="mse")
    model = kmp.distribute.prepare(models["backoff"])
    history = model.fit(make_dataset(x, y), epochs=1, verbose=0, callbacks=[LossScaleMonitor()])
    state = overflow_layer.state_of(model)
    layers = [int(v.numpy()) for v in strategy.experimental_local_results(state.layer.value)]
    logged = int(history.history["overflow_layer"][-1])
    try:
        kmp.distribute.prepare(models["raise"]).fit(make_dataset(x, y), epochs=1, verbose=0)
        raised = None
    except kmp.LossScaleError as e:
        raised = [getattr(e, "layer", None), int(models["raise"].optimizer.skipped_steps.numpy())]
    return {"overflows": history.history["overflows"], "logged": model.layers[logged].name if logged >= 0 else None,
            "named": [model.layers[i].name if i >= 0 else None for i in layers], "raised": raised}


def stuck_at_the_floor(strategy) -> dict:
    """A scale that starts at the floor and one worker's share non-finite in the first batch: plain fit()
    (prepared, no monitor) stops with kmp.LossScaleError on every worker at that step, and the job goes on."""
    import keras
    import numpy as np

    import kmp
    import kmp.distribute

    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data()
    x = x.copy()
    x[SPIKE_ROW] = np.inf  # worker 1's share of the first global batch
    with strategy.scope():
        model = build_model(units=4)
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1), initial_scale=1.0), loss="mse")
    kmp.distribute.prepare(model)
    weights = [w.copy() for w in model.get_weights()]
    try:
        model.fit(make_dataset(x, y), epochs=1, verbose=0)
        error = None
    except kmp.LossScaleError as e:
        error = str(e)[:80]
    return {"error": error, "skipped": int(model.optimizer.skipped_steps.numpy()),
            "iterations": int(model.optimizer.iterations.numpy()),
            "unchanged": all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))}


def wall_clock_breakdown(strategy) -> dict:
    """kmp.engine.wall_clock across workers: the lines (the chief's only) and the logs' keys (every worker's)."""
    import contextlib
    import io

    import keras

    import kmp.distribute

    keras.config.set_dtype_policy("mixed_float16")
    x, y = make_data()
    with strategy.scope():
        model = build_model()
    kmp.distribute.prepare(model, wall_clock_breakdown=3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = model.fit(make_dataset(x, y), epochs=1, verbose=0)  # 6 steps
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("kmp: steps")]
    return {"lines": lines, "keys": sorted(k for k in history.history if k.startswith("wall_clock/")),
            "total_ms": history.history["wall_clock/total_ms"][-1]}


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
    phase("load_window")
    result["loaded_window"] = load_window(strategy, argv[1])
    phase("train")
    result.update(train(strategy, prepare=True))
    phase("accumulated")
    result["accumulated"] = train(strategy, prepare=True, accumulation=ACCUMULATION)
    # Keras 3.15 fails for steps_per_execution > 1 under any multi-replica
    # strategy (keras-team/keras#19246); prepared, 6 batches an epoch run as
    # executions of 4 and 2 steps.
    # The spike in worker 1's share of the first batch overflows at the first scale: replayed on both workers.
    phase("replayed")
    result["replayed"] = train(strategy, prepare=True, overflow="replay")
    phase("four_steps_per_call")
    result["four_steps_per_call"] = train(strategy, prepare=True, steps_per_execution=4)
    phase("forward_overflow")
    result["forward_overflow"] = forward_overflow(strategy)
    phase("wall_clock_breakdown")
    result["wall_clock_breakdown"] = wall_clock_breakdown(strategy)
    phase("stuck_at_the_floor")
    result["stuck_at_the_floor"] = stuck_at_the_floor(strategy)
    phase("zero_stage1")
    result["zero_stage1"] = zero_stage1(strategy, os.path.join(os.path.dirname(argv[0]), "zero1"), argv[2])
    # Last: op determinism (for the byte comparison) stays on once set.
    tf.config.experimental.enable_op_determinism()
    phase("resume_mid_window")
    result["resume_mid_window"] = resume_mid_window(strategy, os.path.join(os.path.dirname(argv[0]), "mid-window"))
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
