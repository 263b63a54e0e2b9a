"""kmp.Adam8bit and kmp.AdamW8bit: Keras's Adam on block-wise 8-bit moments (kmp.scaling.eight_bit,
kmp.scaling.quantize)."""

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kmp
from kmp.engine import engine, replica_step
from kmp.scaling import quantize
from kmp.engine import zero
from kmp.scaling.eight_bit import Adam8bit, AdamW8bit, adam_update
from parity import assert_same_update, trainable


def _problem(seed=0, rows=64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 20)).astype("float32")
    return x, (x @ rng.normal(size=(20, 3)) + 0.1 * rng.normal(size=(rows, 3))).astype("float32")


def _model(optimizer, strategy=None):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else keras.name_scope("one"):
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(300, activation="relu", name="wide"),
                                  keras.layers.Dense(3, name="out")], name="net")
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _assert_within_precision(stored, exact, scales, signed):
    """stored (decoded) is one of the two codes around exact: within a code's step (1/8 of the value signed, 1/16
    unsigned) above its block's window, and within the smallest value times the scale under it."""
    k = 3 if signed else 4
    scale = np.repeat(np.asarray(scales, np.float64), 256)[:len(exact)]
    err = np.abs(np.asarray(stored, np.float64) - exact)
    bound = (np.abs(exact) * 2.0 ** -k + 2.0 ** -15 * 1.125 * scale) * (1 + 1e-5) + 1e-30
    assert np.all(err <= bound), np.max(err / bound)


