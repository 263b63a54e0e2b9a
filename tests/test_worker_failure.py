"""A worker of a two-worker job dies (SIGKILL) mid-epoch; the job resumes from its last backup.

Issue 10: "MultiWorkerMirroredStrategy, two worker processes on 127.0.0.1:
kill one worker mid-epoch (SIGKILL), restart it; with BackupAndRestore the
job finishes with nothing lost beyond the last backup, and the result equals
an uninterrupted run's."

The job is tests/failure_worker.py (mixed float16, kmp.wrap(Adam) with
dynamic loss scaling, kmp.prepare, kmp.callbacks.BackupAndRestore every 5
steps, 3 epochs of 6 steps; the first step of each epoch overflows). This
file acts as the cluster manager:

    attempt 1: worker 1 SIGKILLs itself after step 9           (backup after step 5;
               step 7, an overflow, lies in the lost span)
               restart worker 1 alone, same TF_CONFIG
               any worker that then fails: stop the job, start every worker again
    (split:    worker 1 given a directory without the backup: both refuse to start)
    last attempt: both workers restore step 5 and finish       -> final state == R, bit for bit
    reference: both workers, uninterrupted, a job of its own   -> final state R
               (started with the restart: the failed job mostly waits from then on)

Every wait has a deadline; every process runs in its own process group,
which is killed and reaped at the end, and the test checks that none is
left. The in-process tests below cover the same callback on two logical
CPUs: several interruptions in one job, and Keras's own callback, which
resumes at the wrong step.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.callbacks.backup import BackupAndRestore, BackupError, read_backup
# kmp.cli.launch's ports and TF_CONFIG; the processes are started here, one by one, since the
# test restarts a single worker into a running job (kmp.cli.launch.LocalJob starts and stops them all).
from kmp.cli.launch import free_ports, tf_config

# One xdist worker runs the module: its fixtures (killed and reference jobs) are computed once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("worker_failure"),
              pytest.mark.filterwarnings("ignore:precision .mixed_float16. on CPU:UserWarning")]

_ROOT = Path(__file__).resolve().parent.parent
_WORKER = Path(__file__).resolve().parent / "failure_worker.py"
sys.path.insert(0, str(_WORKER.parent))
import failure_worker  # noqa: E402
import multiworker_worker as job  # noqa: E402

KILL_AFTER = 9          # worker 1 dies after this step (epoch 1, its third batch)
LAST_BACKUP = 5         # the last backup before it (save_freq 5)
BATCHES = job.ROWS // job.GLOBAL_BATCH  # 6 an epoch
TOTAL_STEPS = failure_worker.EPOCHS * BATCHES  # 18
JOB_DEADLINE_S = 100    # one job, start to finish (10-16 s here)
SURVIVOR_DEADLINE_S = 60  # the survivor fails within ~10 s (TensorFlow's heartbeat timeout)
RESTARTED_GRACE_S = 5     # how long the manager lets the other worker go on after a failure


class Cluster:
    """Worker processes on 127.0.0.1, each in its own process group; a log of what happened."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.backup_dir = directory / "backup"
        self.processes: dict[str, subprocess.Popen] = {}
        self.events: list[str] = []
        self.exited: set[str] = set()
        self.started = time.monotonic()

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:6.1f}s {text}")

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in free_ports(2)]

    def start(self, name: str, index: int, addresses: list[str], kill_after: int | None = None,
              backup_dir: Path | None = None) -> subprocess.Popen:
        env = dict(os.environ)
        env["TF_CONFIG"] = tf_config(addresses, index)
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
        command = [sys.executable, str(_WORKER), str(self.directory / name), str(backup_dir or self.backup_dir)]
        if kill_after is not None:
            command += ["--kill-after", str(kill_after)]
        with open(self.directory / f"{name}.log", "w") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT,
                                       start_new_session=True)  # its own process group
        self.processes[name] = process
        self.note(f"started {name} (worker {index}, pid {process.pid})")
        return process

    def wait(self, names: list[str], deadline_s: float, until: str = "all") -> dict[str, int | None]:
        """Waits until all of `names` exited (until="all") or any did ("any"); exit codes, None if running."""
        deadline = time.monotonic() + deadline_s
        while True:
            codes = {n: self.processes[n].poll() for n in names}
            for n, code in codes.items():
                if code is not None and n not in self.exited:
                    self.exited.add(n)
                    self.note(f"{n} exited with {code}")
            done = [c is not None for c in codes.values()]
            if (all(done) if until == "all" else any(done)) or time.monotonic() > deadline:
                return codes
            time.sleep(0.1)

    def stop(self, names: list[str]) -> None:
        """SIGKILL these processes' groups and reap them (a cluster manager stopping a job)."""
        for n in names:
            process = self.processes[n]
            if process.poll() is None:
                self.note(f"stopping {n}")
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)

    def left_behind(self) -> list[str]:
        alive = []
        for n, process in self.processes.items():
            try:
                os.killpg(process.pid, 0)  # no error: some process of the group still exists
                alive.append(f"{n} (group {process.pid})")
            except ProcessLookupError:
                pass
        return alive

    def result(self, name: str) -> dict:
        path = self.directory / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def steps(self, name: str) -> dict[int, int]:
        """{step: skipped steps so far} for each training step `name` ran."""
        path = self.directory / f"{name}.steps"
        lines = path.read_text().splitlines() if path.exists() else []
        return dict(tuple(int(v) for v in line.split()) for line in lines)

    def report(self) -> str:
        tails = []
        for n in self.processes:
            log = self.directory / f"{n}.log"
            text = log.read_text()[-2500:] if log.exists() else ""
            tails.append(f"--- {n} (exit code {self.processes[n].returncode}) ---\n{text}")
        return "events:\n" + "\n".join(self.events) + "\n" + "\n".join(tails)


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def failure_run(tmp_path_factory):
    """Runs the killed job to its end, and the uninterrupted reference beside it; returns what happened."""
    cluster = Cluster(tmp_path_factory.mktemp("worker_failure"))
    try:
        # Attempt 1: worker 1 kills itself after step KILL_AFTER.
        addresses = cluster.addresses()
        cluster.start("first0", 0, addresses)
        cluster.start("first1", 1, addresses, kill_after=KILL_AFTER)
        codes = cluster.wait(["first1"], JOB_DEADLINE_S)
        killed_code = codes["first1"]
        backup_after_kill = read_backup(cluster.backup_dir)
        files_after_kill = sorted(os.listdir(cluster.backup_dir)) if cluster.backup_dir.exists() else []
        # Restart the dead worker alone, into the same cluster, as a cluster manager would.
        cluster.start("restarted1", 1, addresses)
        # The uninterrupted reference, a job of its own (ports, backups deleted at its end), runs
        # meanwhile: the failed job spends this time waiting (for heartbeats, for the grace below).
        reference_addresses = cluster.addresses()
        for i in range(2):
            cluster.start(f"reference{i}", i, reference_addresses,
                          backup_dir=cluster.directory / "reference-backup")
        codes = cluster.wait(["first0", "restarted1"], SURVIVOR_DEADLINE_S, until="any")
        finished_in_place = codes == {"first0": 0, "restarted1": 0}
        if not finished_in_place:
            # A worker failed (or the deadline passed). Give the other a few
            # seconds to fail too, then stop what is left and start every
            # worker again: a new job, resuming from the backup.
            cluster.wait(["first0", "restarted1"], RESTARTED_GRACE_S)
            survivor = {"code": cluster.processes["first0"].poll(), **cluster.result("first0")}
            restarted = {"code": cluster.processes["restarted1"].poll(), **cluster.result("restarted1")}
            cluster.stop(["first0", "restarted1"])
            # A misconfigured restart first: worker 1 gets a directory without the backup.
            addresses = cluster.addresses()
            cluster.start("split0", 0, addresses)
            cluster.start("split1", 1, addresses, backup_dir=cluster.directory / "not-shared")
            cluster.wait(["split0", "split1"], JOB_DEADLINE_S)
            cluster.stop(["split0", "split1"])
            addresses = cluster.addresses()
            cluster.start("last0", 0, addresses)
            cluster.start("last1", 1, addresses)
            codes = cluster.wait(["last0", "last1"], JOB_DEADLINE_S)
            if list(codes.values()) != [0, 0]:
                pytest.fail("the restarted job failed or ran past its deadline\n" + cluster.report())
            last = ["last0", "last1"]
        else:
            survivor, restarted = cluster.result("first0"), cluster.result("restarted1")
            last = ["first0", "restarted1"]
        codes = cluster.wait(["reference0", "reference1"], JOB_DEADLINE_S)
        if list(codes.values()) != [0, 0]:
            pytest.fail("the uninterrupted job failed or ran past its deadline\n" + cluster.report())
        # Every job has ended: kill and reap every process group started, then look for any left.
        cluster.stop(list(cluster.processes))
        yield {
            "cluster": cluster,
            "killed_code": killed_code,
            "backup_after_kill": backup_after_kill,
            "files_after_kill": files_after_kill,
            "survivor": survivor,
            "restarted": restarted,
            "finished_in_place": finished_in_place,
            "reference": [cluster.result(f"reference{i}") for i in range(2)],
            "reference_arrays": [_arrays(cluster.directory / f"reference{i}.npz") for i in range(2)],
            "split": [cluster.result(f"split{i}") for i in range(2)],
            "last": [cluster.result(n) for n in last],
            "last_arrays": [_arrays(cluster.directory / f"{n}.npz") for n in last],
            "killed_steps": cluster.steps("first1"),
            "survivor_steps": cluster.steps("first0"),
            "last_steps": [cluster.steps(n) for n in last],
            # Every job has ended: stop (and reap) every process group started, then look for survivors.
            "left_behind": cluster.left_behind(),
        }
    finally:
        cluster.stop(list(cluster.processes))
        left = cluster.left_behind()
        print("\n".join(cluster.events))
        assert not left, f"processes left behind: {left}"


