"""Real models as users bring them, from tiny configs (no download): keras-hub task
models, keras.applications networks, a model with its own train_step, a GAN.

    case = CASES["gpt2"]
    model = case.build()          # in the current dtype policy and strategy scope
    x, y = case.data(rows=16)     # fixed random inputs of the model's own kinds

Dropout is off (0.0) in every config, so that replicas, which draw their own
masks, can be compared with one device. Each builder makes the same model for the same seed (`keras.utils.set_random_seed`
before it is called), so stock Keras and kmp can be compared step for step.
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import keras
import numpy as np

import parity

VOCAB, SEQ, IMAGE = 128, 16, (32, 32, 3)
STEPS, BATCH = 3, 8
# The user property each trained case records its path under, printed at the end of the run (tests/conftest.py).
PATH_TAKEN = "kmp path taken"


# The optimizers the cases train with: AdamW, but for the conv nets (see CASES).
def adamw(learning_rate=1e-3, **kwargs):
    return keras.optimizers.AdamW(learning_rate, weight_decay=0.01, **kwargs)


def sgd_momentum(learning_rate=1e-3, **kwargs):
    """MobileNetV3Small's optimizer, as ResNet's ImageNet training took. Stock Keras's XLA step compiles
    its update for its 142 trainable variables in about half AdamW's time. On two replicas, where the
    order of float32 sums is all that differs between kmp's step and stock's, it amplifies that: at
    1e-3 the trained weights lie 8% of the update apart after three steps, and 1e-2 amplifies more
    (the third loss 1.5% apart, against 0.4%)."""
    return keras.optimizers.SGD(learning_rate, momentum=0.9, **kwargs)


def sgd(learning_rate=1e-2, **kwargs):
    """ResNet50V2's and EfficientNetV2B0's: plain SGD's update compiles fastest (EfficientNetV2B0's
    reference: ~55 s of CPU, with momentum ~85 s, with AdamW ~110 s)."""
    return keras.optimizers.SGD(learning_rate, **kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: object  # () -> compiled-free keras.Model
    data: object   # (rows) -> (x, y)
    loss: object = "sparse_categorical_crossentropy"
    own_step: bool = False  # the model trains with its own train_step (compile takes its optimizers)
    batch_norm: bool = False  # BatchNormalization: each replica normalizes by its own rows' statistics
    # The float16 loss scale kmp and stock Keras both start from (None: their defaults, 2^15). From
    # 2^15 MobileNetV3Small's first step overflows, and ResNet50V2's every step; from 2^8 they train.
    initial_scale: float | None = None
    # Every step overflows float16 from the default scale, in stock Keras alike (the test asserts it):
    # the weights never change, as the update never runs (in kmp and in the reference).
    overflows: bool = False
    # After its steps, a `.keras` file of the model loads and takes one more step equal to the live
    # model's. False where that proves nothing the others do not: see CASES.
    reload: bool = True
    # The optimizer kmp wraps and stock Keras's reference takes (learning_rate, **kwargs) -> optimizer.
    optimizer: object = adamw
    # Stock Keras's reference on one device compiles its step with XLA (jit_compile=True); False: with
    # TensorFlow's kernels, as kmp's per-variable step on one device runs them (see CASES).
    reference_xla: bool = True
    # An embedding whose gradient is sparse (its lookup's, not tied to a dense use): where ids repeat, the
    # flat buffers and the 8-bit states add its rows before AdamW squares them, Keras squares each row (kmp
    # says so when preparing), and its trained weights differ from stock's by design.
    sparse_embedding: bool = False


def _tokens(rows, seed=0):
    return np.random.default_rng(seed).integers(1, VOCAB, (rows, SEQ + 1)).astype("int32")


def _causal_lm_data(rows):
    t = _tokens(rows)
    return {"token_ids": t[:, :-1], "padding_mask": np.ones((rows, SEQ), "int32")}, t[:, 1:]


def _images(rows, classes=10):
    rng = np.random.default_rng(1)
    return rng.random((rows,) + IMAGE).astype("float32"), rng.integers(0, classes, (rows,)).astype("int32")


def _latent(rows):
    return np.random.default_rng(5).normal(size=(rows, GAN.latent)).astype("float32")


def _hub():
    import keras_hub

    return keras_hub


# One block per transformer: a second brings only more variables of the same kinds, at a quarter more
# of the light models' CPU time.
def gpt2():
    hub = _hub()
    backbone = hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0)
    return hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def llama():
    hub = _hub()
    backbone = hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
                                        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64)
    return hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def mixtral():
    hub = _hub()
    backbone = hub.models.MixtralBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
                                          num_key_value_heads=1, hidden_dim=32, intermediate_dim=64,
                                          num_experts=4, top_k=2)
    return hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)


def bert():
    hub = _hub()
    backbone = hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0)
    return hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)


def _bert_data(rows):
    t = _tokens(rows)[:, :-1]
    x = {"token_ids": t, "segment_ids": np.zeros_like(t), "padding_mask": np.ones_like(t)}
    return x, np.random.default_rng(2).integers(0, 3, (rows,)).astype("int32")


def bart():
    hub = _hub()
    backbone = hub.models.BartBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0)
    return hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)


def _bart_data(rows):
    source, target = _tokens(rows, 3)[:, :-1], _tokens(rows, 4)
    ones = np.ones((rows, SEQ), "int32")
    x = {"encoder_token_ids": source, "encoder_padding_mask": ones,
         "decoder_token_ids": target[:, :-1], "decoder_padding_mask": ones}
    return x, target[:, 1:]


def vit():
    hub = _hub()
    backbone = hub.models.ViTBackbone(image_shape=IMAGE, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32,
                                      mlp_dim=64)
    return hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None)


def _application(name):
    def build():
        kwargs = {"include_preprocessing": False} if name != "ResNet50V2" else {}
        return getattr(keras.applications, name)(weights=None, input_shape=IMAGE, classes=10, **kwargs)

    build.__name__ = name
    return build


@keras.saving.register_keras_serializable("kmp_tests")
class OwnStep(keras.Model):
    """A keras-io-style model: its own train_step (a loss tracker, the optimizer applied by hand)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.Sequential([keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                                      keras.layers.Dense(10)])
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        return self.body(x, training=training)

    def train_step(self, data):
        import tensorflow as tf

        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            logits = keras.ops.cast(self(x, training=True), "float32")
            # A Loss divides by the replicas under a strategy, whose gradients are summed, as in Keras's own step.
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss * tf.distribute.get_strategy().num_replicas_in_sync)  # the loss itself
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


