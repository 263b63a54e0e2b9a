"""kmp.distribute.scatter and the shard check built on it: each replica gets its shard of the summed
flat gradient, and the few numbers every replica needs from the others' shards, on two real replicas.

The two-worker case (TensorFlow's all-to-all) runs in tests/multiworker_worker.py.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import kmp
from kmp.engine import engine
from kmp.config.settings import Communication
from kmp.distribute import scatter
from kmp.scaling.gradients import global_norm, norm_of_parts, norm_parts
from test_engine import _model

SHARD = 6


def _on_replicas(strategy, fn, values):
    """fn(this replica's value) inside strategy.run; each replica's result as numpy, in replica order."""

    @tf.function
    def step():
        def on_replica():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            return fn(tf.switch_case(rid, [lambda v=v: tf.constant(v) for v in values]))

        return strategy.run(on_replica)

    return [r.numpy() for r in strategy.experimental_local_results(step())]


def _flats(scale=1.0):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=2 * SHARD) * scale).astype("float32") for _ in range(2)]


def test_each_replica_gets_its_shard_of_the_sum_made_on_its_own_device(two_replicas):
    a, b = _flats()
    out = _on_replicas(two_replicas, lambda g: scatter.reduce_scatter_mean(g, SHARD, Communication(), None), [a, b])
    np.testing.assert_array_equal(out[0], (a + b)[:SHARD])  # float32: the same add as the all-reduce
    np.testing.assert_array_equal(out[1], (a + b)[SHARD:])

    @tf.function
    def devices():
        return two_replicas.run(lambda: scatter.reduce_scatter_mean(tf.ones(2 * SHARD), SHARD, Communication(),
                                                                    None).device)

    assert [d.numpy().decode() for d in two_replicas.experimental_local_results(devices())] == [
        "/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]


def test_the_collective_fallback_gives_the_same_shards(two_replicas, monkeypatch):
    a, b = _flats()
    reduce = lambda g: scatter.reduce_scatter_mean(g, SHARD, Communication(), None, count=4.0)  # noqa: E731
    in_memory = _on_replicas(two_replicas, reduce, [a, b])
    monkeypatch.setattr(scatter, "cpus_of_one_process", lambda strategy: False)  # all-reduce, then a slice
    for u, v in zip(in_memory, _on_replicas(two_replicas, reduce, [a, b]), strict=True):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_allclose(np.concatenate(in_memory), (a + b) / 4, rtol=1e-7)


@pytest.mark.parametrize("communication, loss_scale, scale, rtol", [
    (Communication(predivide_factor=8.0), None, 1.0, 1e-6),
    # 1e-8 underflows float16; sent times the loss scale it survives (as in the all-reduce).
    (Communication(dtype="float16"), 2.0**15, 1e-8, 2e-3),
    (Communication(dtype="bfloat16"), None, 1.0, 2e-2),
])
def test_the_communication_settings_of_the_all_reduce_apply(two_replicas, communication, loss_scale, scale, rtol):
    a, b = _flats(scale)
    out = _on_replicas(two_replicas, lambda g: scatter.reduce_scatter_mean(g, SHARD, communication, loss_scale),
                       [a, b])
    np.testing.assert_allclose(np.concatenate(out), a + b, rtol=rtol, atol=rtol * scale)


def test_rows_are_stacked_in_replica_order_on_every_replica(two_replicas):
    out = _on_replicas(two_replicas, scatter.gather_rows, [np.float32([1, 2, 3]), np.float32([4, 5, 6])])
    for rows in out:
        np.testing.assert_array_equal(rows, [[1, 2, 3], [4, 5, 6]])


def test_a_gradient_of_the_wrong_length_is_refused(two_replicas):
    with pytest.raises(ValueError, match=r"expects 2 x 6 elements. Received: 11"):
        _on_replicas(two_replicas, lambda g: scatter.reduce_scatter_mean(g, SHARD, Communication(), None),
                     [np.zeros(11, "float32")] * 2)


# --- The norm and the finite flags from shards ---


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(-2.0**83, 2.0**83, width=32), min_size=2, max_size=40),
       cut=st.integers(0, 40))
def test_the_norm_from_shards_is_the_global_norm(values, cut):
    """Squares above float32's range (|g| > 1.8e19) included: both rescale by the largest |g|."""
    g = np.float32(values)
    cut = min(cut, len(g))
    parts = [norm_parts(tf.constant(s)) for s in (g[:cut], g[cut:])]
    shards = norm_of_parts(tf.stack([p[0] for p in parts]), tf.stack([p[1] for p in parts])).numpy()
    whole = global_norm([tf.constant(g)]).numpy()
    assert np.isfinite(shards)
    np.testing.assert_allclose(shards, whole, rtol=1e-5, atol=1e-30)


def test_shards_whose_squares_add_up_past_float32_still_give_a_finite_norm():
    halves = [tf.constant([1.5e19], tf.float32), tf.constant([1.5e19], tf.float32)]  # each square 2.25e38
    parts = [norm_parts(h) for h in halves]
    assert all(float(p[0]) == 1.0 for p in parts)  # neither rescaled on its own
    norm = norm_of_parts(tf.stack([p[0] for p in parts]), tf.stack([p[1] for p in parts])).numpy()
    np.testing.assert_allclose(norm, global_norm([tf.concat(halves, 0)]).numpy(), rtol=1e-6)
    np.testing.assert_allclose(norm, 1.5e19 * np.sqrt(2), rtol=1e-6)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_shard_holding_inf_or_nan_makes_the_norm_not_finite(bad):
    good = tf.constant([1.0, 2e20], tf.float32)  # its squares overflow: rescaled
    parts = [norm_parts(good), norm_parts(tf.constant([3.0, bad], tf.float32))]
    assert not np.isfinite(norm_of_parts(tf.stack([p[0] for p in parts]), tf.stack([p[1] for p in parts])).numpy())


@pytest.fixture(scope="module")
def sharded_model(two_replicas):
    """A prepared model on two replicas, its flat buffers in two shards, after two steps of fit().

    Shared: the flag tests read only the buffers' layout; the step test takes its counts and weights
    before its own steps and checks what those steps changed.
    """
    model = kmp.prepare(_model(two_replicas, "adam"), flat_buffers=True)
    model.fit(*_data_of(16), batch_size=8, epochs=1, verbose=0)
    return model


# Its tests run on one xdist worker, so it is trained once.
SHARES_THE_MODEL = pytest.mark.xdist_group("scatter_sharded_model")


@SHARES_THE_MODEL
@pytest.mark.parametrize("jit_compile", [False, True])
def test_each_shards_flags_combine_to_the_whole_gradients(sharded_model, jit_compile):
    buffers = engine.engine_of(sharded_model).buffers
    assert buffers.layout.sharded and buffers.length == 2 * buffers.shard
    ends = np.cumsum(buffers.spans)
    # The last variable (buffer order) starts in the second shard, the first in the first.
    last = int(ends[-2])
    assert 0 < buffers.shard <= last
    # Made once: the gradients below have the same shapes, so each function traces (and compiles) once.
    flags = tf.function(buffers.segment_finite, jit_compile=jit_compile)
    shard_flags = [tf.function(lambda s, o=o: buffers.segment_finite(s, o), jit_compile=jit_compile)
                   for o in (0, buffers.shard)]
    for bad in ({last: np.inf}, {0: np.nan}, {0: np.nan, last: -np.inf}, {}):
        whole = np.ones(buffers.length, "float32")
        whole[list(bad)] = list(bad.values())
        expected = flags(tf.constant(whole)).numpy()
        shards = [f(tf.constant(whole[o:o + buffers.shard])).numpy()
                  for f, o in zip(shard_flags, (0, buffers.shard), strict=True)]
        np.testing.assert_array_equal(shards[0] & shards[1], expected)
        assert int((~expected).sum()) == len(bad)


@SHARES_THE_MODEL
def test_an_inf_in_the_second_shard_alone_skips_the_step_on_every_replica_and_names_its_variable(two_replicas,
                                                                                              sharded_model):
    """Only replica 1 checks the shard that holds the inf; replica 0 takes the same decision from the
    gathered rows, and the overflow names the variable (kmp.scaling.optimizer's _shard_check)."""
    buffers, optimizer = engine.engine_of(sharded_model).buffers, sharded_model.optimizer
    last = int(np.cumsum(buffers.spans)[-2])  # the first element of the last variable in the buffer
    assert last >= buffers.shard
    whole = np.full(buffers.length, 1e-3, "float32")
    whole[last] = np.inf
    local = two_replicas.experimental_local_results
    before = [w.numpy() for w in local(buffers.buffers["weights"])]
    skipped, scale = int(optimizer.skipped_steps.numpy()), float(optimizer.dynamic_scale.numpy())

    @tf.function
    def step(flat):
        two_replicas.run(lambda: optimizer.apply_flat(flat, buffers))

    step(tf.constant(whole))
    assert int(optimizer.skipped_steps.numpy()) == skipped + 1 and float(optimizer.dynamic_scale.numpy()) < scale
    assert int(optimizer.overflow_variable.numpy()) == buffers.order[-1]  # its place in the model's variables
    for a, b in zip(before, [w.numpy() for w in local(buffers.buffers["weights"])], strict=True):
        np.testing.assert_array_equal(a, b)
    whole[last] = 1e-3  # the same gradient, finite: every replica's shard moves
    step(tf.constant(whole))
    assert int(optimizer.skipped_steps.numpy()) == skipped + 1
    assert all(not np.array_equal(a, w.numpy()) for a, w in zip(before, local(buffers.buffers["weights"])))


def _data_of(rows):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 6)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")