def test_killed_worker_dies_after_a_backup_and_before_the_next(failure_run):
    run = failure_run
    assert run["killed_code"] == -signal.SIGKILL, run["cluster"].report()
    assert list(run["killed_steps"]) == list(range(1, KILL_AFTER + 1))
    # Overflows at steps 1 and 7 (each epoch's first batch): one before the
    # backup, one in the span the kill loses.
    assert run["killed_steps"][LAST_BACKUP] == 1 and run["killed_steps"][KILL_AFTER] == 2
    # Written by the chief only, atomically: one file, no temporary left.
    backup = run["backup_after_kill"]
    assert backup is not None and backup["writer"] == "worker 0"
    assert (backup["epoch"], backup["batch"], backup["total"]) == (0, LAST_BACKUP, LAST_BACKUP)
    assert run["files_after_kill"] == ["kmp-backup.npz"]
    # The survivor got no further than the dead worker: every step needs both.
    assert max(run["survivor_steps"]) == KILL_AFTER


def test_survivor_fails_and_the_whole_job_is_restarted(failure_run):
    """What TensorFlow 2.21 does when a MultiWorkerMirroredStrategy worker dies.

    The survivor does not hang: its pending all-reduce is aborted by the
    coordination service (which runs in worker 0), either when the dead
    worker misses its heartbeats (about 10 s) or, sooner, when the restarted
    worker registers with a new incarnation. fit() raises and the process
    exits. The restarted worker cannot join the old cluster: it waits in
    the strategy's setup for a coordination service that is gone (in our
    runs: no error within RESTARTED_GRACE_S, and still waiting after four
    minutes when left alone). The job goes on only as a new job of all
    workers, from the backup.
    """
    run = failure_run
    survivor, restarted = run["survivor"], run["restarted"]
    assert not run["finished_in_place"], run["cluster"].report()
    assert survivor["code"] == 3 and survivor["status"] == "error", run["cluster"].report()
    assert survivor["error_type"] in ("AbortedError", "UnavailableError"), survivor
    assert ("tried to connect with a different incarnation" in survivor["error"]
            or "stopped sending heartbeats" in survivor["error"]), survivor["error"]
    assert survivor["last_step"] == KILL_AFTER
    assert restarted["code"] != 0, run["cluster"].report()  # None: still waiting when stopped (what we saw)