@keras.saving.register_keras_serializable("kmp_tests")
class GAN(keras.Model):
    """keras-io's DCGAN shape, tiny: a generator and a discriminator, each with its own optimizer.

    Its latent vectors come with the data, as `y` (keras-io's step draws them): stock Keras and kmp, on
    one device or several, then train on the same ones. A draw in the step differs between XLA's kernels
    and TensorFlow's, and each replica draws its own.
    """

    latent = 8

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((self.latent,)), keras.layers.Dense(8 * 8 * 4),
                                           keras.layers.Reshape((8, 8, 4)),
                                           keras.layers.Conv2DTranspose(3, 4, strides=4, padding="same")])
        self.discriminator = keras.Sequential([keras.Input(IMAGE), keras.layers.Conv2D(8, 4, strides=4),
                                               keras.layers.LeakyReLU(0.2), keras.layers.Flatten(),
                                               keras.layers.Dense(1)])
        self.d_tracker, self.g_tracker = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")
        # Both parts are built from their Inputs. An unbuilt model is built by fit() under a strategy
        # by calling it on the data (stock Keras alike), which here is images, not latent vectors.
        self.built = True

    def compile(self, d_optimizer, g_optimizer, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        # Their variables too (fit() builds `model.optimizer` only, and this model has none).
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)

    def call(self, z, training=False):
        return self.generator(z, training=training)

    def train_step(self, data):
        import tensorflow as tf

        real, z, _ = keras.utils.unpack_x_y_sample_weight(data)
        rows = tf.shape(real)[0]
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        with tf.GradientTape() as tape:
            fake = self.generator(z, training=True)
            scores = keras.ops.cast(self.discriminator(keras.ops.concatenate(
                [keras.ops.cast(fake, real.dtype), real]), training=True), "float32")
            labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))])
            d_loss = bce(labels, scores)
            scaled = self.d_optimizer.scale_loss(d_loss)
        grads = tape.gradient(scaled, self.discriminator.trainable_variables)
        self.d_optimizer.apply(grads, self.discriminator.trainable_variables)
        with tf.GradientTape() as tape:
            scores = keras.ops.cast(self.discriminator(self.generator(z, training=True), training=True), "float32")
            g_loss = bce(keras.ops.zeros((rows, 1)), scores)
            scaled = self.g_optimizer.scale_loss(g_loss)
        grads = tape.gradient(scaled, self.generator.trainable_variables)
        self.g_optimizer.apply(grads, self.generator.trainable_variables)
        # Under a strategy Keras's losses come divided by the replicas (their gradients are summed):
        # the logs show the loss itself, as Keras's own train_step does.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        self.d_tracker.update_state(d_loss * replicas)
        self.g_tracker.update_state(g_loss * replicas)
        return {"d_loss": self.d_tracker.result(), "g_loss": self.g_tracker.result()}

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]


