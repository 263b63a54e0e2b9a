"""MultiWorkerMirroredStrategy for real: two worker processes on 127.0.0.1.

Each worker (tests/multiworker_worker.py) has one CPU device, so the cluster
has two replicas. One launch serves every test here (its workers take ~80 s
alone on two cores, two to four times that while the rest of the suite shares
the cores). The workers are killed when one fails or the deadline passes, and
their collectives time out on their own, so a failure cannot hang the suite.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.cli.launch import LocalJob

# One xdist worker runs the module: its fixtures (two worker processes, references) are computed once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiworker")]

_ROOT = Path(__file__).resolve().parent.parent
_WORKER = Path(__file__).resolve().parent / "multiworker_worker.py"
# The run takes ~80 s alone on a 2-core Xeon VM, 165-370 s inside the suite there (the other
# tests share the cores): a slow CI host gets room.
_DEADLINE_S = 900


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("multiworker_worker", _WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker_module()


def _run_workers(directory: Path, window_dir: Path, one_device_dir: Path, count: int = 2) -> list[dict]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    # kmp launch's machinery; TensorFlow's own thread counts, as these tests were timed with.
    arguments = [window_dir, one_device_dir]
    job = LocalJob(lambda i: [sys.executable, _WORKER, directory / f"worker{i}.json", *arguments], count,
                   env=env, cwd=_ROOT, log_dir=directory, threads=False)
    with job:
        codes = job.wait(timeout=_DEADLINE_S)  # a peer of a dead worker would wait in its collectives
    if codes != [0] * count:
        tails = "\n".join(
            f"--- worker {i} (exit code {code}) ---\n" + (directory / f"worker{i}.log").read_text()[-3000:]
            for i, code in enumerate(codes)
        )
        pytest.fail(f"multi-worker run failed (or ran past its {_DEADLINE_S} s deadline):\n{tails}")
    return [json.loads((directory / f"worker{i}.json").read_text()) for i in range(count)]


@pytest.fixture(scope="module")
def mirrored_window(tmp_path_factory, two_replicas):
    """An accumulation window left open (2 of 3 micro-batches) on two replicas
    of this process, saved as `.weights.h5` and `tf.train.Checkpoint`; each
    replica's sums of the first kernel."""
    directory = tmp_path_factory.mktemp("window")
    policy = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        x, y = worker.make_data()
        with two_replicas.scope():
            model = worker.build_model(accumulation=worker.ACCUMULATION)
        model.fit(worker.make_dataset(x, y).take(2), epochs=1, verbose=0, shuffle=False)
        model.save_weights(str(directory / "m.weights.h5"))
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(directory / "ckpt"))
        sums = [c.numpy() for c in model.optimizer.accumulation.sums[0].value.values]
    finally:
        keras.config.set_dtype_policy(policy)
    assert int(model.optimizer.accumulation.micro_steps.numpy()) == 2
    assert not np.array_equal(sums[0], sums[1])
    return directory, sums


@pytest.fixture(scope="module")
def one_device_epoch(tmp_path_factory):
    """The first of train()'s two epochs on one device, saved as `.weights.h5` (the workers resume it at ZeRO
    stage 1); its optimizer variables."""
    directory = tmp_path_factory.mktemp("one-device")
    policy = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        model = kmp.prepare(worker.build_model())
        model.fit(worker.make_dataset(*worker.make_data()), epochs=1, verbose=0, shuffle=False)
        model.save_weights(str(directory / "epoch1.weights.h5"))
    finally:
        keras.config.set_dtype_policy(policy)
    return directory, [v.numpy() for v in model.optimizer.variables]


@pytest.fixture(scope="module")
def workers(tmp_path_factory, mirrored_window, one_device_epoch):
    return _run_workers(tmp_path_factory.mktemp("multiworker"), mirrored_window[0], one_device_epoch[0])


@pytest.fixture(scope="module")
def reference():
    """The same training in this process, on one device, with the same global batches."""
    policy = keras.config.dtype_policy()
    try:
        return worker.train(tf.distribute.get_strategy())
    finally:
        keras.config.set_dtype_policy(policy)