def test_workers_that_read_different_backups_stop_before_training(failure_run):
    """backup_dir must be seen by every worker: a worker that finds no backup
    while the chief finds one would train other steps and leave the job hanging."""
    for result in failure_run["split"]:
        assert result["status"] == "error" and result["error_type"] == "BackupError", result
        assert "expected every worker to read the same backup" in result["error"]
        assert f"Received: replica 0: the backup after step {LAST_BACKUP} (id " in result["error"]
        assert "; replica 1: none. Put backup_dir on a file system every worker sees" in result["error"]
        assert result["last_step"] is None  # raised in on_train_begin: no step ran


def test_resumed_job_loses_only_the_steps_after_the_last_backup(failure_run):
    run = failure_run
    for result in run["last"]:
        assert result["status"] == "ok"
        assert result["restored"] == {"epoch": 0, "batch": LAST_BACKUP, "total": LAST_BACKUP}
        assert (result["first_step"], result["last_step"]) == (LAST_BACKUP, TOTAL_STEPS)
    for steps in run["last_steps"]:  # steps 6-18 ran once each in the last attempt, none before
        assert list(steps) == list(range(LAST_BACKUP + 1, TOTAL_STEPS + 1))
    lost = KILL_AFTER - run["last"][0]["first_step"]
    assert 0 <= lost < failure_worker.SAVE_FREQ
    # The overflow at step 7 (epoch 1's first batch) was in the lost span: redone, skipped again.
    assert run["last"][0]["state"]["skipped_steps"] == failure_worker.EPOCHS
    # The backup directory is removed when the job completes.
    assert run["last"][0]["backup_left"] is None