def _lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# The transformers and the small models train with AdamW, the conv nets with SGD (sgd_momentum, sgd).
# A reload costs a compile of the loaded model's step: ResNet50V2 and EfficientNetV2B0 have none, at
# 40-45 s of CPU each (EfficientNetV2B0 overflows float16 at every step of its case, in stock Keras
# alike: it would compare one more skipped step); MobileNetV3Small's fp16 flat case reloads a conv net
# with BatchNormalization whose steps train. The GAN's compile() takes two optimizers of its own, which
# a `.keras` file does not restore. A model's own train_step runs on TensorFlow's kernels in kmp's step
# on one device, and ResNet50V2's per-variable case does: their references do too (reference_xla),
# so that the same float16 roundings give the same weights.
CASES = {c.name: c for c in [
    Case("gpt2", gpt2, _causal_lm_data, _lm_loss()),
    Case("bert", bert, _bert_data, _lm_loss(), sparse_embedding=True),
    Case("llama", llama, _causal_lm_data, _lm_loss(), sparse_embedding=True),
    Case("vit", vit, _images, _lm_loss()),
    Case("bart", bart, _bart_data, _lm_loss()),
    Case("mixtral", mixtral, _causal_lm_data, _lm_loss(), sparse_embedding=True),
    Case("resnet50v2", _application("ResNet50V2"), _images, batch_norm=True, initial_scale=2.0**8, reload=False,
         optimizer=sgd, reference_xla=False),
    Case("mobilenetv3small", _application("MobileNetV3Small"), _images, batch_norm=True, initial_scale=2.0**8,
         optimizer=sgd_momentum),
    Case("efficientnetv2b0", _application("EfficientNetV2B0"), _images, batch_norm=True, overflows=True,
         reload=False, optimizer=sgd),
    Case("own_step", OwnStep, _images, None, own_step=True, reference_xla=False),
    Case("gan", GAN, lambda rows: (_images(rows)[0], _latent(rows)), None, own_step=True, reload=False,
         reference_xla=False),
]}
# A case whose reload proves nothing the matrix's others do not: MobileNetV3Small on two replicas
# (a conv net with BatchNormalization reloads in its fp16 case, the flat engine on two replicas in
# float16 in BERT's), at ~30 s of CPU for its loaded model's compile on each replica.
NO_RELOAD = {("mobilenetv3small", "fp16 mirrored")}


# --- Training one case, stock Keras or kmp, step by step ---


class _StepLosses(keras.callbacks.Callback):
    """Each step's own loss: Keras logs the running mean since the epoch began."""

    kmp_reads_weights = False  # logs only: the flat engine need not copy the weights for it each batch

    def __init__(self, key):
        super().__init__()
        self.key, self.means = key, []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs[self.key]))

    def losses(self):
        return [(k + 1) * m - k * self.means[k - 1] if k else m for k, m in enumerate(self.means)]


def compile_case(case, model, make_optimizer, **compile_kwargs):
    """compile() as the case's model takes it, with `make_optimizer()` for each of its optimizers."""
    if case.name == "gan":
        model.compile(d_optimizer=make_optimizer(), g_optimizer=make_optimizer(), **compile_kwargs)
    elif case.own_step:
        model.compile(optimizer=make_optimizer(), **compile_kwargs)
    else:
        model.compile(optimizer=make_optimizer(), loss=case.loss, **compile_kwargs)


def skipped_steps(model) -> int:
    optimizers = [getattr(model, n) for n in ("d_optimizer", "g_optimizer") if hasattr(model, n)] or [model.optimizer]
    total = 0
    for opt in optimizers:
        if hasattr(opt, "skipped_steps"):
            total += int(opt.skipped_steps.numpy())
        elif isinstance(opt, keras.optimizers.LossScaleOptimizer):  # Keras's: a skipped step leaves iterations
            # `iterations` counts updates under gradient accumulation; `_iterations`, each step applied.
            total += int(model._test_steps_seen) - int(opt.inner_optimizer._iterations.numpy())
    return total


