"""kmp.distribute: strategy resolution, the config key, prepare(), TPU seams.

Strategies other than the default and the session's `two_replicas` are never
built here (a second MirroredStrategy in one process collides with the
first); `_BUILDERS` is replaced by recorders to check what would be built.
MultiWorkerMirroredStrategy runs for real in tests/test_multiworker.py.
"""

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp import distribute
from kmp.engine import prepare as trainer
from kmp.engine import state
from kmp.distribute import strategy as strategy_module
from kmp.config.deepspeed import load_config
from kmp.errors import ConfigError
from kmp.precision import Precision

TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, "task": {"type": "worker", "index": 1}}
CHIEF_AND_WORKER = {"cluster": {"chief": ["a:1"], "worker": ["b:2"]}, "task": {"type": "chief", "index": 0}}
ONE_WORKER = {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}
NO_TPU = lambda: None  # noqa: E731


@pytest.fixture
def built(monkeypatch):
    """Replaces every strategy constructor with a recorder; returns the calls."""
    calls = []
    for name in strategy_module._BUILDERS:
        monkeypatch.setitem(strategy_module._BUILDERS, name, lambda _n=name, **kw: calls.append((_n, kw)) or _n)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    return calls


@pytest.fixture
def no_env(monkeypatch):
    for name in ("TF_CONFIG", "TPU_NAME", "COLAB_TPU_ADDR", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"tpu": lambda: "resolver", "tf_config": TWO_WORKERS, "gpus": ["g0", "g1"]}, "tpu"),
        ({"tpu": NO_TPU, "tf_config": TWO_WORKERS, "gpus": ["g0", "g1"]}, "multi_worker_mirrored"),
        ({"tpu": NO_TPU, "tf_config": CHIEF_AND_WORKER, "gpus": []}, "multi_worker_mirrored"),
        ({"tpu": NO_TPU, "tf_config": json.dumps(TWO_WORKERS), "gpus": []}, "multi_worker_mirrored"),
        ({"tpu": NO_TPU, "tf_config": ONE_WORKER, "gpus": ["g0", "g1"]}, "mirrored"),
        ({"tpu": NO_TPU, "tf_config": {}, "gpus": ["g0", "g1"]}, "mirrored"),
        ({"tpu": NO_TPU, "tf_config": ONE_WORKER, "gpus": ["g0"]}, "default"),
        ({"tpu": NO_TPU, "tf_config": "", "gpus": []}, "default"),
    ],
    ids=["tpu-first", "two-workers", "chief-counts", "json-string", "one-worker-two-gpus", "two-gpus",
         "one-gpu", "nothing"],
)
def test_auto_picks_by_tpu_then_cluster_then_gpus(built, kwargs, expected):
    assert distribute.resolve_strategy("auto", **kwargs) == expected
    assert [name for name, _ in built] == [expected]


def test_auto_is_the_default_choice(built):
    assert distribute.resolve_strategy(tpu=NO_TPU, gpus=["g0", "g1"]) == "mirrored"


def test_what_the_builders_receive(built):
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=7)
    distribute.resolve_strategy(tpu=NO_TPU, tf_config=TWO_WORKERS, communication_options=options)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
    distribute.resolve_strategy(tpu=resolver)
    (_, mwms), (_, tpu) = built
    assert mwms["cluster"] == TWO_WORKERS  # given in code: built from it, not from the environment
    assert mwms["communication_options"] is options
    assert tpu["resolver"] is resolver  # a resolver instance is used as it is, not called


def test_tf_config_from_the_environment(built, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(TWO_WORKERS))
    assert distribute.resolve_strategy(tpu=NO_TPU, gpus=[]) == "multi_worker_mirrored"
    assert built[0][1]["cluster"] is None  # TensorFlow reads TF_CONFIG itself


def test_tf_config_given_in_code_becomes_a_cluster_resolver():
    resolver = strategy_module._cluster_resolver(TWO_WORKERS)
    assert resolver.cluster_spec().as_dict() == TWO_WORKERS["cluster"]
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert strategy_module._cluster_resolver(None) is None


@pytest.mark.parametrize("name", ["mirrored", "multi_worker_mirrored", "default"])
def test_explicit_names_build_that_strategy(built, name):
    assert distribute.resolve_strategy(name, tpu=lambda: "resolver", gpus=[]) == name


def test_explicit_tpu_needs_a_tpu(built):
    assert distribute.resolve_strategy("tpu", tpu=lambda: "resolver") == "tpu"
    with pytest.raises(ConfigError, match=r"Received: strategy='tpu'\. No TPU was found: set TPU_NAME"):
        distribute.resolve_strategy("tpu", tpu=NO_TPU)