def test_resumed_job_equals_the_uninterrupted_one_bit_for_bit(failure_run):
    run = failure_run
    reference, resumed = run["reference"][0], run["last"][0]
    assert resumed["state"] == reference["state"]
    assert resumed["loss"] == reference["loss"]  # the resumed epoch's metrics were restored too
    assert resumed["finite"] and reference["finite"]
    expected = run["reference_arrays"][0]
    for arrays in run["last_arrays"] + run["reference_arrays"][1:]:
        assert sorted(arrays) == sorted(expected)
        for key, value in expected.items():
            assert arrays[key].dtype == value.dtype
            assert arrays[key].tobytes() == value.tobytes(), (
                f"{key}: max abs difference {np.max(np.abs(arrays[key].astype(np.float64) - value))}"
            )


def test_the_job_leaves_no_process(failure_run):
    # Every wait of the job had its deadline (the fixture fails a job that passes it): a hang guard, not a timing.
    assert failure_run["left_behind"] == []


# -- in one process, on two logical CPUs -------------------------------------


class _Interrupt(Exception):
    pass


class _InterruptAt(keras.callbacks.Callback):
    """Raises after the `step`-th batch of the run (counted over epochs, from the first run's start)."""

    def __init__(self, step):
        super().__init__()
        self.step = step
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch * BATCHES + batch + 1 == self.step:
            raise _Interrupt()


