"""BackupAndRestore: an interrupted fit() resumes at its last backup, in every worker.

    model.fit(data, epochs=3, callbacks=[kmp.callbacks.BackupAndRestore("/shared/backup", save_freq=50),
                                         kmp.callbacks.LossScaleMonitor()])

Why not keras.callbacks.BackupAndRestore (Keras 3.15)
-----------------------------------------------------
Keras's callback saves the right variables (`model.save_weights` holds the
model's and the optimizer's, and kmp's loss-scale state lives in optimizer
variables), but it does not resume where it saved, and it is not written for
several workers:

- With `save_freq=N` it backs up mid-epoch and records the batch, then reads
  only the epoch on restart: fit() begins that epoch at its first batch with
  weights that already learned from its first batches. Those batches are
  trained twice; the run no longer equals an uninterrupted one.
- Its epoch counter is set at epoch end only, so a restarted run's mid-epoch
  backups record epoch 0 until its first epoch ends: a second failure then
  goes back to epoch 0 with late weights.
- Under MultiWorkerMirroredStrategy every worker writes the same two files
  (weights, then a JSON with the epoch) at the same moment, in place. On
  127.0.0.1 the first backup already fails: HDF5's file lock refuses the
  second writer (`BlockingIOError: Unable to synchronously create file
  (unable to lock file ...)`), that worker's fit() stops and its peer's next
  all-reduce fails (TensorFlow 2.21, Keras 3.15, save_freq=5: three jobs of
  three). Where the writes do not collide, a worker killed during or between
  them leaves a truncated file or a pair that disagrees; at the end every
  worker deletes the directory.
- `model._initial_epoch` stays set after fit(): the model's next fit()
  silently starts at that epoch.

What this callback does
-----------------------
One file holds every variable a step depends on (the model's, including
random-seed state; the optimizer's, including the loss scale, its hysteresis
and step counters; each replica's running metric totals and open
accumulation window) and the position (epoch, batches done in it). One
worker writes it, atomically; every worker restores it:

    backup (every `save_freq` batches, or at each epoch end):
        per_replica = all_gather(each replica's metric totals and window sums)  # every worker joins
        if chief: values = the model's and optimizer's variables    # identical on every replica
                  write values, per_replica, position to a temporary file, fsync, rename over the backup
    restore (on_train_begin, every worker):
        read the backup; under several workers, check that all read the same one
        assign the variables; each replica takes back its own window sums
        fit() starts at the saved epoch
        the saved epoch's first `batch` batches are read and dropped, not trained on
        (on_epoch_begin) the epoch's metric totals come back as they were

Every worker takes part in a backup because some state is each replica's
own: the metrics' running totals (Keras logs the mean over replicas of each
replica's result) and the partial sums of an open accumulation window (kmp's
`gradient_accumulation_steps`: nothing is communicated until the window
closes). They are all-gathered, a collective under
MultiWorkerMirroredStrategy: a chief gathering alone would wait for peers that
never join. A backup can therefore fall inside a window; restored on another
number of replicas, the window's total goes to replica 0 (kmp.engine.replica_state's
rule). A rename is atomic on POSIX file systems, so a worker killed at any
moment leaves the previous backup or the new one, never a torn file.

With the same data pipeline (the same global batches in the same order; a
shuffle must not depend on how many epochs an iterator object has run), the
resumed run makes exactly the updates the uninterrupted run makes from that
point: tests/test_worker_failure.py kills a worker of a two-worker job with
SIGKILL and checks the resumed result bit for bit.

Requirements and limits:

- Every worker must see `backup_dir` (a shared or network file system across
  machines). The workers check this at restore: reading different backups
  (or one finding none) is an error, not a silent divergence.
- List it before `kmp.callbacks.LossScaleMonitor` in `callbacks=[...]`: the
  monitor reads the loss-scale state when training begins, which must be the
  restored one.
- The skipped batches of the resumed epoch reach the other callbacks as
  batches whose logs are the restored metrics; nothing trains on them. With
  `steps_per_execution=S`, each such call drops S batches.
- Local or mounted paths only (a rename is not atomic on object stores).
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid
import warnings

import keras
import numpy as np
import tensorflow as tf

from kmp import seams, values
from kmp.engine import engine, replica_state
from kmp.errors import KmpError, Problem, check

__all__ = ["BackupAndRestore", "BackupError", "read_backup"]

FORMAT = 1
_FILE = "kmp-backup.npz"
_PREVIOUS = "kmp-backup.previous.npz"
_TEMPORARY = ".kmp-backup.tmp-"  # + pid: a chief killed mid-write leaves one; removed when training begins
_GROUPS = ("model", "optimizer", "metrics")


class BackupError(KmpError, ValueError):
    """A backup that cannot be restored into this model, or workers that disagree about it."""


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up the whole training state and resumes fit() exactly at the last backup.

    A drop-in for `keras.callbacks.BackupAndRestore` (same arguments) that
    resumes mid-epoch at the saved batch and works under
    MultiWorkerMirroredStrategy; see the module docstring for what differs
    and why.

    Args:
        backup_dir: directory of the backup, seen by every worker; used by
            nothing else.
        save_freq: "epoch" (at each epoch end) or N (every N batches,
            counted over the whole run: after batches N, 2N, ...).
        double_checkpoint: also keep the previous backup, used when the
            latest cannot be read.
        delete_checkpoint: delete the backup when fit() completes.
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True):
        problems = []
        if not isinstance(backup_dir, (str, os.PathLike)) or not str(backup_dir):
            problems.append(Problem("backup_dir", "a directory path", backup_dir))
        elif "://" in str(backup_dir):
            problems.append(Problem(
                "backup_dir", "a local or mounted directory (the backup is renamed into place)", backup_dir,
                "Mount the bucket (e.g. gcsfuse) or use a shared file system.",
            ))
        if save_freq != "epoch":
            values.int_in("save_freq", save_freq, 1, problems, fix='Or "epoch".')
        values.boolean("double_checkpoint", double_checkpoint, problems)
        values.boolean("delete_checkpoint", delete_checkpoint, problems)
        check(problems, "kmp.callbacks.BackupAndRestore arguments")
        super().__init__(str(backup_dir), save_freq=values.plain(save_freq),
                         double_checkpoint=double_checkpoint, delete_checkpoint=delete_checkpoint)
        self.path = os.path.join(self.backup_dir, _FILE)
        self.previous_path = os.path.join(self.backup_dir, _PREVIOUS)
        self._reset_position()

    def _reset_position(self):
        self._epoch = 0             # the epoch running now
        self._batch = 0             # batches of it trained (or restored) so far
        self._total = 0             # batches trained since the first run began, restarts included
        self._resume = None         # (epoch, batch, metric values) while a restored epoch is pending
        self._to_skip = 0           # batches of the restored epoch still to drop
        self._skipped_call = False  # the last train-function call dropped batches
        self._installed = None      # (original train function, wrapper)
        self._initial_epoch = None  # the model's, before this fit()
        self._read_per_replica = None  # traced at the first backup of a fit()
        self.restored = None        # the position restored by this fit(), for logs and tests

    # -- restore -----------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._uninstall()
        self._reset_position()
        model = self.model
        self._initial_epoch = model._initial_epoch
        if not model.built:
            check([Problem(
                "model", "a built model (fit() builds it from the first batch before callbacks start)",
                f"{model.name} is not built", "Call the model on a batch, or model.build(shape), before fit().",
            )], "kmp.callbacks.BackupAndRestore")
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        if _is_chief(model.distribute_strategy):
            _remove_temporary_files(self.backup_dir)
        found = self._read()
        self._check_workers_agree(found)
        if found is None:
            return
        metadata, arrays = found
        variables = _variables(model)
        _check_matches(metadata, variables, found_in=self.path)
        engine.written(model)  # the flat-buffer engine reloads what is assigned here
        for group in ("model", "optimizer"):
            for i, variable in enumerate(variables[group]):
                variable.assign(arrays[f"{group}/{i}"])  # every local replica's copy
        # Then each replica's own window sums (backups written before kmp saved
        # them were taken at window boundaries, where they are zero).
        _restore_window(variables["window"], arrays.get("window"))
        epoch, batch = metadata["epoch"], metadata["batch"]
        self._epoch, self._batch, self._total = epoch, batch, metadata["total"]
        self.restored = {"epoch": epoch, "batch": batch, "total": metadata["total"]}
        model._initial_epoch = epoch  # Keras's fit() reads it after on_train_begin
        if batch:
            self._resume = (epoch, batch, arrays.get("metrics"))
            self._install_skipping()

    def _read(self):
        """(metadata, arrays) of the latest readable backup, or None."""
        paths = [self.path] + ([self.previous_path] if self.double_checkpoint else [])
        errors = []
        for path in paths:
            if not os.path.exists(path):
                continue
            try:
                with np.load(path, allow_pickle=False) as data:
                    arrays = {k: data[k] for k in data.files}
                metadata = json.loads(arrays.pop("metadata").tobytes().decode("utf-8"))
            except (OSError, ValueError, KeyError) as e:
                errors.append(f"{path}: {type(e).__name__}: {e}")
                continue
            if metadata.get("format") != FORMAT:
                raise BackupError(
                    f"kmp.callbacks.BackupAndRestore: expected a backup of format {FORMAT}. Received: format "
                    f"{metadata.get('format')!r} in {path}. Delete {self.backup_dir} to start over, or resume "
                    "with the kmp version that wrote it."
                )
            if errors:
                warnings.warn(
                    f"kmp.callbacks.BackupAndRestore: could not read the latest backup ({'; '.join(errors)}); "
                    f"resuming from the previous one, after step {metadata['total']}.",
                    stacklevel=2,
                )
            return metadata, arrays
        if errors:
            raise BackupError(
                "kmp.callbacks.BackupAndRestore: expected a readable backup. Received: "
                + "; ".join(errors)
                + f". Delete {self.backup_dir} to start over (the backups are written atomically, "
                "so this is damage from outside the training job)."
            )
        return None

    def _check_workers_agree(self, found):
        """Under several workers: every worker must have read the same backup (or none)."""
        strategy = self.model.distribute_strategy
        if not seams.get("collective_all_reduce_multi_worker")(strategy):
            return
        mine = [0, 0, 0, 0] if found is None else [1, found[0]["total"], *found[0]["id"]]
        # One row per replica, all-gathered: a collective every worker joins here.
        rows = strategy.gather(strategy.experimental_distribute_values_from_function(
            lambda _: tf.constant([mine], tf.int64)), axis=0).numpy().tolist()
        if any(row != rows[0] for row in rows):
            described = "; ".join(
                f"replica {i}: " + (f"the backup after step {r[1]} (id {r[2]:08x}{r[3]:08x})" if r[0] else "none")
                for i, r in enumerate(rows)
            )
            raise BackupError(
                "kmp.callbacks.BackupAndRestore: expected every worker to read the same backup from backup_dir "
                f"(here {self.backup_dir}). Received: {described}. Put backup_dir on a file system every worker "
                "sees, at the same path (all of them read it; only the chief writes it)."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._resume is not None and self._resume[0] == epoch:
            _, self._batch, metrics = self._resume
            self._to_skip = self._batch
            # Keras reset the metrics just before this call; the epoch's
            # running totals come back so its logs cover all of its batches.
            _restore_per_replica(self.model.distribute_strategy, self.model.metrics_variables, metrics)
            self._resume = None
        else:
            self._batch = 0
            self._to_skip = 0

    def _install_skipping(self):
        model = self.model
        original = model.train_function

        def train_function_resuming(iterator):
            if self._to_skip <= 0:
                # Done dropping: step out of the way (if nothing wrapped us since).
                if model.train_function is train_function_resuming:
                    model.train_function = original
                self._skipped_call = False
                return original(iterator)
            # The data of the batches the backup already holds: read, not trained on.
            count = min(self._to_skip, int(model.steps_per_execution or 1))
            for _ in range(count):
                next(iterator)  # StopIteration at the end of the data: Keras ends the epoch
            self._to_skip -= count
            self._skipped_call = True
            return model.get_metrics_result()

        self._installed = (original, train_function_resuming)
        model.train_function = train_function_resuming

    def _uninstall(self):
        if self._installed is None:
            return
        original, wrapper = self._installed
        if self.model is not None and self.model.train_function is wrapper:
            self.model.train_function = original
        self._installed = None

    # -- backup ------------------------------------------------------------

    def on_train_batch_end(self, batch, logs=None):
        if self._skipped_call:
            self._skipped_call = False
            return
        done = batch + 1
        steps = self.params.get("steps") if isinstance(self.params, dict) else None
        if steps:
            done = min(done, steps)  # the last execution of an epoch can hold fewer batches
        added = max(done - self._batch, 0)
        self._batch = done
        self._total += added
        if self.save_freq != "epoch" and self._total // self.save_freq > (self._total - added) // self.save_freq:
            self._save_model()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._batch = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save_model()

    def _save_model(self):
        model = self.model
        engine.observe(model)  # the flat-buffer engine's weights, into the variables read here
        strategy = model.distribute_strategy
        variables = _variables(model)
        # Every worker joins one gather (a collective) of each replica's own
        # values; the chief writes.
        if self._read_per_replica is None:
            self._read_per_replica = _per_replica_reader(strategy, variables["metrics"] + variables["window"])
        rows = self._read_per_replica()
        split = sum(int(np.prod(v.shape)) for v in variables["metrics"])
        arrays = {"metrics": rows[:, :split], "window": rows[:, split:]}
        if not _is_chief(strategy):
            return
        arrays.update({f"{g}/{i}": _read(v) for g in ("model", "optimizer") for i, v in enumerate(variables[g])})
        metadata = {
            "format": FORMAT,
            "epoch": self._epoch,
            "batch": self._batch,
            "total": self._total,
            "id": [int(x) for x in divmod(uuid.uuid4().int >> 66, 2**31)],  # two int64-safe halves
            "writer": _worker_name(strategy),
            "time": time.time(),
            "variables": {g: [_describe(v) for v in variables[g]] for g in _GROUPS},
        }
        arrays["metadata"] = np.frombuffer(json.dumps(metadata).encode("utf-8"), dtype=np.uint8)
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = os.path.join(self.backup_dir, f"{_TEMPORARY}{os.getpid()}")
        with open(temporary, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if self.double_checkpoint and os.path.exists(self.path):
            # Killed between the two renames: the previous backup remains, and is read.
            os.replace(self.path, self.previous_path)
        os.replace(temporary, self.path)
        _fsync_directory(self.backup_dir)

    def on_train_end(self, logs=None):
        self._uninstall()
        if self.model is not None:
            self.model._initial_epoch = self._initial_epoch  # the next fit() starts where asked
        if self.delete_checkpoint and _is_chief(self.model.distribute_strategy):
            for path in (self.path, self.previous_path):
                if os.path.exists(path):
                    os.remove(path)
            _remove_temporary_files(self.backup_dir)
            try:
                os.rmdir(self.backup_dir)  # only if nothing else is in it
            except OSError:
                pass

    # Keras's file-pair implementation must not run.
    def _load_model(self):
        raise NotImplementedError("kmp.callbacks.BackupAndRestore restores in on_train_begin")


def read_backup(backup_dir) -> dict | None:
    """The metadata of the backup in `backup_dir` (position, writer, variables), or None."""
    path = os.path.join(str(backup_dir), _FILE)
    if not os.path.exists(path):
        return None
    with np.load(path, allow_pickle=False) as data:
        return json.loads(data["metadata"].tobytes().decode("utf-8"))


def _variables(model) -> dict[str, list]:
    optimizer = model.optimizer
    accumulation = getattr(optimizer, "accumulation", None)  # kmp.LossScaleOptimizer's
    return {
        "model": list(model.variables),  # weights and random-seed state
        "optimizer": list(optimizer.variables) if optimizer is not None else [],
        "metrics": list(model.metrics_variables),
        # Each replica's own accumulation state (also among "optimizer", as replica 0's).
        "window": list(accumulation.local_state()) if accumulation is not None else [],
    }


def _describe(variable) -> list:
    return [variable.path, list(variable.shape), str(variable.dtype)]


def _check_matches(metadata, variables, found_in):
    for group in _GROUPS:
        saved = metadata["variables"][group]
        ours = [_describe(v) for v in variables[group]]
        problem = None
        if len(saved) != len(ours):
            problem = f"{len(saved)} {group} variables, this model has {len(ours)}"
        else:
            # By position, as Keras loads weights: names can differ between
            # processes (dense vs dense_1) while the structure is the same.
            for (path, shape, dtype), (our_path, our_shape, our_dtype) in zip(saved, ours):
                if shape != our_shape or dtype != our_dtype:
                    problem = f"{group} variable {path} {shape} {dtype} where this model has {our_path} {our_shape} {our_dtype}"
                    break
        if problem:
            raise BackupError(
                f"kmp.callbacks.BackupAndRestore: expected the backup in {found_in} to come from this model, "
                f"optimizer and metrics. Received: {problem}. Resume with the same model and compile() "
                "arguments as the run that wrote it, or delete the backup directory to start over."
            )


def _read(variable) -> np.ndarray:
    # A model or optimizer variable is mirrored: in cross-replica context it
    # reads this worker's copy, the same on every replica, with no communication.
    return np.asarray(tf.convert_to_tensor(variable.value))


def _per_replica_reader(strategy, variables):
    """A function returning every replica's own values of `variables`: one
    float64 row per replica, in replica order.

    A metric keeps one running total per replica, and Keras logs the mean
    over replicas of each replica's own result: the sum alone would not give
    the same logs back. One all-gather per call (a collective under several
    workers), traced once: TensorFlow's eager gather traces anew at every call.
    """
    if not variables:
        return lambda: np.zeros((strategy.num_replicas_in_sync, 0))
    if not isinstance(variables[0].value, tf.distribute.DistributedValues):
        return lambda: np.concatenate([_read(v).astype(np.float64).ravel() for v in variables])[None]
    gather = replica_state.gather_rows(strategy, variables, tf.float64)
    return lambda: gather().numpy()


def _restore_per_replica(strategy, variables, rows) -> None:
    """Gives each local replica its own row of `_per_replica_reader`'s values."""
    if rows is None or not variables:
        return
    distributed = isinstance(variables[0].value, tf.distribute.DistributedValues)
    if rows.shape[0] != (strategy.num_replicas_in_sync if distributed else 1):
        warnings.warn(
            f"kmp.callbacks.BackupAndRestore: the backup was written by {rows.shape[0]} replicas and this run has "
            f"{strategy.num_replicas_in_sync}; the resumed epoch's metrics restart from zero (weights and "
            "optimizer state are restored as saved).",
            stacklevel=3,
        )
        return
    if distributed:
        ids = [int(i) for i in replica_state.replica_ids(strategy)]
    else:
        ids = [0]
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        components = (strategy.experimental_local_results(variable.value) if distributed else [variable])
        for replica, component in zip(ids, components):
            value = rows[replica, offset:offset + size].reshape(variable.shape)
            dtype = component.dtype.as_numpy_dtype if isinstance(component.dtype, tf.DType) else component.dtype
            component.assign(value.astype(dtype))
        offset += size


def _restore_window(variables, rows) -> None:
    """Each replica's own row of the gathered window state (rows: [replicas, all values])."""
    if rows is None or not variables:
        return
    sizes = [int(np.prod(v.shape)) for v in variables]
    parts = np.split(rows.astype(np.float32), np.cumsum(sizes)[:-1], axis=1)  # float32 sums, gathered as float64
    replica_state.assign_rows(variables, [p.reshape((rows.shape[0], *v.shape)) for p, v in zip(parts, variables)])


def _is_chief(strategy) -> bool:
    return bool(strategy.extended.should_checkpoint)


def _worker_name(strategy) -> str:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return "single worker"
    return f"{resolver.task_type} {resolver.task_id}"


def _remove_temporary_files(directory):
    for path in glob.glob(os.path.join(directory, f"{_TEMPORARY}*")):
        try:
            os.remove(path)
        except OSError:
            pass


def _fsync_directory(directory):
    # The rename itself reaches the disk only with the directory's entry.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
