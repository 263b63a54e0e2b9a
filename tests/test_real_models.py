"""Real models (tests/real_models.py: keras-hub task models, keras.applications
networks, a model with its own train_step, a GAN) trained under kmp.wrap +
kmp.prepare on the paths users take, against stock Keras.

Each case trains STEPS steps and must show: no crash; finite losses; each
step's loss within the axis's tolerance of stock Keras at the same precision
on one device (fp16: Keras's LossScaleOptimizer with jit_compile=True; bf16:
float32); the same skipped steps as stock, within one; a `.keras` file that
loads (kmp imported) and takes one more step equal to the live model's; and
the path kmp took, printed (`pytest -s` shows it).

The matrix is a selection: every model on fp16 one device, and each other
axis on models of different kinds, on the flat engine and the per-variable
path. Tolerances (rtol on each step's loss):
- fp16 against Keras's fp16: 1e-2. Both keep float32 masters and take the
  same loss scale; what differs is the order of float32 sums (the all-reduce,
  the fused update's FMA), about 1e-4 after a few steps.
- bf16 against float32: 3e-2. bfloat16 keeps 8 bits of mantissa: the
  activations' rounding alone moves a tiny model's loss by up to ~1%.
- 8-bit states against 32-bit Keras fp16: 3e-2. The moments are quantized
  (docs/eight-bit.md); the first steps move a little differently.
"""

import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
import real_models
from kmp.distribute import replica_step
from real_models import CASES

pytest.importorskip("keras_hub")
pytestmark = pytest.mark.slow

STEPS, BATCH = 3, 8


@dataclasses.dataclass(frozen=True)
class Axis:
    policy: str
    replicas: int = 1
    wrap: tuple = ()     # kmp.wrap's keyword arguments, as pairs
    rtol: float = 1e-2


AXES = {
    "fp16": Axis("mixed_float16"),
    "bf16 mirrored": Axis("mixed_bfloat16", 2, rtol=3e-2),
    "fp16 mirrored": Axis("mixed_float16", 2),
    "accumulation 2 + clipping": Axis("mixed_float16", wrap=(("gradient_accumulation_steps", 2),
                                                            ("gradient_clipping", 1.0))),
    "zero 1": Axis("mixed_bfloat16", 2, wrap=(("zero_stage", 1),), rtol=3e-2),
    "8-bit states": Axis("mixed_float16", wrap=(("states", "8bit"),), rtol=3e-2),
}

MATRIX = [
    *[(name, "fp16", "flat") for name in CASES],
    ("gpt2", "fp16", "per-variable"), ("resnet50v2", "fp16", "per-variable"), ("bart", "fp16", "per-variable"),
    ("gpt2", "bf16 mirrored", "flat"), ("vit", "bf16 mirrored", "flat"), ("mobilenetv3small", "bf16 mirrored", "flat"),
    ("llama", "bf16 mirrored", "per-variable"), ("efficientnetv2b0", "bf16 mirrored", "per-variable"),
    ("gan", "bf16 mirrored", "per-variable"),
    ("bert", "fp16 mirrored", "flat"), ("mixtral", "fp16 mirrored", "flat"),
    ("own_step", "fp16 mirrored", "per-variable"),
    ("gpt2", "accumulation 2 + clipping", "flat"), ("mobilenetv3small", "accumulation 2 + clipping", "per-variable"),
    ("llama", "zero 1", "flat"), ("vit", "zero 1", "flat"),
    ("gpt2", "8-bit states", "flat"), ("bert", "8-bit states", "per-variable"),
]

_REFERENCES = {}


def _wrap_args(axis):
    return dict(axis.wrap)


def _reference(case, axis):
    """Stock Keras on one device: each step's loss and the skipped steps (cached per model and settings)."""
    args = _wrap_args(axis)
    fp16 = axis.policy == "mixed_float16"
    key = (case.name, fp16, args.get("gradient_accumulation_steps"))
    if key not in _REFERENCES:
        keras.config.set_dtype_policy("mixed_float16" if fp16 else "float32")
        keras.utils.set_random_seed(0)
        model = case.build()
        extra = {}
        if "gradient_accumulation_steps" in args:
            extra = {"gradient_accumulation_steps": args["gradient_accumulation_steps"],
                     "global_clipnorm": args["gradient_clipping"]}

        def make():
            inner = real_models.adamw(**extra)
            return keras.optimizers.LossScaleOptimizer(inner) if fp16 else inner

        real_models.compile_case(case, model, make, jit_compile=True)
        losses = real_models.fit_steps(case, model, STEPS, BATCH)
        _REFERENCES[key] = losses, real_models.skipped_steps(model)
    return _REFERENCES[key]


def _kmp_model(case, axis, path, strategy):
    keras.config.set_dtype_policy(axis.policy)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = case.build()
        real_models.compile_case(case, model, lambda: kmp.wrap(real_models.adamw(), **_wrap_args(axis)))
    return kmp.prepare(model, flat_buffers=path == "flat")


@pytest.mark.parametrize("name, axis_name, path", MATRIX, ids=["-".join(c).replace(" ", "_") for c in MATRIX])
def test_a_real_model_trains_as_under_stock_keras(name, axis_name, path, two_replicas, tmp_path):
    case, axis = CASES[name], AXES[axis_name]
    strategy = two_replicas if axis.replicas == 2 else tf.distribute.get_strategy()
    model = _kmp_model(case, axis, path, strategy)
    losses = real_models.fit_steps(case, model, STEPS, BATCH)
    print(f"\n{name} / {axis_name} / {path}: {replica_step.describe_path(model)}; losses {np.round(losses, 5)}")
    assert np.all(np.isfinite(losses)), losses
    reference, skipped = _reference(case, axis)
    np.testing.assert_allclose(losses, reference, rtol=axis.rtol)
    assert abs(real_models.skipped_steps(model) - skipped) <= 1
    if path == "flat" and not case.own_step:
        assert replica_step.path_of(model)["taken"].startswith("flat buffers"), replica_step.describe_path(model)
    if case.name != "gan":  # its compile() takes two optimizers of its own: not restored from the file
        _assert_reloaded_model_steps_alike(case, model, axis, path, strategy, tmp_path)


def _assert_reloaded_model_steps_alike(case, model, axis, path, strategy, tmp_path):
    file = os.fspath(tmp_path / "model.keras")
    model.save(file)
    with strategy.scope():
        loaded = keras.saving.load_model(file)
        if _is_hub_task(loaded):
            # keras-hub's tasks compile themselves with their defaults when built, and a
            # .keras file restores those, not the optimizer saved (stock Keras alike): the user
            # compiles again, and the state comes from a weights file (as ModelCheckpoint's).
            weights = os.fspath(tmp_path / "model.weights.h5")
            model.save_weights(weights)
            real_models.compile_case(case, loaded, lambda: kmp.wrap(real_models.adamw(), **_wrap_args(axis)))
            loaded.optimizer.build(loaded.trainable_variables)
            loaded.load_weights(weights)
    for live, again in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(again, live)
    kmp.prepare(loaded, flat_buffers=path == "flat")
    x, y = case.data(BATCH)
    model.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    for live, again in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(again, live, rtol=1e-6, atol=1e-7)


def _is_hub_task(model) -> bool:
    import keras_hub

    return isinstance(model, keras_hub.models.Task)