def _fit(strategy, backup, interrupt_at=None, accumulation=None) -> dict | None:
    """tests/failure_worker.py's job on `strategy`, in this process; None if interrupted."""
    policy = keras.config.dtype_policy()
    kmp.set_precision("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        x, y = job.make_data()
        with strategy.scope():
            model = job.build_model(accumulation=accumulation)
        kmp.prepare(model)
        callbacks = [backup, kmp.callbacks.LossScaleMonitor()]
        if interrupt_at is not None:
            callbacks.append(_InterruptAt(interrupt_at))
        try:
            history = model.fit(job.make_dataset(x, y), epochs=failure_worker.EPOCHS, verbose=0, shuffle=False,
                                callbacks=callbacks)
        except _Interrupt:
            # The interrupted fit's distributed iterator, freed now while its tf.data thread
            # wakes often: freed later, by chance, it blocks up to a minute (tests/conftest.py).
            gc.collect()
            return None
    finally:
        keras.config.set_dtype_policy(policy)
    optimizer = model.optimizer
    return {
        "arrays": model.get_weights() + [v.numpy() for v in optimizer.variables],
        "loss": history.history["loss"],
        "steps": int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy()),
    }


@pytest.fixture(scope="module")
def in_process_reference(two_replicas, tmp_path_factory):
    return _fit(two_replicas, BackupAndRestore(tmp_path_factory.mktemp("reference") / "b", save_freq=5))


def test_several_interruptions_resume_bit_for_bit(two_replicas, in_process_reference, tmp_path):
    """Interrupted at 3 (no backup yet), 5 (at a backup), 12 (after a restart's
    backup, past an epoch end) and 17; each resume continues from the last backup."""
    directory = tmp_path / "backup"
    positions = []
    for step in (3, 5, 12, 17):
        assert _fit(two_replicas, BackupAndRestore(directory, save_freq=5), interrupt_at=step) is None
        found = read_backup(directory)
        positions.append(None if found is None else (found["epoch"], found["batch"], found["total"]))
    assert positions == [None, (0, 5, 5), (1, 4, 10), (2, 3, 15)]
    resumed = _fit(two_replicas, BackupAndRestore(directory, save_freq=5))
    assert resumed["steps"] == in_process_reference["steps"] == TOTAL_STEPS
    for ours, theirs in zip(resumed["arrays"], in_process_reference["arrays"], strict=True):
        assert ours.tobytes() == theirs.tobytes()
    assert resumed["loss"] == in_process_reference["loss"][-1:]  # this fit() ran the last epoch only
    assert not directory.exists()


@pytest.fixture(scope="module")
def accumulated_references(tmp_path_factory):
    """{strategy: the uninterrupted run with windows of 3}, computed when first asked for."""
    runs = {}

    def reference(strategy):
        if strategy not in runs:
            runs[strategy] = _fit(strategy, BackupAndRestore(tmp_path_factory.mktemp("reference") / "b", save_freq=5),
                                  accumulation=3)
        return runs[strategy]

    return reference


# Each backup position once: inside a window on one device and on two replicas, and at a window's end.
@pytest.mark.parametrize("distributed, interrupt_at, backup", [
    (False, 8, (0, 5, 5)), (True, 12, (1, 4, 10)), (True, 17, (2, 3, 15)),
])
def test_a_backup_inside_an_accumulation_window_resumes_it_bit_for_bit(two_replicas, accumulated_references, tmp_path,
                                                                       distributed, interrupt_at, backup):
    """Windows of 3 micro-batches, backups after batches 5, 10 and 15: the
    first two fall inside a window (2 and 1 micro-batches in; on two replicas
    each replica holds its own partial sums, which come back to it); the
    first batch of epochs 1 and 2 (steps 7, 13) overflows, and is skipped
    again when run after a restore."""
    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    reference = accumulated_references(strategy)
    directory = tmp_path / "backup"
    assert _fit(strategy, BackupAndRestore(directory, save_freq=5), interrupt_at=interrupt_at,
                accumulation=3) is None
    found = read_backup(directory)
    assert (found["epoch"], found["batch"], found["total"]) == backup
    resumed = _fit(strategy, BackupAndRestore(directory, save_freq=5), accumulation=3)
    assert resumed["steps"] == reference["steps"] == TOTAL_STEPS // 3
    for ours, theirs in zip(resumed["arrays"], reference["arrays"], strict=True):
        assert ours.tobytes() == theirs.tobytes()
    assert resumed["loss"] == reference["loss"][backup[0]:]  # the resumed epoch's metrics restored