def fit_steps(case, model, steps, batch=BATCH):
    """fit() over `steps` batches of the case's data; each step's own loss."""
    x, y = case.data(batch * steps)
    recorder = _StepLosses("d_loss" if case.name == "gan" else "loss")
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    model._test_steps_seen = getattr(model, "_test_steps_seen", 0) + steps
    return recorder.losses()


# --- The matrix's axes, and one case measured: kmp, stock Keras, a reload ---


@dataclasses.dataclass(frozen=True)
class Axis:
    policy: str
    replicas: int = 1
    wrap: tuple = ()     # kmp.wrap's keyword arguments, as pairs
    rtol: float = 1e-2   # on each step's loss
    weights_rtol: float = 1e-2  # on the trained weights, of stock's update (tests/parity.py)


AXES = {
    "fp16": Axis("mixed_float16"),
    "fp32": Axis("float32"),
    "fp32 mirrored": Axis("float32", 2),
    "bf16 mirrored": Axis("mixed_bfloat16", 2, rtol=3e-2, weights_rtol=0.15),
    "fp16 mirrored": Axis("mixed_float16", 2),
    "accumulation 2 + clipping": Axis("mixed_float16", wrap=(("gradient_accumulation_steps", 2),
                                                            ("gradient_clipping", 1.0))),
    "zero 1": Axis("mixed_bfloat16", 2, wrap=(("zero_stage", 1),), rtol=3e-2, weights_rtol=0.15),
    "8-bit states": Axis("mixed_float16", wrap=(("states", "8bit"),), rtol=3e-2, weights_rtol=5e-2),
}

_REFERENCES = {}


def reference_key(case, axis) -> tuple:
    """What stock Keras's reference for the case depends on: cases with one key share it."""
    fp16 = axis.policy == "mixed_float16"  # bf16 and fp32: against float32
    return case.name, fp16, dict(axis.wrap).get("gradient_accumulation_steps"), case.batch_norm and axis.replicas > 1


def reference(case, axis, strategy):
    """Stock Keras: each step's loss, the skipped steps, and the trainable weights before and after the steps
    (cached per model and settings).

    On one device, with XLA unless the case says otherwise (Case.reference_xla), but for a model with
    BatchNormalization on several replicas: each replica normalizes by its own rows' statistics, which
    one device cannot match (MobileNetV3Small's first loss, before any update: 4% apart), so it runs
    under `strategy`, without XLA (Keras's XLA step fails under a strategy).
    """
    import tensorflow as tf

    args = dict(axis.wrap)
    key = reference_key(case, axis)
    fp16, replicated = key[1], key[3]
    if key not in _REFERENCES:
        extra = {}
        if "gradient_accumulation_steps" in args:
            extra = {"gradient_accumulation_steps": args["gradient_accumulation_steps"],
                     "global_clipnorm": args["gradient_clipping"]}

        def make():
            inner = case.optimizer(**extra)
            if not fp16:
                return inner
            scale = {"initial_scale": case.initial_scale} if case.initial_scale else {}
            return keras.optimizers.LossScaleOptimizer(inner, **scale)

        keras.config.set_dtype_policy("mixed_float16" if fp16 else "float32")
        keras.utils.set_random_seed(0)
        with (strategy if replicated else tf.distribute.get_strategy()).scope():
            model = case.build()
            compile_case(case, model, make, jit_compile=case.reference_xla and not replicated)
            if not model.built:  # a model with its own train_step, built by its first call: its initial weights
                model(case.data(1)[0])
            if not model.optimizer.built:
                # Built inside the first step, Keras's LossScaleOptimizer makes TensorFlow trace
                # the whole step twice (variables created on a first call): same values, one trace.
                model.optimizer.build(model.trainable_variables)
        initial = parity.trainable(model)
        losses = fit_steps(case, model, STEPS)
        _REFERENCES[key] = losses, skipped_steps(model), initial, parity.trainable(model)
    return _REFERENCES[key]


# What kmp.prepare is asked for on each path of the matrix.
PATHS = {"flat": {"flat_buffers": True}, "per-variable": {"flat_buffers": False},
         "flat without XLA": {"flat_buffers": True, "jit_compile": False}}


def kmp_model(case, axis, path, strategy):
    """The case's model built, compiled with kmp.wrap(AdamW) and prepared (PATHS[path]), as a user does."""
    import kmp

    keras.config.set_dtype_policy(axis.policy)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = case.build()
        compile_case(case, model, lambda: kmp_optimizer(case, axis))
    return kmp.prepare(model, **PATHS[path])