def test_default_is_the_real_default_strategy(no_env):
    assert distribute.resolve_strategy("default") is tf.distribute.get_strategy()
    # The real detection (no TPU, no TF_CONFIG, no GPU on this machine) builds it too.
    assert distribute.resolve_strategy() is tf.distribute.get_strategy()
    assert strategy_module._find_tpu() is None


def test_a_strategy_instance_wins(two_replicas):
    assert distribute.resolve_strategy(two_replicas, tf_config="not even json") is two_replicas


@pytest.mark.parametrize(
    "choice, message",
    [
        ("mirored", r"Received: strategy='mirored'\. Did you mean 'mirrored'\?"),
        ("MultiWorkerMirrored", r"expected one of 'auto', 'default', 'mirrored', 'multi_worker_mirrored', "
                                r"'tpu' or a tf.distribute.Strategy"),
        (2, r"Received: strategy=2\."),
    ],
)
def test_unknown_choices_are_config_errors(built, choice, message):
    with pytest.raises(ConfigError, match=message):
        distribute.resolve_strategy(choice)


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ("{'cluster': 1}", r"tf_config: expected JSON such as .* It does not parse"),
        ([1, 2], r"tf_config: expected a JSON object such as"),
        ({"task": {"type": "worker", "index": 0}}, r"tf_config.cluster: expected an object such as"),
        ({"cluster": {"worker": "a:1,b:2"}, "task": {"type": "worker", "index": 0}},
         r"tf_config.cluster.worker: expected a list of \"host:port\" strings\. Received: "
         r"tf_config.cluster.worker='a:1,b:2'"),
        ({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}},
         r"tf_config.task.index: expected an integer from 0 to 1 \(cluster.worker has 2 addresses\)"),
        ({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "chief", "index": 0}},
         r"tf_config.task.type: expected a job of the cluster \('worker'\)"),
        ({"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "worker", "index": 0}},
         r"tf_config.cluster.ps: expected no parameter servers .*ParameterServerStrategy yourself"),
        ({"cluster": {"workers": ["a:1"]}, "task": {"type": "workers", "index": 0}},
         r"Did you mean 'worker'\?"),
        ({"cluster": {"worker": ["a:1"]}}, r"tf_config.task: expected an object such as"),
    ],
)
def test_malformed_tf_config_is_one_clear_error(built, tf_config, message):
    with pytest.raises(ConfigError, match=message) as error:
        distribute.resolve_strategy(tf_config=tf_config, tpu=NO_TPU, gpus=[])
    assert "Invalid TF_CONFIG" in str(error.value)
    assert built == []


def test_malformed_tf_config_in_the_environment_names_the_variable(built, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 5}}')
    with pytest.raises(ConfigError, match=r"TF_CONFIG.task.index: expected an integer from 0 to 0"):
        distribute.resolve_strategy(tpu=NO_TPU, gpus=[])
    # Strategies that do not read the cluster do not trip over it.
    assert distribute.resolve_strategy("mirrored") == "mirrored"


# ---------------------------------------------------------------- config key


@pytest.mark.parametrize(
    "raw, expected",
    [({}, "auto"), ({"fp16": {"enabled": True}}, "auto"), ({"kmp": {}}, "auto"),
     ({"kmp": {"strategy": "multi_worker_mirrored"}}, "multi_worker_mirrored")],
)
def test_config_reads_the_kmp_block(raw, expected):
    assert load_config(raw).strategy == expected


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"kmp": {"strategy": "mirrorred"}}, r"kmp.strategy: expected one of 'auto', .*'tpu'\. "
                                             r"Received: kmp.strategy='mirrorred'\. Did you mean 'mirrored'\?"),
        ({"kmp": {"strategy": None}}, r"Received: kmp.strategy=None"),
        ({"kmp": "mirrored"}, r"kmp: expected"),
    ],
)
def test_bad_config_values_name_their_key(raw, message):
    with pytest.raises(ConfigError, match=message) as error:
        distribute.strategy_from_config(raw)
    assert "Invalid DeepSpeed config" in str(error.value)


def test_strategy_from_config_resolves_with_the_detection_given(built):
    assert distribute.strategy_from_config({"kmp": {"strategy": "auto"}}, tpu=NO_TPU, gpus=["a", "b"]) == "mirrored"


def test_strategy_from_config_default(no_env):
    assert distribute.strategy_from_config({"kmp": {"strategy": "default"}}) is tf.distribute.get_strategy()