def test_keras_backup_and_restore_resumes_at_the_wrong_step(two_replicas, in_process_reference, tmp_path):
    """Keras 3.15's callback restores the weights and optimizer state of the
    backup after step 5 but restarts that epoch at its first batch: steps 1-5
    are trained twice. When this fails, Keras may have fixed it: check whether
    kmp.callbacks.backup is still needed."""
    directory = tmp_path / "keras"
    assert _fit(two_replicas, keras.callbacks.BackupAndRestore(directory, save_freq=5), interrupt_at=9) is None
    assert json.loads((directory / "training_metadata.json").read_text()) == {"epoch": 0, "batch": 4}
    resumed = _fit(two_replicas, keras.callbacks.BackupAndRestore(directory, save_freq=5))
    assert resumed["steps"] == TOTAL_STEPS + LAST_BACKUP
    assert any(not np.array_equal(a, b) for a, b in zip(resumed["arrays"], in_process_reference["arrays"]))


# -- errors ------------------------------------------------------------------


def test_arguments_are_checked_together():
    with pytest.raises(kmp.ConfigError) as caught:
        BackupAndRestore("gs://bucket/backup", save_freq=0, delete_checkpoint="yes")
    message = str(caught.value)
    assert "3 problems" in message
    assert "save_freq: expected an integer >= 1. Received: save_freq=0" in message
    assert "backup_dir: expected a local or mounted directory" in message


class _InterruptAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise _Interrupt()


def _small_fit(units, directory, interrupt=False, **backup):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    callbacks = [BackupAndRestore(directory, save_freq=1, **backup)] + ([_InterruptAtBatch()] if interrupt else [])
    x = np.arange(24, dtype="float32").reshape(8, 3) / 24
    model.fit(x, x[:, :1], batch_size=2, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    return model


def test_a_backup_of_another_model_is_refused(tmp_path):
    with pytest.raises(_Interrupt):
        _small_fit(4, tmp_path / "b", interrupt=True)
    with pytest.raises(BackupError, match=r"expected the backup in .* Received: model variable .* \[3, 4\] float32 "
                                          r"where this model has .* \[3, 5\] float32\. Resume with the same model"):
        _small_fit(5, tmp_path / "b")


def test_a_temporary_file_left_by_a_killed_writer_is_ignored_and_removed(tmp_path):
    directory = tmp_path / "b"
    directory.mkdir()
    (directory / ".kmp-backup.tmp-12345").write_bytes(b"PK\x03\x04 torn")
    model = _small_fit(4, directory)
    assert model.optimizer.iterations.numpy() == 4  # started from scratch
    assert not directory.exists()  # the completed fit() removed the backup and the directory


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    directory = tmp_path / "b"
    with pytest.raises(_Interrupt):
        _small_fit(4, directory, interrupt=True, double_checkpoint=True)  # backups after steps 1 and 2
    assert sorted(os.listdir(directory)) == ["kmp-backup.npz", "kmp-backup.previous.npz"]
    (directory / "kmp-backup.npz").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="could not read the latest backup .* resuming from the previous one, "
                                         "after step 1"):
        model = _small_fit(4, directory, double_checkpoint=True)
    assert model.optimizer.iterations.numpy() == 4  # steps 2-4 ran after the restore of step 1