def test_auto_resolves_multi_worker_mirrored_from_tf_config(workers):
    assert [w["multi_worker_mirrored"] for w in workers] == [True, True]
    assert [w["replicas"] for w in workers] == [2, 2]
    assert [w["task"] for w in workers] == [0, 1]


def test_each_global_batch_is_split_between_the_workers_in_order(workers):
    half = worker.GLOBAL_BATCH // 2
    batches = worker.ROWS // worker.GLOBAL_BATCH
    expected = [
        [list(range(b * worker.GLOBAL_BATCH + i * half, b * worker.GLOBAL_BATCH + (i + 1) * half))
         for b in range(batches)]
        for i in range(2)
    ]
    assert [w["rows"] for w in workers] == expected


def test_stock_fit_still_fails_without_prepare(workers):
    """keras-team/keras#20585. When this fails, Keras may have fixed it: check
    whether kmp.distribute.prepare is still needed."""
    for w in workers:
        assert w["stock_fit_error"] is not None, "stock fit() ran under MultiWorkerMirroredStrategy"
        assert w["stock_fit_error"].startswith("ValueError: Attempt to convert a value (PerReplica:")


def test_fit_still_fails_with_only_the_symbolic_build_fixed(workers):
    """prepare's second replacement: Keras reduces scalar logs with axis=0 across workers."""
    for w in workers:
        assert w["symbolic_build_fix_only_error"] is not None, "Keras reduces multi-worker logs correctly now"
        assert w["symbolic_build_fix_only_error"].startswith(
            "ValueError: Invalid reduction dimension 0 for input with 0 dimensions"
        )


def test_workers_end_with_identical_weights_and_loss_scale_state(workers):
    first, second = workers
    assert first["optimizer"] == "LossScaleOptimizer"
    # prepare() compiled each worker's forward/backward pass with XLA.
    assert first["xla_per_replica"] == second["xla_per_replica"] == 1
    assert first["accumulated"]["xla_per_replica"] == 1
    assert first["flat_buffers"] and second["flat_buffers"] and first["accumulated"]["flat_buffers"]
    assert first["state"] == second["state"]
    assert first["loss"] == second["loss"]
    assert first["eval_loss"] == second["eval_loss"]
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loss_scale_state_follows_the_spec_and_matches_one_process(workers, reference):
    # 64 -O-> 32 -C-> -C-> 64 -C-> -C-> 128 -C-> | epoch 2: -O-> 64 -C-> -C-> 128 -C-> -C-> 256 -C->
    # (O: the batch with the spike row, seen by worker 1 only; C: clean)
    expected = {"scale": 256.0, "iterations": 10, "overflows": 2, "skipped_steps": 2,
                "good_steps": 5, "hysteresis_left": 1}
    assert reference["state"] == expected
    assert workers[0]["state"] == expected