def test_the_first_step_is_adams_and_its_moments_are_stored_within_the_formats_precision():
    x, y = _problem()
    plain, eight = _model(keras.optimizers.Adam(1e-2)), _model(Adam8bit(1e-2, min_8bit_size=0))
    for model in (plain, eight):
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    # From zero moments the step uses the exact new moments, as Keras's Adam does.
    for a, b in zip(plain.trainable_weights, eight.trainable_weights):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-7)
    inner, optimizer = plain.optimizer, eight.optimizer
    for variable in eight.trainable_variables:
        index = optimizer._get_variable_index(variable)
        exact_m, exact_v = (np.array(slots[inner._get_variable_index(plain.trainable_variables[index])]).ravel()
                            for slots in (inner._momentums, inner._velocities))
        m, v = (np.array(t).ravel() for t in optimizer.moments(variable))
        m_scales, r_scales = np.array(optimizer._moment_scales[index]), np.array(optimizer._velocity_scales[index])
        _assert_within_precision(m, exact_m, m_scales, True)
        _assert_within_precision(np.sqrt(v), np.sqrt(exact_v), r_scales, False)
        assert np.abs(m - exact_m).max() > 0  # quantized, not kept
        # The first scales are the bounds the gradient gives, here exactly each block's largest moment / TOP.
        for exact, scales, form in ((exact_m, m_scales, quantize.SIGNED), (np.sqrt(exact_v), r_scales,
                                                                           quantize.UNSIGNED)):
            largest = np.abs(np.pad(exact, (0, -len(exact) % 256))).reshape(-1, 256).max(axis=1)
            np.testing.assert_allclose(scales * form.top, largest, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(exponents=hnp.arrays(np.float64, (6, 3), elements=st.floats(-12, 12)),
       zero=hnp.arrays(np.bool_, (6, 3)), seed=st.integers(0, 2 ** 16))
def test_property_every_step_stores_the_exact_new_moments_to_the_formats_precision(exponents, zero, seed):
    """Six steps of adam_update on three blocks whose gradients jump by up to 24 decades from step to step (or are
    zero): the step is Keras's on the decoded moments, the stored moments are the exact new ones to the format's
    precision, the new scales bound them (no code saturates but by rounding), and a nonzero second moment never
    decodes to 0 (Adam divides by it)."""
    rng = np.random.default_rng(seed)
    n, b1, b2, eps, alpha = 700, 0.9, 0.999, 1e-7, 1e-3
    states = [tf.zeros([n], tf.uint8), tf.zeros([3]), tf.zeros([n], tf.uint8), tf.zeros([3])]
    for t in range(6):
        scale = np.where(zero[t], 0.0, 10.0 ** exponents[t])
        g = (rng.standard_normal(768) * np.repeat(scale, 256))[:n].astype(np.float32)
        m = quantize.decode(states[0], states[1], True).numpy().astype(np.float64)
        v = np.square(quantize.decode(states[2], states[3], False).numpy().astype(np.float64))
        step, states = adam_update(tf.constant(g), states, alpha, 1 - b1, 1 - b2, eps, 256, t + 1.0)
        m = m + (g - m) * (1 - b1)
        v = v + (np.square(g.astype(np.float64)) - v) * (1 - b2)
        # float32 arithmetic: near m = 0, (g - m) * (1 - beta_1) cancels; the step is in units of alpha.
        np.testing.assert_allclose(step.numpy(), alpha * m / (np.sqrt(v) + eps), rtol=1e-5, atol=1e-6 * alpha)
        new_m = quantize.decode(states[0], states[1], True).numpy()
        new_r = quantize.decode(states[2], states[3], False).numpy()
        _assert_within_precision(new_m, m, states[1].numpy(), True)
        _assert_within_precision(new_r, np.sqrt(v), states[3].numpy(), False)
        for exact, scales, form in ((np.abs(m), states[1], quantize.SIGNED), (np.sqrt(v), states[3],
                                                                              quantize.UNSIGNED)):
            assert np.all(exact <= np.repeat(scales.numpy(), 256)[:n] * form.top * (1 + 1e-5) + 1e-37)
        assert np.all((new_r > 0) | (v < 1e-70))


def _steps(gradients, states=None, stochastic=True):
    """adam_update over `gradients` (one flat array a step) from zero states: the decoded (m, v) after the last."""
    n = len(gradients[0])
    blocks = -(-n // 256)
    states = states or [tf.zeros([n], tf.uint8), tf.zeros([blocks]), tf.zeros([n], tf.uint8), tf.zeros([blocks])]
    for t, g in enumerate(gradients):
        _, states = adam_update(tf.constant(g, tf.float32), states, 1e-3, 0.1, 0.001, 1e-7, 256, t + 1.0, stochastic)
    m, r = quantize.decode(states[0], states[1], True).numpy(), quantize.decode(states[2], states[3], False).numpy()
    return m, np.square(r.astype(np.float64))


def test_a_second_moment_follows_adams_while_its_block_stays_busy():
    """Small noisy gradients beside one large one: each element's v moves by about 0.1% a step (beta_2 = 0.999).
    Rounded to nearest, a change that small comes back to the same code, and v stays where it was (sqrt(v) 1.19x
    Adam's after 1500 steps here, the median; 1.02x-1.36x from the 5th to the 95th percentile); rounded
    stochastically it follows Adam's float64 sqrt(v) on average."""
    rng = np.random.default_rng(0)
    steps = 1500
    g = (rng.standard_normal((steps, 256)) * 0.01).astype(np.float32)
    g[:, 0] = 1.0  # holds the block's scale up
    exact = np.zeros(256)
    for row in g.astype(np.float64):
        exact += (row ** 2 - exact) * 0.001
    ratios = {}
    for stochastic in (True, False):
        _, v = _steps(list(g), stochastic=stochastic)
        ratios[stochastic] = np.sqrt(v[1:] / exact[1:])  # what is stored, and what Adam divides by
    ratio = ratios[True]
    assert abs(np.median(ratio) - 1) < 0.05 and abs(ratio.mean() - 1) < 0.05, (np.median(ratio), ratio.mean())
    assert np.percentile(ratio, 5) > 0.75 and np.percentile(ratio, 95) < 1.25, np.percentile(ratio, [5, 95])
    assert np.median(ratios[False]) > 1.15  # what rounding to nearest does here


@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
def test_the_block_maxima_are_each_blocks_largest_magnitude_compiled_or_not(block_size):
    from kmp.scaling.eight_bit import _block_maxima

    rng = np.random.default_rng(block_size)
    n = 3 * block_size + 5
    g = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    g[block_size + 3] = -np.inf  # the padded last block's zeros and an infinity count as |x|
    padded = np.concatenate([g, np.zeros(-len(g) % block_size, np.float32)])
    expected = np.abs(padded).reshape(-1, block_size).max(axis=1)
    for function in (_block_maxima, tf.function(_block_maxima, jit_compile=True)):
        np.testing.assert_array_equal(function(tf.constant(g), block_size).numpy(), expected)


def test_stochastic_rounding_is_reproducible_and_the_same_for_every_block():
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(512).astype(np.float32) for _ in range(5)]
    first, second = _steps(g), _steps(g)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    # The noise is keyed by the place in the block: a variable that is the second block of another gets its codes.
    m, v = _steps([x[256:] for x in g])
    np.testing.assert_array_equal(m, first[0][256:])
    np.testing.assert_array_equal(v, first[1][256:])


@pytest.mark.parametrize("min_8bit_size", [4096, 0])
def test_the_states_are_a_byte_per_moment_and_a_scale_per_block(min_8bit_size):
    """Per quantized variable; the variables under min_8bit_size (bitsandbytes' default, 4096) keep Adam's float32
    moments: here the 300 x 3 output layer and both biases."""
    model = _model(kmp.wrap(AdamW8bit(1e-3, min_8bit_size=min_8bit_size)))
    model.fit(*_problem(), batch_size=32, epochs=1, verbose=0)
    inner = model.optimizer.inner_optimizer if hasattr(model.optimizer, "inner_optimizer") else model.optimizer
    sizes = [math.prod(v.shape) for v in model.trainable_variables]
    quantized, kept = [n for n in sizes if n >= min_8bit_size], [n for n in sizes if n < min_8bit_size]
    assert kept == ([300, 900, 3] if min_8bit_size else [])
    states = [v for v in inner.variables if v is not inner.iterations and v is not inner._learning_rate]
    assert sorted((v.dtype, math.prod(v.shape)) for v in states) == sorted(
        [("uint8", n) for n in quantized] * 2 + [("float32", -(-n // 256)) for n in quantized] * 2
        + [("float32", n) for n in kept] * 2)
    for variable in model.trainable_variables:
        m, v = inner.moments(variable)
        assert m.shape == v.shape == variable.shape and m.dtype == v.dtype == "float32"
    # And kmp's memory accounting counts exactly that.
    estimate = kmp.memory_estimate(model)
    assert estimate.states == "8bit" and estimate.optimizer == "adamw"
    assert next(iter(kmp.measured_bytes(model).values())) == estimate.in_variables()
    assert estimate.optimizer_state == 2 * (sum(quantized) + 4 * sum(-(-n // 256) for n in quantized) + 4 * sum(kept))


def test_a_traced_update_takes_few_ops_more_per_variable_than_adams():
    """Each quantize and dequantize is one op in the traced step (kmp.scaling.quantize traces each once), so the
    8-bit update of many variables traces about as fast as Adam's; made op by op, it would trace some fifty ops
    per call, four calls per variable (4.9x Adam's ops on keras-hub's tiny BERT)."""
    variables = [tf.Variable(tf.zeros(shape)) for shape in [(7, 5), (5,), (300,), (3, 3, 4)] * 5]
    grads = [tf.ones(v.shape) for v in variables]
    ops = {}
    for name, optimizer in (("32bit", keras.optimizers.AdamW(1e-3)), ("8bit", AdamW8bit(1e-3, min_8bit_size=0))):
        optimizer.build(variables)
        graph = tf.function(lambda g, o=optimizer: o.apply(g, variables)).get_concrete_function(grads).graph
        ops[name] = len(graph.get_operations())
    assert ops["8bit"] < 1.5 * ops["32bit"], ops


def test_compiled_the_update_writes_no_float_buffer_but_the_step():
    """Under XLA the 8-bit update reads the gradient and the codes and writes the step and the new codes: no
    float32 array of the elements in between (|g| for the block maxima, sqrt(v) shared by the step and its
    encoding), each a pass over memory that made the update 1.2-1.3x 32-bit Adam's (benchmarks/RESULTS.md)."""
    n = 64 * 256
    grad = tf.random.normal([n], seed=1)
    (m, m_scales), (r, r_scales) = quantize.quantize(grad * 0.1, True), quantize.quantize(tf.abs(grad), False)
    update = tf.function(lambda g, *states: adam_update(g, states, 1e-3, 0.1, 0.001, 1e-7, 256, 3.0),
                         jit_compile=True)
    hlo = update.experimental_get_compiler_ir(grad, m, m_scales, r, r_scales)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY"):]
    float_arrays = [line for line in entry.splitlines() if "fusion(" in line and (
        f"f32[{n}]" in line.split("=")[1] or f"f32[64,256]" in line.split("=")[1])]
    assert len(float_arrays) == 1, float_arrays  # the step


def test_compiled_with_a_kept_run_the_flat_update_steps_every_buffer_in_place():
    """With float32 states for the small variables (min_8bit_size), the flat update writes each buffer in place:
    the 8-bit rule steps the whole weights buffer and Adam's the kept run's own. One buffer for both, joined
    out of the two rules, made XLA on CPU copy the whole weights each step (benchmarks/RESULTS.md)."""
    x, y = _problem(rows=32)
    model = kmp.prepare(_model(kmp.LossScaleOptimizer(AdamW8bit(1e-3, weight_decay=0.01))), flat_buffers=True)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    buffers = engine.engine_of(model).buffers
    grad = tf.random.normal([buffers.length], seed=2)
    compiled = buffers._compiled_update().experimental_get_compiler_ir(grad, tf.constant(1e-3), None)
    hlo = compiled(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY"):]
    copies = [line for line in entry.splitlines() if " copy(" in line and f"f32[{buffers.size}]" in line]
    assert not copies, copies
    assert buffers.apart and buffers.kept == 3  # the two biases and the 900-element output kernel, below 4096


def test_it_learns_as_adam_does():
    x, y = _problem(rows=512)
    losses = {}
    for name, optimizer in (("32bit", keras.optimizers.AdamW(3e-3)), ("8bit", AdamW8bit(3e-3))):
        model = _model(optimizer)
        losses[name] = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0).history["loss"]
    assert losses["8bit"][-1] < 0.2 * losses["8bit"][0]
    np.testing.assert_allclose(losses["8bit"], losses["32bit"], rtol=0.05)


def test_wrap_makes_the_8bit_twin_of_adam_and_adamw():
    for given, expected in ((keras.optimizers.Adam(1e-3, beta_1=0.8), Adam8bit),
                            (keras.optimizers.AdamW(1e-3, weight_decay=0.1), AdamW8bit)):
        wrapped = kmp.wrap(given, states="8bit", precision="fp16")
        inner = wrapped.inner_optimizer
        assert type(inner) is expected
        assert {k: v for k, v in inner.get_config().items() if k not in ("name", "block_size", "min_8bit_size")} == {
            k: v for k, v in given.get_config().items() if k != "name"}
    assert type(kmp.wrap(keras.optimizers.AdamW(), states="8bit", precision="bf16")) is AdamW8bit


@pytest.mark.parametrize("optimizer, states, message", [
    (lambda: keras.optimizers.SGD(0.1), "8bit", "8-bit states are for Keras's Adam and AdamW"),
    (lambda: keras.optimizers.Adam(amsgrad=True), "8bit", "'32bit' with amsgrad=True"),
    (lambda: keras.optimizers.Adam(), "4bit", "states: expected one of '32bit', '8bit'. Received: states='4bit'"),
])
def test_wrap_refuses_what_it_cannot_make(optimizer, states, message):
    with pytest.raises(kmp.ConfigError, match=message):
        kmp.wrap(optimizer(), states=states)


def test_a_built_optimizer_is_not_converted():
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable(np.zeros(3, "float32"))])
    with pytest.raises(kmp.ConfigError, match="an optimizer not built yet"):
        kmp.wrap(optimizer, states="8bit")


@pytest.mark.parametrize("kwargs, message", [
    ({"amsgrad": True}, "amsgrad: expected False"), ({"block_size": 0}, "block_size: expected an integer >= 1"),
    ({"min_8bit_size": -1}, "min_8bit_size: expected an integer >= 0"),
    ({"min_8bit_size": 4096.0}, "min_8bit_size: expected an integer >= 0"),
])
def test_the_classes_check_their_arguments(kwargs, message):
    with pytest.raises(kmp.ConfigError, match=message):
        Adam8bit(**kwargs)


def test_a_keras_file_keeps_the_8bit_states_and_training_goes_on_the_same(tmp_path):
    x, y = _problem()
    model = _model(kmp.wrap(AdamW8bit(1e-3, block_size=128), precision="fp16"))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer.inner_optimizer) is AdamW8bit and loaded.optimizer.inner_optimizer.block_size == 128
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.variables + model.optimizer.variables, loaded.variables + loaded.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_under_mirrored_strategy_in_float16_every_replica_keeps_the_same_states(two_replicas):
    keras.config.set_dtype_policy("mixed_float16")
    with two_replicas.scope():
        # An input that overflows the forward pass: "backoff" skips it as any overflow (the default raises).
        optimizer = kmp.wrap(keras.optimizers.AdamW(1e-3), states="8bit", forward_overflow="backoff")
    model = kmp.prepare(_model(optimizer, two_replicas))
    x, y = _problem()
    x[5] = 1e5  # one overflowing batch: skipped, the states untouched
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.optimizer.skipped_steps.numpy() >= 1
    inner = model.optimizer.inner_optimizer
    for variable in inner.variables:
        # On these replicas of one process Keras's copy of the states is held once in host memory
        # (kmp.engine.zero); the step count is mirrored.
        first, *others = (np.array(c) for c in two_replicas.experimental_local_results(variable.value))
        assert len(others) == (0 if zero.on_host(variable) else 1), variable.path
        for other in others:
            np.testing.assert_array_equal(first, other)
        assert np.all(np.isfinite(first.astype("float32")))
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_whole_step_xla_on_one_device_trains_as_without_xla():
    runs = {}
    for jit_compile in (True, False):
        model = kmp.prepare(_model(kmp.wrap(Adam8bit(1e-3), precision="fp16")), jit_compile=jit_compile)
        initial = trainable(model)
        model.fit(*_problem(), batch_size=16, epochs=1, shuffle=False, verbose=0)
        runs[replica_step.describe_path(model)] = trainable(model)
    whole_step = runs.pop("flat buffers, whole-step XLA, overflow-layer finder")
    (without,) = runs.values()
    assert_same_update(initial, without, whole_step, rtol=1e-4)  # 1.4e-6 apart here


def _both_paths(policy, strategy, **settings):
    """((model, losses) per variable, (model, losses) on the flat buffers): AdamW8bit(**settings), 2 epochs, on
    `strategy` (None: one device) at ZeRO stage 1 where there are two replicas."""
    keras.config.set_dtype_policy(policy)
    replicas = strategy.num_replicas_in_sync if strategy else 1
    x, y = _problem(rows=128)
    runs = []
    for flat in (False, True):
        with strategy.scope() if strategy else keras.name_scope("one"):
            optimizer = kmp.LossScaleOptimizer(AdamW8bit(3e-3, weight_decay=0.01, **settings), zero_stage=replicas - 1)
        model = kmp.prepare(_model(optimizer, strategy), flat_buffers=flat)
        runs.append((model, model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]))
    return runs


@pytest.mark.parametrize("policy, replicas", [("float32", 1), ("mixed_float16", 2)])
def test_the_flat_buffers_keep_the_same_8bit_states_and_shard_them_at_stage_1(policy, replicas, two_replicas):
    strategy = two_replicas if replicas == 2 else None
    (plain, _), (flat, _) = _both_paths(policy, strategy, min_8bit_size=0)
    buffers = engine.engine_of(flat).buffers
    # Each variable padded to whole blocks of 256: 6000 + 300 + 900 + 3 -> 6144 + 512 + 1024 + 256.
    assert engine.engine_of(plain) is None and buffers.size == 7936 and buffers.layout.sharded == (replicas == 2)
    shard = {1: 7936, 2: 4096}[replicas]  # 31 blocks: 16 on each replica, the last one padded
    for name in ("momentum_codes", "velocity_codes", "momentum_scales", "velocity_scales"):
        components = strategy.experimental_local_results(buffers.buffers[name]) if strategy else [buffers.buffers[name]]
        expected = shard // 256 if "scales" in name else shard
        assert [c.shape.as_list() for c in components] == [[expected]] * replicas, name
        assert components[0].dtype == ("float32" if "scales" in name else "uint8")
    # The bytes each replica device holds of the 8-bit state, read from the variables there: a byte per element of
    # its shard for each moment and a float32 per block, 2 / N bytes per parameter and the scales (31 blocks: 16 each).
    held = {}
    for name in buffers.slot_names:
        for c in strategy.experimental_local_results(buffers.buffers[name]) if strategy else [buffers.buffers[name]]:
            device = tf.DeviceSpec.from_string(c.device).to_string()
            held[device] = held.get(device, 0) + c.numpy().nbytes
    devices = strategy.extended.worker_devices if strategy else list(held)
    assert sorted(held) == sorted(tf.DeviceSpec.from_string(d).to_string() for d in devices)
    assert list(held.values()) == [2 * shard + 2 * 4 * (shard // 256)] * replicas
    # The same blocks, so the same codes and scales; the update's float32
    # arithmetic in another fusion moves a weight by an ulp now and then.
    for a, b in zip(plain.optimizer.variables, flat.optimizer.variables):
        a, b = np.array(a), np.array(b)
        if a.dtype == np.uint8:
            assert np.abs(a.astype(int) - b).max(initial=0) <= 1 and np.mean(a != b) <= 0.01
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5)
    # A weight whose moment's code rounded the other way moves by a fraction of a step (3e-3) apart.
    for a, b in zip(plain.get_weights(), flat.get_weights()):
        apart = ~np.isclose(a, b, rtol=1e-5, atol=1e-7)
        assert np.mean(apart) <= 0.01 and np.abs(a - b).max(initial=0) <= 3e-4, (np.mean(apart), np.abs(a - b).max())
    # kmp.memory_estimate counts what each replica holds, byte for byte: the flat weights padded, codes and scales sharded.
    estimate = kmp.memory_estimate(flat)
    # (On the two logical CPUs, replicas of one process, the weights are in shards too.)
    assert estimate.flat_copies == 4 * shard + 2 * (shard + 4 * shard // 256)
    keras_copy = 2 * (6000 + 300 + 900 + 3 + 4 * 31)  # whole: per replica, or once in host memory at stage 1
    assert (estimate.optimizer_state, estimate.host) == ((0, keras_copy) if replicas == 2 else (keras_copy, 0))
    for device, allocated in kmp.measured_bytes(flat).items():
        # Replica 0's device is the host here.
        host = estimate.host if device == zero.host(flat.distribute_strategy) else 0
        assert allocated == dataclasses.replace(estimate.in_variables(), optimizer_state=allocated.optimizer_state)
        assert allocated.optimizer_state == estimate.optimizer_state + host, device


@pytest.mark.parametrize("policy, replicas", [("float32", 1), ("mixed_float16", 2)])
def test_the_flat_buffers_keep_float32_states_for_small_variables_in_a_run_of_their_own(policy, replicas,
                                                                                       two_replicas):
    """Under min_8bit_size (4096 by default) the output layer (900) and the biases keep Adam's float32 moments on
    the flat buffers too: they come first, unpadded, in two float32 buffers, and their weights in a third; the
    codes cover every element (the kept run's are scratch). Sharded, each replica's float32 buffers hold what
    its shard needs of the kept run."""
    strategy = two_replicas if replicas == 2 else None
    (plain, plain_loss), (flat, flat_loss) = _both_paths(policy, strategy)
    buffers = engine.engine_of(flat).buffers
    # 300 + 900 + 3 elements, padded once to 1280; then the kernel's 6000, padded to 24 blocks.
    assert [math.prod(v.shape) for v in buffers.variables] == [300, 900, 3, 6000] and buffers.size == 1280 + 6144
    # Sharded: 3840 elements each; the first replica's shard holds the float32 run (and 10 blocks of codes), the
    # second 15 blocks (the last one padding).
    kept, codes = (1280, 3840) if replicas == 2 else (1280, 7424)
    expected = {"kept_weights": kept, "momentum": kept, "velocity": kept, "momentum_codes": codes,
                "velocity_codes": codes, "momentum_scales": codes // 256, "velocity_scales": codes // 256}
    assert {n: b.shape[0] for n, b in buffers.buffers.items() if n != "weights"} == expected
    assert buffers.apart and buffers.mirrors["kept_weights"] == buffers.variables[:3]
    # The kept moments are Keras's float32 variables, stored from the buffers: Adam's, as on the per-variable path
    # (apart from what the 8-bit kernel's codes, an ulp apart between the paths, change in the loss).
    np.testing.assert_allclose(flat_loss, plain_loss, rtol=1e-4)
    for variable, twin in zip(flat.trainable_variables, plain.trainable_variables):
        # A weight whose moment's code rounded the other way moves apart by up to about a step (3e-3).
        a, b = np.array(variable), np.array(twin)
        apart = np.abs(a - b) > 1e-4
        assert np.mean(apart) <= 0.01 and np.abs(a - b).max() <= 3e-3, (np.mean(apart), np.abs(a - b).max())
        if math.prod(variable.shape) < 4096:
            flat_m, flat_v = (np.array(t) for t in flat.optimizer.inner_optimizer.moments(variable))
            plain_m, plain_v = (np.array(t) for t in plain.optimizer.inner_optimizer.moments(twin))
            for a, b in ((flat_m, plain_m), (flat_v, plain_v)):
                assert np.abs(a - b).max() <= 2e-3 * np.abs(b).max(), variable.path
    # What each replica device holds is what kmp.memory_estimate counts, byte for byte.
    estimate = kmp.memory_estimate(flat)
    shard = 3840 if replicas == 2 else 7424
    assert estimate.flat_copies == 4 * (shard + kept) + 2 * (4 * kept + codes + 4 * codes // 256)
    for device, allocated in kmp.measured_bytes(flat).items():
        host = estimate.host if device == zero.host(flat.distribute_strategy) else 0
        assert allocated == dataclasses.replace(estimate.in_variables(), optimizer_state=allocated.optimizer_state)
        assert allocated.optimizer_state == estimate.optimizer_state + host, device