def kmp_optimizer(case, axis):
    """kmp.wrap(AdamW) with the axis's settings (and, in float16, the case's initial loss scale)."""
    import kmp

    args = dict(axis.wrap)
    if case.initial_scale and axis.policy == "mixed_float16":
        args["initial_scale"] = case.initial_scale
    return kmp.wrap(case.optimizer(), **args)


def measure(name, axis_name, path, strategy, directory) -> dict:
    """One case of the matrix: kmp's losses, path and skipped steps, stock Keras's, the trained weights
    against stock's (tests/parity.py: "moved", "apart"), and the reload.

    "reload" is None when a `.keras` file of the trained model loads and takes one more step
    equal to the live model's, else what differed.
    """
    from kmp.engine import replica_step

    case, axis = CASES[name], AXES[axis_name]
    if axis.replicas == 1:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
    model = kmp_model(case, axis, path, strategy)
    losses = fit_steps(case, model, STEPS)
    trained = parity.trainable(model)
    result = {"losses": losses, "path": replica_step.describe_path(model),
              "flat": replica_step.path_of(model)["taken"].startswith("flat buffers"),
              "skipped": skipped_steps(model)}
    result["reference"], result["reference_skipped"], initial, stock = reference(case, axis, strategy)
    result["moved"], result["apart"] = parity.update_gap(initial, stock, trained)
    result["reload"] = None
    if case.reload and (name, axis_name) not in NO_RELOAD:
        try:
            _reload_and_step(case, model, axis, path, strategy, directory)
        except AssertionError as e:
            result["reload"] = str(e)
    return result


def _reload_and_step(case, model, axis, path, strategy, directory):
    import kmp

    file = os.path.join(directory, "model.keras")
    model.save(file)
    with strategy.scope():
        loaded = keras.saving.load_model(file)
        if _is_hub_task(loaded):
            # keras-hub's tasks compile themselves with their defaults when built, and a
            # .keras file restores those, not the optimizer saved (stock Keras alike): the user
            # compiles again, and the state comes from a weights file (as ModelCheckpoint's).
            weights = os.path.join(directory, "model.weights.h5")
            model.save_weights(weights)
            compile_case(case, loaded, lambda: kmp_optimizer(case, axis))
            loaded.optimizer.build(loaded.trainable_variables)
            loaded.load_weights(weights)
    for live, again in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(again, live, err_msg="the loaded weights")
    kmp.prepare(loaded, **PATHS[path])
    # Dropout's seed states are not in a .keras file (Keras saves weights, not these): both
    # models draw the same masks only from the same state.
    for live, again in zip(*([v for v in m.variables if "seed_generator_state" in v.path] for m in (model, loaded))):
        again.assign(live.numpy())
    # One more step through fit(), as the training took: the live model reuses fit()'s traced step,
    # and train_on_batch would trace another program for it alone (the whole batch on each replica),
    # whose bfloat16 sums round in another order: ~4e-6 apart after one step (GPT-2, two replicas).
    for m in (model, loaded):
        fit_steps(case, m, 1)
    for live, again in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(again, live, rtol=1e-6, atol=1e-7, err_msg="after one more step")


def _is_hub_task(model) -> bool:
    import keras_hub

    return isinstance(model, keras_hub.models.Task)


def save_weights(file, **runs):
    """Lists of arrays in one .npz file, as load_weights reads them back: {name: [arrays]}."""
    np.savez(file, **{f"{name}/{k}": w for name, weights in runs.items() for k, w in enumerate(weights)})


def load_weights(file) -> dict:
    runs = {}
    with np.load(file) as data:
        for key in data.files:  # in the order saved
            runs.setdefault(key.split("/")[0], []).append(data[key])
    return runs


def measure_all(specs, strategy, directory, out) -> dict:
    """Each spec measured (or, with path None, only stock Keras's reference, its weights saved as "initial" and
    "trained"); a spec that raises records its traceback. `out` is rewritten after each, so a crash keeps what
    was measured."""
    import json

    results = {}
    for name, axis_name, path in specs:
        key = "|".join((name, axis_name, path or "reference"))
        try:
            if path is None:
                losses, skipped, initial, trained = reference(CASES[name], AXES[axis_name], strategy)
                weights = os.path.join(directory, f"{name}-{axis_name}.npz".replace(" ", "_"))
                save_weights(weights, initial=initial, trained=trained)
                results[key] = {"reference": losses, "reference_skipped": skipped, "weights": weights}
            else:
                results[key] = measure(name, axis_name, path, strategy, directory)
        except Exception:  # noqa: BLE001 - the test shows it
            results[key] = {"error": traceback.format_exc()}
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f)
    return results
