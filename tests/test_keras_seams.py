"""The Keras and TensorFlow internals kmp relies on still exist and behave.

kmp pins Keras 3.15 / TensorFlow 2.21 because kmp.LossScaleOptimizer
subclasses Keras's class and uses a few private hooks. When an upgrade moves
one of them, this file fails first, naming the hook, instead of training
silently going wrong.
"""

import inspect

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.ops import control_flow_util


def test_pinned_versions():
    assert keras.__version__.startswith("3.15."), keras.__version__
    assert tf.__version__.startswith("2.21."), tf.__version__


def test_inner_optimizer_reduction_hook_exists():
    # kmp all-reduces once and replaces this on its inner optimizer only.
    hook = tf_optimizer.TFOptimizer._all_reduce_sum_gradients
    assert list(inspect.signature(hook).parameters) == ["self", "grads_and_vars"]
    source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in source


@pytest.mark.parametrize(
    "name",
    ["build", "apply", "scale_loss", "get_config", "from_config", "_overwrite_variable_with_gradient"],
)
def test_keras_loss_scale_optimizer_methods_kmp_overrides_or_uses(name):
    assert callable(getattr(keras.optimizers.LossScaleOptimizer, name))


def test_keras_loss_scale_optimizer_state_names():
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build([keras.Variable(1.0)])
    assert opt.dynamic_scale.dtype == "float32"
    assert opt.step_counter is not None
    assert opt.iterations is opt.inner_optimizer.iterations


def test_trainer_scales_the_loss_and_applies_through_the_optimizer():
    source = inspect.getsource(tf_trainer.TensorFlowTrainer.train_step)
    assert "self.optimizer.scale_loss(loss)" in source
    assert "self.optimizer.apply_gradients(" in source


def test_distribution_internals():
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)
    assert callable(control_flow_util.GraphOrParentsInXlaContext)
    from keras.src.utils import tracking

    assert callable(tracking.no_automatic_dependency_tracking)
