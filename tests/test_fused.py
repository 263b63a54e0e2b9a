"""kmp.engine.fused: parity with optimizer.apply, fallbacks, caching, replicas."""

import json
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmp.engine import fused
from kmp.engine.fused import fused_apply, fused_support

SHAPES = {"kernel": (4, 3), "bias": (3,), "embedding": (2, 2, 2)}


def _half_of_a_tenth():  # a callable learning rate
    return 0.05


def _exclude_bias(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


CASES = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.1, momentum=0.5, weight_decay=0.05),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipvalue=0.5),
    "sgd_callable_lr": lambda: keras.optimizers.SGD(_half_of_a_tenth, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.5),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
    "adam_schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 3, 0.5)),
    "adam_piecewise": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.PiecewiseConstantDecay([3, 6], [0.01, 0.005, 0.001])
    ),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adamw_exclude_bias": lambda: _exclude_bias(keras.optimizers.AdamW(0.01, weight_decay=0.1)),
    "adamw_cosine_warmup": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(0.0, 20, warmup_target=0.01, warmup_steps=5), weight_decay=0.1
    ),
}
# Bit for bit without FMA contraction (test_bit_for_bit_without_fma_contraction);
# the norm clippings sum in another order in XLA and agree to rounding only.
NORM_CLIPPING = {"adam_clipnorm", "adam_global_clipnorm"}


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=s).astype("float32"), name=n) for n, s in SHAPES.items()]


def _grads(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[tf.constant(rng.normal(size=s).astype("float32")) for s in SHAPES.values()] for _ in range(steps)]


def _trajectory(make, apply, in_function, steps=10):
    """Variables, optimizer variables and iterations after `steps` updates."""
    opt, variables = make(), _variables()
    step = lambda g: apply(opt, g, variables)
    if in_function:
        step = tf.function(step)
    for g in _grads(steps):
        step(g)
    return [v.numpy() for v in variables], [v.numpy() for v in opt.variables], int(opt.iterations.numpy())


def _keras_apply(opt, grads, variables):
    opt.apply(grads, variables)


def _assert_close(ours, theirs):
    for a, b in zip(ours, theirs):
        # One ulp per step from FMA contraction, relative to the tensor's scale.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))


def _check_parity(case, in_function):
    ours = _trajectory(CASES[case], fused_apply, in_function)
    theirs = _trajectory(CASES[case], _keras_apply, in_function)
    assert ours[2] == theirs[2] == 10
    assert len(ours[1]) == len(theirs[1])
    _assert_close(ours[0], theirs[0])
    _assert_close(ours[1], theirs[1])
    assert not any(np.array_equal(a, b) for a, b in zip(ours[0], _variables()))  # it trained


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_keras_apply_inside_tf_function(case):
    _check_parity(case, in_function=True)


@pytest.mark.parametrize("case", ["sgd_nesterov", "sgd_callable_lr", "adam_schedule", "adamw_exclude_bias"])
def test_matches_keras_apply_eagerly(case):
    _check_parity(case, in_function=False)


def test_inside_an_xla_compiled_step():
    """Keras's jit_compile=True train step: the update inlines into it."""
    opt, variables = keras.optimizers.AdamW(0.01), _variables()
    step = tf.function(lambda g: fused_apply(opt, g, variables), jit_compile=True)
    for g in _grads(3):
        step(g)
    theirs = _trajectory(lambda: keras.optimizers.AdamW(0.01), _keras_apply, in_function=False, steps=3)
    _assert_close([v.numpy() for v in variables], theirs[0])
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize("case", ["adam_global_clipnorm", "adamw_cosine_warmup", "sgd_callable_lr", "sgd_clipvalue"])
def test_several_groups_match_keras_apply(case, monkeypatch):
    """Models with more than GROUP_SIZE variables: one computation per group."""
    monkeypatch.setattr(fused, "GROUP_SIZE", 2)
    ours = _trajectory(CASES[case], fused_apply, in_function=True)
    theirs = _trajectory(CASES[case], _keras_apply, in_function=True)
    assert ours[2] == theirs[2] == 10
    _assert_close(ours[0], theirs[0])
    _assert_close(ours[1], theirs[1])


