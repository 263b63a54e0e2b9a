"""One worker of tests/test_worker_failure.py: a fit() that can be killed and resumed.

    python tests/failure_worker.py OUT BACKUP_DIR [--kill-after N]

TF_CONFIG (set by the test) makes `kmp.resolve_strategy()` build a
MultiWorkerMirroredStrategy. The job is tests/multiworker_worker.py's: its
model (a small MLP, `kmp.wrap(Adam)` with dynamic loss scaling from 64), its
data (48 rows, global batches of 8, one row whose target overflows float16
in the first global batch of every epoch, in worker 1's half), trained for
EPOCHS epochs under mixed_float16 with `kmp.prepare(model)` and
`kmp.callbacks.BackupAndRestore(BACKUP_DIR, save_freq=SAVE_FREQ)`.

With `--kill-after N` the worker SIGKILLs itself right after its N-th
training step (counted by the optimizer: applied plus skipped steps), before
the next step starts: no Python cleanup, no exit handlers, as a machine or
OOM-killer failure would.

Writes:
  OUT.steps   one line per training step this process ran: the step count
              and the skipped (overflow) steps after it, so a killed worker
              leaves its progress behind;
  OUT.json    at the end: exit status, error (if fit() raised), the position
              the backup restored, steps run, loss-scale state, losses;
  OUT.npz     at the end, on success: the weights and every optimizer variable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

EPOCHS = 3
SAVE_FREQ = 5              # a backup after steps 5, 10, 15 (6 steps an epoch)
COLLECTIVE_TIMEOUT_S = 15  # a collective whose peer died fails after this long


def _optimizer_steps(optimizer) -> int:
    # kmp's `iterations` counts applied steps; overflowing ones are `skipped_steps`.
    return int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("backup_dir")
    parser.add_argument("--kill-after", type=int, default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    sys.path.insert(0, here)

    import warnings

    import keras
    import numpy as np
    import tensorflow as tf

    import kmp
    import multiworker_worker as job
    from kmp.callbacks.backup import BackupAndRestore

    warnings.filterwarnings("ignore", message=".*on CPU: CPUs have no fast float16 math.*")
    # Two workers share this machine's two cores: one thread each.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    # The uninterrupted and the resumed runs must make bit-identical steps.
    # On this CPU they do without it too (checked by hand); it states the premise.
    tf.config.experimental.enable_op_determinism()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    strategy = kmp.resolve_strategy(communication_options=options)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    kmp.set_precision("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = job.make_data()
    with strategy.scope():
        model = job.build_model()  # kmp.wrap(Adam), kmp.float32_output
    kmp.prepare(model)
    optimizer = model.optimizer
    steps_file = open(f"{args.out}.steps", "a", buffering=1)
    progress = {"first": None, "last": None}

    class Progress(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # After BackupAndRestore's on_train_begin (listed before): the restored count.
            progress["first"] = progress["last"] = _optimizer_steps(optimizer)

        def on_train_batch_end(self, batch, logs=None):
            count = _optimizer_steps(optimizer)
            if count == progress["last"]:
                return  # a batch the restored backup already held: dropped, not trained
            progress["last"] = count
            steps_file.write(f"{count} {int(optimizer.skipped_steps.numpy())}\n")
            if args.kill_after is not None and count == args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    backup = BackupAndRestore(args.backup_dir, save_freq=SAVE_FREQ)
    result = {"task": task, "multi_worker_mirrored": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)}
    try:
        history = model.fit(
            job.make_dataset(x, y), epochs=EPOCHS, verbose=0, shuffle=False,
            callbacks=[backup, kmp.callbacks.LossScaleMonitor(), Progress()],
        )
    except Exception as e:  # the peer died: record what TensorFlow raised, exit non-zero
        result.update(
            status="error", error_type=type(e).__name__, error=str(e)[:3000],
            traceback=traceback.format_exc()[-3000:], seconds=time.monotonic() - started,
            restored=backup.restored, first_step=progress["first"], last_step=progress["last"],
        )
        _write(args.out, result)
        return 3
    weights = model.get_weights()
    np.savez(f"{args.out}.npz", **{f"weight{i}": w for i, w in enumerate(weights)},
             **{f"optimizer{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
    result.update(
        status="ok",
        seconds=time.monotonic() - started,
        restored=backup.restored,
        first_step=progress["first"],
        last_step=progress["last"],
        loss=history.history["loss"],
        finite=bool(all(np.isfinite(w).all() for w in weights)),
        state={
            "scale": float(optimizer.dynamic_scale.numpy()),
            **{k: int(getattr(optimizer, k).numpy())
               for k in ("iterations", "skipped_steps", "good_steps", "hysteresis_left")},
        },
        backup_left=sorted(os.listdir(args.backup_dir)) if os.path.isdir(args.backup_dir) else None,
    )
    _write(args.out, result)
    return 0


def _write(out: str, result: dict) -> None:
    with open(f"{out}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