# ---------------------------------------------------------------- prepare


def _model(seed=0, units=8):
    """A classifier: integer labels are where Keras's reduce and prepare's batch differ in dtype."""
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(units, activation="tanh", kernel_initializer=init)(inputs)
    outputs = kmp.float32_output(keras.layers.Dense(3, kernel_initializer=init)(hidden), "softmax")
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def test_a_model_built_on_one_device_and_trained_in_a_strategys_scope_is_refused_in_one_sentence(two_replicas):
    """Its variables are not on the strategy's replicas: stock Keras fails with an AssertionError, the prepared
    step deep in its graph. Evaluation there runs, as in stock Keras."""
    x, y = np.zeros((16, 4), "float32"), np.zeros((16,), "int32")
    model = kmp.prepare(_model())
    model.fit(x, y, batch_size=8, verbose=0)
    for train in (lambda: model.fit(x, y, batch_size=8, verbose=0), lambda: model.train_on_batch(x, y)):
        with two_replicas.scope(), pytest.raises(ValueError) as info:
            train()
        assert str(info.value) == (
            f"kmp: {model.name} was built outside any strategy's scope, and is trained inside a MirroredStrategy's "
            "scope, whose replicas its variables are not on: build and compile the model inside that `with "
            "strategy.scope():`, or train it outside the scope.")
    with two_replicas.scope():
        model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0)  # outside: as before


def test_prepare_changes_this_instance_only():
    stock = {name: getattr(keras.Model, name) for name in trainer._REPLACEMENTS}
    ours, other = _model(), _model()
    assert distribute.prepare(ours) is ours
    assert distribute.is_prepared(ours)
    assert not distribute.is_prepared(other)
    for name, method in stock.items():
        assert getattr(keras.Model, name) is method
        assert getattr(type(ours), name) is method
        assert name not in vars(other)
        assert getattr(ours, name).__func__ is trainer._REPLACEMENTS[name]
    assert not distribute.is_prepared(_model())  # models made later start stock too


def test_prepare_is_idempotent():
    model = _model()
    distribute.prepare(model)
    first = {name: vars(model)[name] for name in trainer._REPLACEMENTS}
    assert distribute.prepare(distribute.prepare(model)) is model
    assert {name: vars(model)[name] for name in trainer._REPLACEMENTS} == first


def test_kmp_keeps_one_attribute_on_the_model_which_keras_neither_saves_nor_clones(tmp_path):
    """docs/keras-changes.md: everything kmp keeps about a prepared model is in model.__dict__["_kmp"]."""
    import h5py

    keras.config.set_dtype_policy("mixed_float16")  # kmp's optimizer: the flat buffers and the layer finder
    model = _model()
    assert state.of(model) is None
    kmp.prepare(model, jit_compile=False, wall_clock_breakdown=False)
    x, y = np.random.default_rng(0).normal(size=(8, 4)).astype("float32"), np.arange(8) % 3
    model.fit(x, y, batch_size=4, verbose=0)
    kept = state.of(model)
    assert kept.prepared and kept.settings == (False, True, "auto", False, "auto")
    assert kept.engine is not None and kept.overflow_layer is not None and kept.path["taken"]  # the caches are in it
    assert [name for name in vars(model) if name.startswith("_kmp")] == ["_kmp"]
    expected = model.predict(x, verbose=0)

    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert state.of(loaded) is None and not distribute.is_prepared(loaded)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    with h5py.File(tmp_path / "m.weights.h5") as saved:
        names = []
        saved.visit(names.append)
    assert names and not [name for name in names if "_kmp" in name]

    clone = keras.models.clone_model(model)
    assert state.of(clone) is None and not distribute.is_prepared(clone)
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(clone.predict(x, verbose=0), expected)


@pytest.mark.parametrize("value", [keras.layers.Dense(2), "model", None])
def test_prepare_rejects_what_is_not_a_model(value):
    with pytest.raises(ConfigError, match=r"model: expected a keras.Model"):
        distribute.prepare(value)


def test_local_batch_has_the_shapes_and_dtypes_of_kerass_reduce(two_replicas):
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((8, 4), "float32"), np.arange(8, dtype="int32"))
    ).batch(8)
    batch = next(iter(two_replicas.experimental_distribute_dataset(data)))
    ours = distribute.local_batch(two_replicas, batch)
    keras_way = two_replicas.reduce("MEAN", batch, axis=None)
    assert [t.shape for t in ours] == [t.shape for t in keras_way] == [(4, 4), (4,)]
    # The MEAN turns integer labels into float64, which no step ever sees;
    # one replica's batch keeps the dtypes the train step gets.
    assert [t.dtype for t in ours] == [tf.float32, tf.int32]
    assert [t.dtype for t in keras_way] == [tf.float32, tf.float64]
    plain = (np.zeros((2, 4)), None)
    assert distribute.local_batch(two_replicas, plain) is plain