def test_weights_and_losses_match_one_process(workers, reference):
    for ours, theirs in zip(workers[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(workers[0]["loss"], reference["loss"], rtol=1e-3)
    np.testing.assert_allclose(workers[0]["eval_loss"], reference["eval_loss"], rtol=1e-3)
    initial = worker.build_model().get_weights()  # the weights moved: the parity is not vacuous
    assert not np.allclose(initial[0], np.asarray(reference["weights"][0]), atol=1e-3)


@pytest.fixture(scope="module")
def accumulated_reference():
    policy = keras.config.dtype_policy()
    try:
        return worker.train(tf.distribute.get_strategy(), accumulation=worker.ACCUMULATION)
    finally:
        keras.config.set_dtype_policy(policy)


def test_accumulation_reduces_once_per_window_and_matches_one_process(workers, accumulated_reference):
    micro_steps = worker.EPOCHS * worker.ROWS // worker.GLOBAL_BATCH
    windows = micro_steps // worker.ACCUMULATION
    first, second = (w["accumulated"] for w in workers)
    assert first["all_reduces"] == second["all_reduces"] == windows
    assert first["state"] == second["state"] == accumulated_reference["state"]
    assert first["state"]["iterations"] + first["state"]["skipped_steps"] == windows
    for a, b, ref in zip(first["weights"], second["weights"], accumulated_reference["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-3, atol=1e-4)


def test_several_steps_per_execution_train_as_one_step_per_call(workers):
    for w in workers:
        four = w["four_steps_per_call"]
        assert four["state"] == w["state"] and four["xla_per_replica"] == 1 and four["flat_buffers"]
        np.testing.assert_allclose(four["loss"], w["loss"], rtol=1e-6)
        for a, b in zip(four["weights"], w["weights"]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_backup_and_restore_resumes_an_open_window_bit_for_bit(workers):
    """kmp.callbacks.BackupAndRestore gathers every worker's window sums: a job
    interrupted after step 8 (backup after step 5, 2 micro-batches into a
    window of 3, with the overflow of step 7 in the span redone), then after
    step 11 (backup after step 10, 1 micro-batch in), ends byte-identical to
    the uninterrupted job, on both workers."""
    batches = worker.ROWS // worker.GLOBAL_BATCH
    for w in workers:
        run = w["resume_mid_window"]
        assert run["micro_steps_at_interrupt"] == 8 % worker.ACCUMULATION
        assert run["restored"] == [{"epoch": 0, "batch": 5, "total": 5}, {"epoch": 1, "batch": 4, "total": 10}]
        assert run["steps"] == worker.EPOCHS * batches // worker.ACCUMULATION
        assert run["skipped_steps"] == 2  # the windows holding each epoch's first batch
        assert run["identical"], f"max abs difference {run['max_difference']}"
        assert run["digests"][0] == run["digests"][1]
    assert workers[0]["resume_mid_window"]["digests"] == workers[1]["resume_mid_window"]["digests"]


def test_a_save_inside_a_window_holds_every_workers_rows(workers):
    """Saved on every worker 2 micro-batches into a window, each worker's
    `.weights.h5` and `tf.train.Checkpoint` (the chief's and worker 1's
    temporary one) hold both replicas' rows of each accumulation variable;
    without kmp's gather, only the writing worker's row."""
    variables = 5  # the sums of 2 kernels and 2 biases, the weight sum
    for w in workers:
        run = w["resume_mid_window"]
        assert run["micro_steps_at_save"] == 5 % worker.ACCUMULATION
        assert run["rows_in_files"] == {"weights": [2] * variables, "checkpoint": [2] * variables}
        assert run["rows_in_control_files"] == {"weights": [1] * variables, "checkpoint": [1] * variables}


def test_at_a_window_boundary_the_chief_may_save_alone(workers):
    """A closed window is not gathered (its sums are zero everywhere): the
    chief's `save_weights` and `tf.train.Checkpoint` alone return, hold its
    own row, and both workers meet at the next collective."""
    variables = 5
    chief, other = (w["resume_mid_window"]["chief_alone_at_a_boundary"] for w in workers)
    assert chief["micro_steps"] == other["micro_steps"] == 0
    assert chief["weights"] == chief["checkpoint"] == [1] * variables
    assert chief["barrier"] == other["barrier"] == 2.0


@pytest.mark.parametrize("method", ["weights", "keras", "checkpoint"])
def test_a_save_inside_a_window_resumes_bit_for_bit_on_every_worker(workers, method):
    """Keras's ModelCheckpoint (`.weights.h5`, `.keras`) and `tf.train.Checkpoint`,
    called on every worker after step 5 (2 micro-batches into a window of 3,
    after step 1's overflow), loaded from the chief's file by a new model on
    each worker, which trains steps 6 to 12 (step 7 overflows): the job ends
    byte-identical to the uninterrupted one, on both workers."""
    batches = worker.ROWS // worker.GLOBAL_BATCH
    for w in workers:
        saved = w["resume_mid_window"]["saved"][method]
        assert saved["loaded_micro_steps"] == 2
        assert saved["own_sums_back"]  # each worker's replica took back its own row
        assert saved["steps"] == worker.EPOCHS * batches // worker.ACCUMULATION
        assert saved["skipped_steps"] == 2
        assert saved["identical"], f"max abs difference {saved['max_difference']}"
    assert workers[0]["resume_mid_window"]["saved"][method]["digests"] == \
        workers[1]["resume_mid_window"]["saved"][method]["digests"]


@pytest.mark.parametrize("method", ["weights", "keras", "checkpoint"])
def test_without_the_gather_worker_1_loses_its_sums_and_the_job_ends_elsewhere(workers, method):
    """The control: the same saves with kmp's gather switched off (each worker
    writes its own rows, as kmp did before). Loaded on two workers, replica 0
    takes the chief's row and replica 1 zeros, so worker 1's partial sums are
    lost; trained on (`.weights.h5`), the job ends elsewhere: the test above
    can fail."""
    first, second = (w["resume_mid_window"]["saved"]["control-" + method] for w in workers)
    assert first["loaded_micro_steps"] == second["loaded_micro_steps"] == 2
    assert first["own_sums_back"] and not first["zero_sums_back"]
    assert not second["own_sums_back"] and second["zero_sums_back"]
    if method == "weights":
        assert not first["identical"] and not second["identical"]
        assert first["max_difference"] > 0


@pytest.mark.parametrize("method", ["weights", "checkpoint"])
def test_a_window_saved_by_two_replicas_of_one_process_loads_into_two_workers(workers, mirrored_window, method):
    """Each worker's replica takes the row of the replica with its index among
    all replicas (not its local position, 0 on both workers, which would give
    both of them replica 0's sums)."""
    _, sums = mirrored_window
    assert sorted(w["loaded_window"][method]["replica_ids"][0] for w in workers) == [0, 1]
    for w in workers:
        loaded = w["loaded_window"][method]
        (replica,) = loaded["replica_ids"]
        assert loaded["micro_steps"] == 2
        np.testing.assert_array_equal(np.asarray(loaded["sums"][0][0], np.float32), sums[replica])


def test_every_worker_names_the_layer_whose_output_overflowed_on_one_workers_share(workers):
    """Only worker 1's rows overflow layer 'hot'; the diagnoses are gathered,
    so worker 0 (which prints the overflow line) names it too, and with the default
    forward_overflow="raise" both workers stop at that first step, naming it."""
    for w in workers:
        found = w["forward_overflow"]
        assert found["overflows"] == [1.0]
        assert found["named"] == ["hot"] and found["logged"] == "hot", (w["task"], found)
        assert found["raised"] == ["hot", 1], (w["task"], found)


def test_an_overflow_on_one_workers_share_is_replayed_on_both_as_on_one_device(workers):
    """overflow="replay": the spike in worker 1's share of the first batch overflows; both workers recompute
    that batch at the same lowered scales and apply it once, as one device does with the same global batches."""
    policy = keras.config.dtype_policy()
    try:
        one_device = worker.train(tf.distribute.get_strategy(), overflow="replay")
    finally:
        keras.config.set_dtype_policy(policy)
    steps = worker.EPOCHS * worker.ROWS // worker.GLOBAL_BATCH
    assert one_device["state"]["replayed_steps"] >= 1 and one_device["state"]["iterations"] == steps
    for w in workers:
        assert w["replayed"]["flat_buffers"] == w["flat_buffers"]  # the path "skip" takes, not a fallback
        assert w["replayed"]["state"] == one_device["state"], (w["task"], w["replayed"]["state"])
        for ours, theirs in zip(w["replayed"]["weights"], one_device["weights"]):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-3, atol=1e-4)


def test_a_step_stuck_at_the_floor_stops_fit_on_every_worker_and_the_job_goes_on(workers):
    # Worker 1's share of the first batch is not finite and the scale starts at the floor: both workers raise
    # kmp.LossScaleError at that step, the weights unchanged; the phases after it (ZeRO, resume) still run.
    for result in workers:
        floor = result["stuck_at_the_floor"]
        assert floor["error"] and floor["error"].startswith("kmp: gradients overflowed"), floor
        assert floor["skipped"] == 1 and floor["iterations"] == 0 and floor["unchanged"], floor


def test_wall_clock_breakdown_prints_on_the_chief_and_logs_on_every_worker(workers):
    """kmp.engine.wall_clock's stamps travel through the logs' reduction across workers (float64, replica axis)."""
    chief, other = (w["wall_clock_breakdown"] for w in workers)
    assert [line.split(" time")[0] for line in chief["lines"]] == ["kmp: steps 1-3", "kmp: steps 4-6"]
    assert other["lines"] == []  # printed on the chief only, as DeepSpeed prints on rank 0
    assert chief["keys"] == other["keys"] == sorted(f"wall_clock/{p}_ms" for p in (
        "data_wait", "fwd_bwd", "allreduce", "loss_scale", "step", "other", "total"))
    assert chief["total_ms"] > 0 and other["total_ms"] > 0


# --- ZeRO stage 1 across the workers (kmp.engine.zero) ---


def test_zero_stage_1_across_workers_trains_as_stage_0(workers):
    """Each worker updates its replica's half of the state and the weights are all-gathered: the same
    loss-scale trajectory, losses and weights as the stage-0 run of the same workers."""
    for w in workers:
        sharded = w["zero_stage1"]["trained"]
        assert sharded["sharded"] and not w["sharded"] and sharded["flat_buffers"]
        assert sharded["state"] == w["state"]
        assert sharded["loss"] == w["loss"] and sharded["eval_loss"] == w["eval_loss"]
        for a, b in zip(sharded["weights"], w["weights"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_gradient_is_reduce_scattered_by_tensorflows_all_to_all(workers):
    """Each worker receives the sum of its shard only (half the bytes of an all-reduce): one
    CollectiveAllToAllV2 per bucket and no CollectiveReduceV2; the shared numbers by an all-gather
    (TensorFlow's all_gather gathers the shapes first: two CollectiveGatherV2)."""
    shard = worker.SCATTER_SHARD
    flat = np.arange(2 * shard, dtype=np.float32)
    whole = (flat * 1.0 + 0.5 + flat * 2.0 + 0.5) / 2.0  # both replicas' flat gradients summed, over count=2
    for task, w in enumerate(workers):
        results = w["zero_stage1"]["scatter"]
        for name, buckets in (("one collective", 1), ("bytes_per_pack 16", 3), ("float16", 1)):
            got = results[name]
            # 16 bytes per collective: 2 columns of the [2 x 5] float32 rows, so 3 all-to-alls.
            assert got["collectives"] == ["CollectiveAllToAllV2"] * buckets + ["CollectiveGatherV2"] * 2, name
            np.testing.assert_allclose(got["shard"], whole[task * shard:(task + 1) * shard], rtol=1e-3)
            assert got["rows"] == [[0.0, 0.0], [1.0, 10.0]], name


def test_each_worker_device_holds_half_the_flat_state_and_keras_copy_once(workers):
    # 577 parameters, Adam: the flat buffers hold 592 (whole units of 16, kmp.engine.buffers), a shard 304
    # elements of each moment (two units of 16 rounded up).
    for task, w in enumerate(workers):
        held = w["zero_stage1"]["saved"]["bytes"]
        assert held["shard_elements"] == [304, 304]
        assert held["shards"] == 8 * 304 and held["keras_copy_on_host"] == 8 * 577
        # One CPU per worker: the replica's device is the host, which holds Keras's copy (as CPU:0 does
        # under MirroredStrategy in tests/test_zero.py).
        assert held["host"] == held["replica_device"] == f"/job:worker/replica:0/task:{task}/device:CPU:0"


def test_the_chief_alone_reads_its_weights_mid_epoch_with_no_collective(workers):
    """get_weights() on one worker stores the weights only: a gather of the state there would have waited
    for worker 1 until the collective timeout and failed the run."""
    assert workers[0]["zero_stage1"]["saved"]["chief_read_mid_epoch"]


def _loaded(path):
    policy = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        return keras.models.load_model(path)
    finally:
        keras.config.set_dtype_policy(policy)


def test_a_stage_1_save_on_two_workers_holds_the_whole_state_and_resumes_on_one_device(
        workers, one_device_epoch, reference):
    directory = Path(workers[0]["zero_stage1"]["directory"])
    chief, other = _loaded(directory / "zero1.keras"), _loaded(directory / "workertemp_1" / "zero1.keras")
    ours = [v.numpy() for v in chief.optimizer.variables]
    # Every worker's file holds every replica's shard, as each worker's variables did when saved.
    for a, b, saved in zip(ours, [v.numpy() for v in other.optimizer.variables],
                           workers[0]["zero_stage1"]["saved"]["optimizer"], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, np.asarray(saved, a.dtype))
    # ... and the same state as one epoch on one device, moments of both halves included, to float16's
    # rounding (the gradient summed over two replicas here): within 1e-3 of each variable's largest entry.
    moments = [v for v in chief.optimizer.inner_optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(moments) == 8 and all(np.any(v.numpy()) for v in moments)
    for a, b in zip(ours, one_device_epoch[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * float(np.max(np.abs(b), initial=0)))
    policy = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        history = kmp.prepare(chief).fit(worker.make_dataset(*worker.make_data()), epochs=1, verbose=0,
                                         shuffle=False)
    finally:
        keras.config.set_dtype_policy(policy)
    assert float(chief.optimizer.dynamic_scale.numpy()) == reference["state"]["scale"]
    assert int(chief.optimizer.iterations.numpy()) == reference["state"]["iterations"]
    np.testing.assert_allclose(history.history["loss"], reference["loss"][1:], rtol=1e-3)
    for a, b in zip(chief.get_weights(), reference["weights"], strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-3, atol=1e-4)


def test_a_one_device_save_resumes_at_stage_1_on_two_workers(workers, reference):
    first, second = (w["zero_stage1"]["resumed"] for w in workers)
    assert first["sharded"] and first == second
    expected = reference["state"]
    assert first["state"] == {"dynamic_scale": expected["scale"], "iterations": expected["iterations"],
                              "overflows": expected["overflows"], "skipped_steps": expected["skipped_steps"]}
    np.testing.assert_allclose(first["loss"], reference["loss"][1:], rtol=1e-3)
    for a, b in zip(first["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)


def test_adam8bit_trains_across_workers_on_every_path(workers):
    """kmp.Adam8bit's uint8 states under MultiWorkerMirroredStrategy: made without TensorFlow's broadcast of
    their initial value (kmp.distribute.same_start), then trained as on one process: both workers end
    the same; the flat buffers as the per-variable path, and stage 1 as stage 0 (test_zero's tolerances)."""
    first, second = (w["zero_stage1"]["eight_bit"] for w in workers)
    assert first == second
    per_variable, flat, sharded = first["per variable"], first["flat"], first["flat stage 1"]
    # The tests' data forces overflows: every path skips the same steps.
    assert per_variable["skipped_steps"] == flat["skipped_steps"] == sharded["skipped_steps"] > 0
    assert (per_variable["engine"], flat["engine"], sharded["engine"]) == (None, "whole", "sharded")
    initial = worker.build_model().get_weights()
    for run in first.values():  # trained: finite, and the weights moved
        assert np.isfinite(run["loss"]).all()
        assert not np.allclose(initial[0], np.asarray(run["weights"][0]), atol=1e-3)
    codes = [np.asarray(v) for v in sharded["optimizer"] if np.asarray(v).dtype.kind == "i" and np.asarray(v).size > 8]
    assert codes and all(c.min() >= 0 and c.max() <= 255 for c in codes) and any(c.any() for c in codes)
    for a, b in zip(flat["weights"], per_variable["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for a, b in zip(sharded["weights"], flat["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(sharded["loss"], flat["loss"], rtol=1e-6)
    # Then per variable again: the codes mirrored over the workers again, without a broadcast of uint8.
    again = workers[0]["zero_stage1"]["eight_bit_per_variable_again"]
    assert again == workers[1]["zero_stage1"]["eight_bit_per_variable_again"]
    assert again["codes_mirrored"] and all(again["codes_mirrored"])
    assert np.isfinite(again["loss"]).all()