_BITWISE_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
import test_fused as t
from kmp.engine import fused
same = {{}}
# Keras's own trajectory does not depend on kmp's group size: computed once per case.
theirs = {{case: t._trajectory(make, t._keras_apply, in_function=False) for case, make in t.CASES.items()}}
for group_size in (fused.GROUP_SIZE, 2):
    fused.GROUP_SIZE = group_size
    for case in sorted(t.CASES):
        ours = t._trajectory(t.CASES[case], t.fused_apply, in_function=True)
        pairs = zip(ours[0] + ours[1], theirs[case][0] + theirs[case][1])
        same[f"{{case}}/{{group_size}}"] = all(np.array_equal(a, b) for a, b in pairs)
print(json.dumps(same))
"""


def test_bit_for_bit_without_fma_contraction():
    """The math is Keras's op for op: with FMA off, results are identical.

    XLA's CPU backend contracts a*b+c into one FMA (one rounding instead of
    two); limiting it to AVX (no FMA) in a fresh process removes the only
    difference, so any reordering of Keras's arithmetic would fail here.
    """
    # The suite's cheap-compile flags (tests/conftest.py) stay: they change no float arithmetic.
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_max_isa=AVX".strip(),
               TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    script = _BITWISE_SCRIPT.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    same = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {f"{case}/{size}": case not in NORM_CLIPPING for case in CASES for size in (fused.GROUP_SIZE, 2)}
    assert same == expected


def test_mixed_float16_model_keeps_float32_master_weights():
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")

    def train(apply):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        opt = keras.optimizers.AdamW(0.01)
        for _ in range(5):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.cast(model(x), "float32") ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            assert all(g.dtype == tf.float32 for g in grads)
            apply(opt, grads, model.trainable_variables)
        return model, opt

    (ours, ours_opt), (theirs, theirs_opt) = train(fused_apply), train(_keras_apply)
    assert all(v.dtype == "float32" for v in ours.trainable_variables)
    assert ours.layers[0].compute_dtype == "float16"
    _assert_close([v.numpy() for v in ours.trainable_variables], [v.numpy() for v in theirs.trainable_variables])
    _assert_close([v.numpy() for v in ours_opt.variables], [v.numpy() for v in theirs_opt.variables])


def test_iterations_advance_by_one_per_call():
    opt, variables = keras.optimizers.Adam(0.01), _variables()
    step = tf.function(lambda g: fused_apply(opt, g, variables))
    for i, g in enumerate(_grads(3)):
        fused_apply(opt, g, variables)
        assert int(opt.iterations.numpy()) == 2 * i + 1
        step(g)
        assert int(opt.iterations.numpy()) == 2 * i + 2


# --- What is not fused, and says why -----------------------------------------


class _MyAdam(keras.optimizers.Adam):
    pass


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: keras.optimizers.RMSprop(), "RMSprop has no fused update"),
        (lambda: _MyAdam(), "_MyAdam has no fused update"),
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "LossScaleOptimizer has no fused"),
        (lambda: keras.optimizers.Adam(amsgrad=True), "amsgrad=True"),
        (lambda: keras.optimizers.SGD(use_ema=True), "use_ema=True"),
        (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
        (lambda: keras.optimizers.SGD(loss_scale_factor=8.0), "loss_scale_factor=8.0"),
        (lambda: keras.optimizers.Adam(beta_1=tf.constant(0.9)), "beta_1 is a"),
    ],
)
def test_fallback_says_why_once_and_matches_apply(make, reason, caplog):
    assert reason in fused_support(make())
    caplog.set_level(logging.INFO, logger="kmp.engine.fused")
    ours = _trajectory(make, fused_apply, in_function=False, steps=4)
    theirs = _trajectory(make, _keras_apply, in_function=False, steps=4)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        np.testing.assert_array_equal(a, b)
    notes = [r.getMessage() for r in caplog.records if r.name == "kmp.engine.fused"]
    assert len(notes) == 1 and reason in notes[0] and "unfused" in notes[0]


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_supported(name):
    assert fused_support(getattr(keras.optimizers, name)()) is None


def test_sparse_gradients_fall_back(caplog):
    caplog.set_level(logging.INFO, logger="kmp.engine.fused")
    results = []
    for apply in (fused_apply, _keras_apply):
        table = keras.Variable(np.ones((4, 2), "float32"))
        opt = keras.optimizers.Adam(0.1)
        grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))
        apply(opt, [grad], [table])
        results.append(table.numpy())
    np.testing.assert_array_equal(*results)
    assert "sparse gradients" in caplog.text


def test_constrained_variable_falls_back(caplog):
    caplog.set_level(logging.INFO, logger="kmp.engine.fused")
    results = []
    for apply in (fused_apply, _keras_apply):
        v = keras.Variable(np.ones(3, "float32"), name="w")
        v.constraint = keras.constraints.NonNeg()
        opt = keras.optimizers.SGD(1.0)
        apply(opt, [tf.constant([0.5, 2.0, -1.0])], [v])
        results.append(v.numpy())
    np.testing.assert_array_equal(*results)
    np.testing.assert_array_equal(results[0], [0.5, 0.0, 2.0])
    assert "has a constraint" in caplog.text


def test_missing_gradient_leaves_its_variable_like_keras():
    results = []
    for apply in (fused_apply, _keras_apply):
        opt, variables = keras.optimizers.SGD(0.1, momentum=0.9), _variables()
        grads = _grads(1)[0]
        grads[1] = None
        with pytest.warns(UserWarning, match="Gradients do not exist"):
            apply(opt, grads, variables)
        results.append([v.numpy() for v in variables] + [int(opt.iterations.numpy())])
    _assert_close(results[0][:3], results[1][:3])
    np.testing.assert_array_equal(results[0][1], _variables()[1].numpy())
    assert results[0][3] == results[1][3] == 1


# --- Caching: traced once, rebuilt when a setting changes --------------------


def _tracing_counts(opt):
    return [f.experimental_get_tracing_count() for step in fused._STEPS[opt].values() for f in step.functions]


def test_traced_once_eagerly_and_inside_a_function():
    opt, variables = keras.optimizers.AdamW(0.01), _variables()
    outer = tf.function(lambda g: fused_apply(opt, g, variables))
    grads = _grads(6)
    for g in grads[:3]:
        fused_apply(opt, g, variables)
    for g in grads[3:]:
        outer(g)
    assert _tracing_counts(opt) == [1]
    assert outer.experimental_get_tracing_count() == 1
    opt.learning_rate = 0.001  # a variable: read inside, no retrace
    fused_apply(opt, grads[0], variables)
    assert _tracing_counts(opt) == [1]


def test_a_changed_setting_takes_effect():
    opt = keras.optimizers.SGD(1.0)
    v = keras.Variable(np.ones(2, "float32"))
    fused_apply(opt, [tf.constant([1.0, 1.0])], [v])
    opt.weight_decay = 0.5  # baked into the compiled step: needs a new one
    opt.clipvalue = 0.25
    fused_apply(opt, [tf.constant([1.0, 1.0])], [v])
    # 0 - 0 * 0.5 * 1 - clip(1) * 1
    np.testing.assert_array_equal(v.numpy(), [-0.25, -0.25])
    assert len(fused._STEPS[opt]) == 2


def test_steps_go_with_their_optimizer():
    import gc
    import weakref

    # Everything older is left out of the collections below: in a full run
    # the heap holds the whole suite's objects, and three full collections
    # took 53 s (the optimizer's own cycle is new, so it is still collected).
    gc.freeze()
    try:
        opt = keras.optimizers.SGD(0.1)
        fused_apply(opt, _grads(1)[0], _variables())
        assert opt in fused._STEPS
        count = len(fused._STEPS)
        gone = weakref.ref(opt)
        del opt
        gc.collect()
        assert gone() is None and len(fused._STEPS) == count - 1
    finally:
        gc.unfreeze()


# --- Replicas: two logical CPU devices ---------------------------------------


def _replica_run(strategy, make, steps, via_merge_call):
    with strategy.scope():
        variables = _variables()
        opt = make()
        opt.build(variables)

    def replica_fn(grads):
        if via_merge_call:  # the path kmp.LossScaleOptimizer takes under MirroredStrategy
            tf.distribute.get_replica_context().merge_call(
                lambda s: s.extended.call_for_each_replica(fused_apply, args=(opt, grads, variables))
            )
        else:
            fused_apply(opt, grads, variables)

    step = tf.function(lambda g: strategy.run(replica_fn, args=(g,)))
    for g in _grads(steps):
        step(g)  # the same (already all-reduced) gradients on every replica
    return opt, variables, step


@pytest.mark.parametrize(
    "via_merge_call, group_size", [(False, fused.GROUP_SIZE), (True, 2)], ids=["replica_context", "merge_call_groups"]
)
def test_each_replica_updates_its_own_copies(two_replicas, via_merge_call, group_size, monkeypatch):
    monkeypatch.setattr(fused, "GROUP_SIZE", group_size)
    opt, variables, step = _replica_run(two_replicas, CASES["adamw_exclude_bias"], 6, via_merge_call)
    assert step.experimental_get_tracing_count() == 1
    assert sorted(key[1][1] for key in fused._STEPS[opt]) == [0, 1]  # one compiled step per replica
    groups = len(range(0, len(variables), group_size))
    assert _tracing_counts(opt) == [1] * (2 * groups)
    local = lambda v: [x.numpy() for x in two_replicas.experimental_local_results(v.value)]
    for v in list(variables) + opt.variables:
        first, second = local(v)
        np.testing.assert_array_equal(first, second)
    single = _trajectory(CASES["adamw_exclude_bias"], fused_apply, in_function=True, steps=6)
    for got, want in zip([local(v)[0] for v in variables], single[0]):
        np.testing.assert_array_equal(got, want)
    keras_single = _trajectory(CASES["adamw_exclude_bias"], _keras_apply, in_function=True, steps=6)
    _assert_close([local(v)[1] for v in variables], keras_single[0])
    assert local(opt.iterations) == [6, 6]


def test_cross_replica_context_falls_back_to_keras(two_replicas, caplog):
    """Keras's apply cannot run there either: the error is Keras's own."""
    caplog.set_level(logging.INFO, logger="kmp.engine.fused")
    with two_replicas.scope():
        v = keras.Variable(np.ones(2, "float32"))
        opt = keras.optimizers.SGD(1.0)
        with pytest.raises(AttributeError, match="merge_call"):
            opt.apply([tf.constant([1.0, 2.0])], [v])
        with pytest.raises(AttributeError, match="merge_call"):
            fused_apply(opt, [tf.constant([1.0, 2.0])], [v])
    assert "unfused: called in cross-replica context" in caplog.text


# Each optimizer's fused update once, on one device and on two replicas (the per-replica steps under
# merge_call: test_each_replica_updates_its_own_copies runs them for AdamW's rule with and without groups).
@pytest.mark.parametrize("inner, distributed", [("sgd", False), ("adam", False), ("adamw", True)])
def test_fused_and_unfused_fit_agree_after_mixed_precision_steps(two_replicas, distributed, inner):
    """Lightning-style parity: the same fit() with kmp's fused update and with Keras's."""
    import kmp

    strategy = two_replicas if distributed else tf.distribute.get_strategy()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 2))).astype("float32")
    keras.config.set_dtype_policy("mixed_float16")
    results = []
    for use_fused in (True, False):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((8,))
            hidden = keras.layers.Dense(32, activation="gelu")(inputs)
            model = keras.Model(inputs, kmp.float32_output(keras.layers.Dense(2)(hidden)))
            make = keras.optimizers.get({"class_name": inner, "config": {"learning_rate": 0.01}})
            opt = kmp.LossScaleOptimizer(make, dynamic_growth_steps=4, log_overflows=False, fused=use_fused)
            model.compile(optimizer=opt, loss="mse")
        initial = model.get_weights()
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)  # 18 steps, the scale grows
        state = (float(opt.dynamic_scale.numpy()), int(opt.iterations.numpy()), int(opt.skipped_steps.numpy()))
        results.append((model.get_weights(), state))
    (fused_weights, fused_state), (keras_weights, keras_state) = results
    assert fused_state == keras_state and sum(fused_state[1:]) == 18  # same skips, same growth
    for a, b in zip(fused_weights, keras_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(fused_weights[0], initial[0], atol=1e-3)  # the parity is not vacuous