def test_prepared_fit_under_mirrored_strategy_equals_stock_fit(two_replicas, monkeypatch):
    """On one worker Keras's reduce works: the prepared model must train exactly as a stock one.

    Without XLA, so that only the first-batch build differs: XLA's float16
    arithmetic rounds differently on some CPUs (AVX512_FP16).
    """
    seen = []
    real_local_batch = distribute.local_batch
    monkeypatch.setattr(trainer, "local_batch", lambda s, b: seen.append(b) or real_local_batch(s, b))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 3, size=32).astype("int32")
    results = []
    keras.config.set_dtype_policy("mixed_float16")  # the autouse fixture restores it
    for prepare in (False, True):
        with two_replicas.scope():
            model = _model()
        if prepare:
            distribute.prepare(model, jit_compile=False)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        scores = model.evaluate(x, y, batch_size=8, verbose=0)
        results.append((model.get_weights(), history.history, scores, model.optimizer.iterations.numpy()))
    (w_stock, h_stock, l_stock, it_stock), (w_ours, h_ours, l_ours, it_ours) = results
    for a, b in zip(w_stock, w_ours):
        np.testing.assert_array_equal(a, b)
    assert (h_stock, l_stock, it_stock) == (h_ours, l_ours, it_ours) and it_ours == 8
    # The first fit() took one replica's batch to build the metrics; once all is built, evaluate()
    # and a later fit() draw none (each draw costs a new distributed iterator).
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(seen) == 1
    assert all(isinstance(leaf, tf.distribute.DistributedValues) for leaf in keras.tree.flatten(seen[0]))


@pytest.mark.parametrize("flat", [False, "auto"])
def test_kerass_loss_scale_optimizer_is_replaced_and_skips_an_inf_on_the_second_replica(two_replicas, caplog, flat):
    """compile() wraps the optimizer in Keras's LossScaleOptimizer under mixed_float16, which
    checks the first replica's gradients only: an inf on the second put nan into the weights."""
    keras.config.set_dtype_policy("mixed_float16")
    with two_replicas.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="net")
        model.compile(optimizer="adam", loss="mse")
    inner = model.optimizer.inner_optimizer
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    distribute.prepare(model, flat_buffers=flat)
    assert isinstance(model.optimizer, kmp.LossScaleOptimizer) and model.optimizer.inner_optimizer is inner
    assert "replaced net's keras.optimizers.LossScaleOptimizer" in caplog.text
    x = np.ones((2, 4), "float32")
    x[1, 0] = np.inf  # the second replica's row
    model.fit(x, np.ones((2, 1), "float32"), batch_size=2, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.skipped_steps.numpy()) == 1 and int(model.optimizer.iterations.numpy()) == 0
    assert (kmp.engine.engine.engine_of(model) is not None) == bool(flat)


def test_the_replacement_keeps_kerass_settings_and_is_saved(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0,
                                                                dynamic_growth_steps=3), loss="mse")
    distribute.prepare(model)
    config = model.optimizer.loss_scale_config
    assert (config.initial_scale, config.dynamic_growth_steps) == (8.0, 3)
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 1), "float32"), epochs=3, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == 16.0  # grown after 3 clean steps
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, kmp.LossScaleOptimizer)
    assert float(loaded.optimizer.dynamic_scale.numpy()) == 16.0
    distribute.prepare(model)  # kmp's already: kept
    assert model.optimizer.loss_scale_config is config


def test_steps_per_execution_fails_stock_and_works_prepared(two_replicas):
    """keras-team/keras#19246: under MirroredStrategy Keras 3.15 runs each step of an
    execution inside a tf.cond, and a step's all-reduce (a merge_call) fails there."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(36, 4)).astype("float32"), rng.integers(0, 3, size=36).astype("int32")

    def run(steps_per_execution, prepare, wrap=kmp.wrap):
        with two_replicas.scope():
            model = _model()
            model.compile(optimizer=wrap(keras.optimizers.Adam(0.01)), steps_per_execution=steps_per_execution,
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        if prepare:
            distribute.prepare(model, jit_compile=False)
        # 36 samples in batches of 8: 5 steps an epoch, the last one short;
        # three steps a call: executions of 3 and then 2 steps.
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        scores = model.evaluate(x, y, batch_size=8, verbose=0)
        return model, history.history, scores

    keras.config.set_dtype_policy("mixed_float16")  # the autouse fixture restores it
    with pytest.raises(tf.errors.InvalidArgumentError, match="You must feed a value for placeholder"):
        run(3, prepare=False, wrap=keras.optimizers.LossScaleOptimizer)
    one, h_one, s_one = run(1, prepare=True)
    three, h_three, s_three = run(3, prepare=True)
    assert int(three.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 10
    for a, b in zip(one.get_weights(), three.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert (h_one, s_one) == (h_three, s_three)
    np.testing.assert_array_equal(one.predict(x, batch_size=8, verbose=0), three.predict(x, batch_size=8, verbose=0))


def test_outputs_get_a_replica_axis_for_multi_worker_reduction():
    step = trainer._with_replica_axis(lambda data: {"loss": tf.constant(2.0), "f1": tf.ones(3), "n": None})
    out = step(None)
    assert out["loss"].shape == (1,) and out["f1"].shape == (1, 3) and out["n"] is None
    # MultiWorkerMirroredStrategy's reduce("MEAN", v, axis=0) over a [1, ...]
    # value per replica is the mean over replicas, with v's shape.
    per_replica = [out["f1"], 3 * out["f1"]]
    mean = tf.reduce_sum(tf.concat(per_replica, 0), 0) / 2
    np.testing.assert_array_equal(mean, [2.0, 2.0, 2.0])


# ---------------------------------------------------------------- TPU seams


class TPUStrategyFake:
    """Keras (and kmp) recognise a TPU strategy by its class name."""


class TPUStrategyFakeSubclass(TPUStrategyFake):
    pass


def test_tpu_strategies_are_recognised_as_keras_does(two_replicas):
    assert distribute.is_tpu_strategy(TPUStrategyFake())
    assert distribute.is_tpu_strategy(TPUStrategyFakeSubclass())
    assert distribute.is_tpu_strategy(tf.distribute.TPUStrategy.__new__(tf.distribute.TPUStrategy))
    assert not distribute.is_tpu_strategy(two_replicas)
    assert distribute.tpu_settings(two_replicas) is None
    assert distribute.tpu_settings(tf.distribute.get_strategy()) is None


def test_tpu_settings_without_a_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = distribute.tpu_settings(TPUStrategyFake())
    assert settings == distribute.TpuSettings(Precision("mixed_bfloat16"), 32, ())


def test_tpu_settings_list_padded_sizes_steps_and_float16():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(100, 3, name="conv")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, name="aligned")(keras.layers.Dense(128, name="wide")(x))
    head = keras.Sequential([keras.Input((128,)), keras.layers.Dense(10, name="logits")], name="head")
    tokens = keras.Input((5,), dtype="int32")
    e = keras.layers.Flatten()(keras.layers.Embedding(1000, 64, name="embed")(tokens))
    model = keras.Model([inputs, tokens], [head(x), e])
    model.compile(loss="mse")
    with pytest.warns(UserWarning, match="On TPU, this model runs slower than it could") as caught:
        settings = distribute.tpu_settings(TPUStrategyFake(), model)
    assert settings.precision == Precision("mixed_bfloat16") and settings.steps_per_execution == 32
    assert list(settings.advice) == [
        "conv (Conv2D): filters=100 is not a multiple of 128",
        "conv (Conv2D): input channels=3 is not a multiple of 128",
        "wide (Dense): input features=3600 is not a multiple of 128",
        "embed (Embedding): output_dim=64 is not a multiple of 128",
        "logits (Dense): units=10 is not a multiple of 128",
        "steps_per_execution=1: each step is a host -> TPU round trip. Compile with steps_per_execution=32.",
        "precision 'mixed_float16' on TPU: TPUs have no fast float16 math; their matrix units use bfloat16. "
        "Use 'mixed_bfloat16'.",
    ]
    assert len(caught) == 1 and "logits (Dense)" in str(caught[0].message)


def test_tpu_settings_are_quiet_for_a_model_that_fits_the_tpu():
    inputs = keras.Input((256,))
    model = keras.Model(inputs, keras.layers.Dense(128)(keras.layers.Dense(384)(inputs)))
    model.compile(loss="mse", steps_per_execution=32)
    keras.config.set_dtype_policy("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = distribute.tpu_settings(TPUStrategyFake(), model)
    assert settings.advice == ()
